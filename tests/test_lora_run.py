"""Short CPU runs with LoRA (`model.lora.rank > 0`) on the tiny ALFWorld setting: behaviour
cloning and RL train the adapters, the KL reference is the base, PPO's critic reads the
adapted policy's features, checkpoints hold the adapters only, and a longer run resumes."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_experiments import tiny_cpu_config

from bpo_jax.io.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]


def _flat_keys(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_keys(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["bpo", "ppo"])
def test_two_iterations_with_lora_then_resume(tmp_path, algo):
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = tiny_cpu_config()
    cfg.train.algo = algo
    cfg.train.kl_coef = 0.05
    cfg.model.lora.rank = 4
    cfg.model.lora.alpha = 8.0
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 2
    records = read_metrics(tmp_path)
    norms = [r["update/grad_norm"] for r in records if "update/grad_norm" in r]
    assert norms and all(np.isfinite(norms)) and max(norms) > 0

    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        step, tree, meta = ckpt.restore()
    keys = list(_flat_keys(tree))
    params = [k for k in keys if k.startswith("train_state/params/")]
    # The adapters only: no base weight (embedding, projections, norms) is saved.
    assert params and all("_lora_" in k for k in params), params[:5]
    assert not any("embed_tokens" in k or "qkv_proj" in k for k in keys)
    assert all("_lora_" in k for k in keys if k.startswith("ref_params/"))
    assert ("critic" in tree) == (algo == "ppo")
    assert meta["lora_base"] == "tiny (random, seed 0)"

    # One more iteration: the run resumes from its checkpoint (adapters onto the same base).
    cfg.train.iterations = 3
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 3
    iters = [r["train/iteration"] for r in read_metrics(tmp_path) if "train/iteration" in r]
    assert iters == [1, 2, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["iterations"] == 3


@pytest.mark.slow
def test_device_check_script_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    """scripts/device_check_7b.sh --tiny: the accelerator check's programs (LoRA and full
    updates, a prefill and a decode) on the tiny preset; about 90 s on 2 busy cores."""
    out = tmp_path / "check.json"
    proc = subprocess.run(
        ["bash", "scripts/device_check_7b.sh", "--tiny", "--full", "--steps=1", f"--json={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for name in ("update_lora", "update_full", "prefill", "decode"):
        assert report[name]["tokens_per_s"] > 0, name
        assert report[name]["mfu"] is None  # No peak FLOP/s is known for a CPU.
    assert "update_lora: " in proc.stdout and "turn (8 rows)" in proc.stdout
