"""A run whose workdir is `gs://bucket/run` writes its files to the bucket, and resumes from it.

The buckets are an emulator's (fake-gcs-server, `tests/gcs_emulator.py`), which epath (gcsfs),
TensorStore and google-cloud-storage reach over the GCS JSON API. The run under test uses its
real `gs://` code paths throughout; nothing in `bpo_jax` is patched. The tests look at a bucket
through epath too: a `gs://` path, as any reader of the run's files would.
"""

import json
import uuid

import jax.numpy as jnp
import pytest
from etils import epath
from google.cloud import storage
from test_experiments import tiny_cpu_config

from bpo_jax.io import files
from bpo_jax.io.checkpoint import Checkpointer, abstract_like

pytest_plugins = ("gcs_emulator",)  # Its session fixture, `gcs_emulator`.


@pytest.fixture(scope="module")
def store(gcs_emulator):
    """The emulator's buckets: `store / bucket / name` is the object `gs://bucket/name`."""
    return epath.Path("gs://")


def _bucket(store: epath.Path) -> tuple[str, epath.Path]:
    name = f"bucket-{uuid.uuid4().hex[:8]}"
    storage.Client().create_bucket(name)  # The emulator makes none on a first write.
    return f"gs://{name}/run", store / name / "run"


def test_as_path_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(files.as_path("gs://b/run") / "x.json") == "gs://b/run/x.json"
    assert files.is_remote(files.as_path("gs://b/run"))
    assert files.as_path("runs/x") == tmp_path / "runs" / "x"
    assert not files.is_remote(files.as_path("runs/x"))


def test_checkpointer_saves_restores_and_lists_steps_in_a_bucket(store):
    url, folder = _bucket(store)
    state = {"w": jnp.arange(12.0).reshape(3, 4), "n": 3}
    with Checkpointer(f"{url}/checkpoints", max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {**state, "w": state["w"] * step}, meta={"step": step})
    # Orbax's GCS path: no rename, a commit marker per finished step; step 1 rotated out.
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["2", "3"]
    assert (folder / "checkpoints" / "3" / "commit_success.txt").is_file()
    with Checkpointer(f"{url}/checkpoints") as ckpt:
        assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
        step, restored, meta = ckpt.restore(abstract_state=abstract_like(state))
    assert step == 3 and meta == {"step": 3}
    assert (restored["w"] == state["w"] * 3).all()


def test_a_damaged_step_in_a_bucket_is_set_aside_and_the_previous_one_restored(store):
    url, folder = _bucket(store)
    state = {"w": jnp.arange(1000.0), "n": 3}
    with Checkpointer(f"{url}/checkpoints") as ckpt:
        ckpt.save(1, state, meta={"step": 1})
        ckpt.save(2, {**state, "w": state["w"] + 1}, meta={"step": 2})
    (folder / "checkpoints" / "2" / "state" / "_METADATA").write_text("{")  # Cut short.
    with Checkpointer(f"{url}/checkpoints") as ckpt:
        step, restored, meta = ckpt.restore_intact(abstract_like(state))
        assert step == 1 and meta == {"step": 1} and (restored["w"] == state["w"]).all()
        assert ckpt.all_steps() == [1]
    aside = folder / "checkpoints_damaged" / "2" / "state" / "_METADATA"
    assert aside.read_text() == "{"  # Copied object by object, then deleted from the steps.
    assert not (folder / "checkpoints" / "2").exists()


def test_files_write_whole_objects_in_a_bucket(store):
    url, folder = _bucket(store)
    files.write_text(f"{url}/a.json", "{}")
    files.write_text(f"{url}/a.json", '{"x": 1}')  # In place: a bucket has no atomic rename.
    assert json.loads((folder / "a.json").read_text()) == {"x": 1}
    assert sorted(p.name for p in folder.iterdir()) == ["a.json"]  # No temporary left over.
    files.copy(f"{url}/a.json", f"{url}/sub/b.json")
    assert [p.name for p in files.iter_files(url)] == ["a.json", "b.json"]


@pytest.mark.slow
def test_run_in_a_bucket_writes_there_and_resumes(store, tmp_path, monkeypatch):
    """The tiny ALFWorld run with a `gs://` workdir: nothing lands in the working directory
    (pathlib made it the local folder `gs:/bucket/run`), the run's files are objects in the
    bucket, and a second call resumes from the bucket's checkpoint for one more iteration."""
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    monkeypatch.chdir(tmp_path)
    url, folder = _bucket(store)
    cfg = tiny_cpu_config(**{"train.iterations": 1, "eval.num_tasks": 1})
    first = train_and_evaluate(cfg, url)
    assert list(tmp_path.iterdir()) == []  # No `gs:` folder (nor anything else) in the cwd.
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "metrics.jsonl", "evals.json", "summary.json"} <= names
    assert {"tokenizer.model", "expert_demos.json", "checkpoints", "tb"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    assert any((folder / "tb").iterdir())  # TensorBoard events, through epath.
    assert json.loads((folder / "summary.json").read_text())["iterations"] == 1
    steps = sorted(int(p.name) for p in (folder / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] == first["updates"]

    cfg.train.iterations = 2  # Resume the finished run for one more iteration.
    second = train_and_evaluate(cfg, url)
    assert second["iterations"] == 2 and second["updates"] > first["updates"]
    assert second["success_before_rl"] == first["success_before_rl"]  # Kept, not redone.
    iterations = [r["train/iteration"] for r in read_metrics(url) if "train/iteration" in r]
    assert iterations == [1, 2]  # The resumed run appended to the bucket's metrics object.
    assert list(tmp_path.iterdir()) == []


def test_hf_checkpoint_in_a_bucket_loads_as_from_disk(store, tmp_path):
    """`load_hf_checkpoint("gs://...")` reads the header and each slice by ranged reads of the
    object, and gives the same parameters as the same files on the local disk."""
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from bpo_jax.models import hf_import

    hf_config = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32,
        "dtype": "float32",
    }
    cfg = hf_import.config_from_hf(hf_config)
    rng = np.random.default_rng(0)
    tensors = {
        n: rng.standard_normal(s).astype(np.float32)
        for e in hf_import.tensor_map(cfg)
        for n, s in zip(e.hf_names, e.hf_shapes)
    }
    local = tmp_path / "ckpt"
    local.mkdir()
    save_file(tensors, str(local / "model.safetensors"))
    (local / "config.json").write_text(json.dumps(hf_config))
    url, folder = _bucket(store)
    for name in ("model.safetensors", "config.json"):
        files.copy(local / name, f"{url}/{name}")
    assert (folder / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()

    def params(path):
        _, model = hf_import.load_hf_checkpoint(path)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        return {p: np.asarray(v.get_value()) for p, v in flat}

    remote, on_disk = params(url), params(local)
    assert remote.keys() == on_disk.keys()
    for p, value in on_disk.items():
        assert remote[p].tobytes() == value.tobytes(), p
