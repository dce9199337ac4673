"""Tests for bpo_jax.io.checkpoint: full training-state round trips, pruning, shardings, errors."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bpo_jax.io import checkpoint as ckpt_lib


class TinyPolicy(nnx.Module):
    """A Linear plus a Dropout, so the NNX state also holds a typed RngKey and an RngCount."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def make_state(seed: int, train_steps: int = 2):
    """Model state, optax.adamw state after some updates, a step and both kinds of PRNG key."""
    model = TinyPolicy(nnx.Rngs(params=seed, dropout=seed + 100))
    params = nnx.state(model, nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(train_steps):
        params, opt_state = train_step(params, opt_state)
    nnx.update(model, params)
    model(jnp.ones((2, 3)))  # Advances the dropout RngCount, so it is not just the init value.
    return {
        "model": nnx.state(model),
        "opt": opt_state,
        "step": 7 + seed,
        "rng": jax.random.split(jax.random.key(seed), 3),
        "legacy_rng": jax.random.PRNGKey(seed),
    }


def plain_leaves(tree):
    """Leaves with typed keys as key data, for exact comparison."""
    return jax.tree.leaves(ckpt_lib.to_checkpointable(tree))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(plain_leaves(a), plain_leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_exact(tmp_path):
    saved = make_state(seed=0)
    with ckpt_lib.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, saved, meta={"episodes": 12, "note": "x"})
        ckpt.wait()
        assert ckpt.latest_step() == 7

    # A new Checkpointer, as after a restart, restoring into a differently seeded fresh state.
    fresh = make_state(seed=1, train_steps=0)
    with ckpt_lib.Checkpointer(tmp_path / "ckpt") as ckpt:
        step, restored, meta = ckpt.restore(abstract_state=ckpt_lib.abstract_like(fresh))
    assert step == 7
    assert meta == {"episodes": 12, "note": "x"}
    assert_trees_equal(restored, saved)
    assert isinstance(restored["model"], nnx.State)
    assert isinstance(restored["opt"][0], optax.ScaleByAdamState)
    assert restored["step"] == 7 and isinstance(restored["step"], int)
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(restored["rng"]) == jax.random.key_impl(saved["rng"])
    np.testing.assert_array_equal(
        jax.random.uniform(restored["rng"][0], (4,)), jax.random.uniform(saved["rng"][0], (4,))
    )
    dropout_key = restored["model"]["drop"]["rngs"]["key"].get_value()
    assert jax.dtypes.issubdtype(dropout_key.dtype, jax.dtypes.prng_key)

    # The restored state drives a model exactly like the saved one.
    model = TinyPolicy(nnx.Rngs(params=5, dropout=6))
    nnx.update(model, restored["model"])
    reference = TinyPolicy(nnx.Rngs(params=5, dropout=6))
    nnx.update(reference, saved["model"])
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(model(x), reference(x))


def test_restore_into_eval_shape_abstract(tmp_path):
    # nnx.eval_shape gives ShapeDtypeStructs without shardings: arrays land on the default device.
    model = TinyPolicy(nnx.Rngs(params=0, dropout=1))
    saved = {"model": nnx.state(model)}
    abstract_model = nnx.eval_shape(lambda: TinyPolicy(nnx.Rngs(params=0, dropout=1)))
    with ckpt_lib.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, saved)
        _, restored, meta = ckpt.restore(1, abstract_state={"model": nnx.state(abstract_model)})
    assert meta == {}
    assert_trees_equal(restored, saved)


def test_nnx_optimizer_state(tmp_path):
    model = TinyPolicy(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    saved = {"optimizer": nnx.state(optimizer)}
    fresh = nnx.Optimizer(TinyPolicy(nnx.Rngs(1)), optax.adamw(1e-2), wrt=nnx.Param)
    with ckpt_lib.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, saved)
        _, restored, _ = ckpt.restore(
            abstract_state=ckpt_lib.abstract_like({"optimizer": nnx.state(fresh)})
        )
    assert_trees_equal(restored, saved)
    nnx.update(fresh, restored["optimizer"])
    assert int(fresh.step[...]) == 1


