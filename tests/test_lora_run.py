"""Short CPU runs with LoRA (`model.lora.rank > 0`) on the tiny ALFWorld setting: behaviour
cloning and RL train the adapters, the KL reference is the base, PPO's critic reads the
adapted policy's features, checkpoints hold the adapters only, and a longer run resumes."""

import json

import numpy as np
import pytest
from test_experiments import tiny_cpu_config

from bpo_jax.io.checkpoint import Checkpointer


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