def test_restore_without_abstract_gives_raw_tree(tmp_path):
    saved = make_state(seed=0)
    with ckpt_lib.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, saved)
        step, raw, _ = ckpt.restore()
    assert step == 3
    assert raw["step"] == 7
    # Typed keys come back as their stored uint32 key data.
    assert raw["rng"].dtype == jnp.uint32 and raw["rng"].shape == (3, 2)
    np.testing.assert_array_equal(raw["rng"], jax.random.key_data(saved["rng"]))
    np.testing.assert_array_equal(
        raw["model"]["lin"]["kernel"]["value"], saved["model"]["lin"]["kernel"][...]
    )


def test_latest_step_and_max_to_keep_pruning(tmp_path):
    state = {"w": jnp.arange(3.0)}
    with ckpt_lib.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in range(1, 5):
            assert ckpt.save(step, {"w": state["w"] + step})
        ckpt.wait()
        assert ckpt.latest_step() == 4
        assert ckpt.all_steps() == [3, 4]
        _, restored, _ = ckpt.restore(3, abstract_state=ckpt_lib.abstract_like(state))
    np.testing.assert_array_equal(restored["w"], np.arange(3.0) + 3)
    on_disk = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert on_disk == [3, 4]


def test_save_interval_force_and_stale_steps(tmp_path):
    state = {"w": jnp.zeros(2)}
    with ckpt_lib.Checkpointer(tmp_path, save_interval_steps=2) as ckpt:
        assert ckpt.save(1, state)  # Orbax always writes the first save of an empty directory.
        assert ckpt.save(2, state)
        assert not ckpt.save(3, state)
        assert ckpt.save(3, state, force=True)
        assert not ckpt.save(5, state)
        # A resumed run re-saving its restored step, or an older one, writes nothing.
        assert not ckpt.save(3, state, force=True)
        assert not ckpt.save(2, state)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]


def test_restore_with_shardings_on_mesh(tmp_path):
    mesh = jax.make_mesh((1,), ("data",))
    row = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    saved = {
        "w": jax.device_put(jnp.arange(8.0).reshape(4, 2), row),
        "b": jax.device_put(jnp.ones(2, jnp.bfloat16), replicated),
        "keys": jax.device_put(jax.random.split(jax.random.key(0), 4), row),
        "step": 11,
    }
    abstract = {
        "w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=row),
        "b": jax.ShapeDtypeStruct((2,), jnp.bfloat16, sharding=replicated),
        "keys": jax.ShapeDtypeStruct((4,), saved["keys"].dtype, sharding=row),
        "step": 0,
    }
    with ckpt_lib.Checkpointer(tmp_path) as ckpt:
        ckpt.save(11, saved)
        _, restored, _ = ckpt.restore(abstract_state=abstract)
    assert_trees_equal(restored, saved)
    for name in ("w", "b", "keys"):
        assert restored[name].sharding == abstract[name].sharding, name
    assert restored["b"].dtype == jnp.bfloat16


def test_restore_errors(tmp_path):
    missing = tmp_path / "never-written"
    ckpt = ckpt_lib.Checkpointer(missing)
    assert ckpt.directory.is_absolute()
    assert not missing.exists()  # Only a save creates the directory.
    with pytest.raises(FileNotFoundError, match="never-written does not exist"):
        ckpt.restore()
    ckpt.close()

    missing.mkdir()
    with ckpt_lib.Checkpointer(missing) as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoints in"):
            ckpt.restore()
        ckpt.save(2, {"w": jnp.zeros(3)})
        with pytest.raises(FileNotFoundError, match=r"step 5 .* available steps: \[2\]"):
            ckpt.restore(5)
        bad = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
        with pytest.raises(ValueError, match="does not match abstract_state"):
            ckpt.restore(abstract_state=bad)
        with pytest.raises(TypeError, match="JSON-serialisable"):
            ckpt.save(3, {"w": jnp.zeros(3)}, meta={"x": jnp.zeros(2)})


def test_relative_directory_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with ckpt_lib.Checkpointer("rel/ckpt") as ckpt:
        assert ckpt.directory == tmp_path / "rel" / "ckpt"
        ckpt.save(1, {"w": jnp.zeros(1)})
    assert (tmp_path / "rel" / "ckpt" / "1").is_dir()


def test_constructor_validation(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep must be >= 1"):
        ckpt_lib.Checkpointer(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="save_interval_steps must be >= 1"):
        ckpt_lib.Checkpointer(tmp_path, save_interval_steps=0)


def _two_steps(directory):
    tree = {"a": jnp.arange(1000.0), "b": {"c": jnp.ones((50, 50))}, "rng": jax.random.key(0)}
    with ckpt_lib.Checkpointer(directory, max_to_keep=3) as c:
        c.save(1, tree, {"step": 1})
        c.save(2, jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, tree), {"step": 2})
    return tree


def _damageable_files(step_dir):
    """Every file of a step whose loss must be noticed: array data and the metadata files."""
    files = []
    for path in sorted(step_dir.rglob("*")):
        rel = str(path.relative_to(step_dir))
        # _CHECKPOINT_METADATA, _sharding and the per-process OCDBT manifest are not needed to
        # read the state back (Orbax restores correctly without them): not damage.
        if path.is_file() and path.name not in ("_CHECKPOINT_METADATA", "_sharding"):
            if rel != "state/ocdbt.process_0/manifest.ocdbt":
                files.append(rel)
    return files


def test_a_damaged_latest_step_falls_back_to_the_previous_one(tmp_path, caplog):
    base = tmp_path / "pristine"
    tree = _two_steps(base)
    files = _damageable_files(base / "2")
    data = [f for f in files if "/d/" in f]
    assert data and {"state/_METADATA", "meta/metadata"} <= set(files)
    data_damaged = False
    for rel in files:
        work = tmp_path / rel.replace("/", "_")
        shutil.copytree(base, work)
        path = work / "2" / rel
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        with ckpt_lib.Checkpointer(work) as c:
            try:
                c.restore(2, ckpt_lib.abstract_like(tree))
            except ckpt_lib.CheckpointDamagedError as e:
                message = str(e)
            else:
                continue  # Half of this file still held everything the restore needs.
            assert "\n" not in message and "checkpoint step 2" in message
            assert "does not match" not in message
            if rel.endswith("metadata") or rel.endswith("_METADATA") or "array_metadatas" in rel:
                assert rel in message
            caplog.clear()
            step, restored, meta = c.restore_intact(ckpt_lib.abstract_like(tree))
            assert step == 1 and meta == {"step": 1}
            np.testing.assert_array_equal(restored["a"], tree["a"])
            assert any("is damaged" in r.getMessage() for r in caplog.records)
            assert c.all_steps() == [1]
            # Set aside, not deleted; and the run can save step 2 again.
            assert (tmp_path / (work.name + "_damaged") / "2" / rel).exists()
            assert c.save(2, tree, {"step": 2})
        if "/d/" in rel:
            data_damaged = True
    assert data_damaged


def test_every_step_damaged_raises_the_newest_error(tmp_path):
    tree = _two_steps(tmp_path / "c")
    for step in ("1", "2"):
        (tmp_path / "c" / step / "state" / "_METADATA").write_text("{")
    with ckpt_lib.Checkpointer(tmp_path / "c") as c:
        with pytest.raises(ckpt_lib.CheckpointDamagedError, match="step 2 .*state/_METADATA"):
            c.restore_intact(ckpt_lib.abstract_like(tree))
