"""RL on the real SmolLM2-135M-Instruct (`model=smollm2_135m`), on the CPU, through the main
job's library entry point (`train.train_and_evaluate`, what `python -m bpo_jax.main` calls).

Two BPO iterations and two GRPO iterations from the GGUF weights on one ALFWorld game, then a
third BPO iteration resumed from the checkpoint; the evaluation plays before and after. The
sizes are the smallest that still run every part (a tree with one branch point, a group of
three, two environment steps, 16-token answers); what they measure is that the pipeline runs
end to end on real weights, tokenizer and chat template, not the model's skill.

What the updates can show at this size: the untrained model's answers hold no
`<action>...</action>` (0 of 16 sampled 48-token answers to the first ALFWorld prompt, and its
greedy one, on 2026-12-05), so every episode earns the same return, every advantage is zero and
so is the policy gradient. The update's forward and backward passes still run on every row
(`train.skip_zero_advantage=False`: a zero-advantage row would otherwise skip them), and AdamW's
weight decay moves the weights by a known factor, so that the test sees the optimizer's steps
reach the checkpoint and the resumed run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import set_fields

from bpo_jax.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY = 1e-3, 0.1  # AdamW: a zero gradient scales the weights by 1 - LR * WEIGHT_DECAY.

# One task of two steps, answers of up to 16 tokens, prompts of up to 256 (the chat agent cuts
# the observation to fit), one evaluation game of two steps.
SMALL = {
    "train.iterations": 2,
    "train.tasks_per_iter": 1,
    "train.group_size": 3,  # BPO's budget: three episodes, two backbones and one branch.
    "train.lr": LR,
    "train.weight_decay": WEIGHT_DECAY,
    "train.skip_zero_advantage": False,
    # Memory, on a machine whose other jobs leave a few GB: every row is padded to the
    # minibatch (6 sequences an iteration), the gradient is accumulated over microbatches of 2
    # rows, each layer's activations are recomputed in the backward pass, and the LM head
    # scores 64 positions at a time. With the cpu variant's minibatch of 64 rows at once the
    # update took 11.8 GB (its [rows, positions, 49,152] float32 logits), and with 8 rows
    # without remat 5.5 GB; the OOM killer ended both (2026-12-05).
    "train.minibatch_size": 8,
    "train.microbatch_size": 2,
    "train.logits_chunk": 64,
    "model.remat": "full",
    "rollout.root_group": 2,
    "rollout.num_branches": 2,
    "rollout.branch_budget": 1,
    "rollout.max_depth": 1,
    "rollout.selector": "interval",  # Branch at the first step that can (step 1 of 0-1).
    "rollout.interval": 1,
    "rollout.overlap_cohorts": 1,
    "env.max_steps": 2,
    "agent.max_prompt_tokens": 256,
    "agent.max_action_tokens": 16,
    "model.max_seq_len": 272,
    "model.scan_layers": True,  # The update compiles one layer, not 30.
    "eval.num_tasks": 1,
    "checkpoint.every": 1,
}


def smollm_rl_config(algo: str, **fields):
    arg = f"cpu,model=smollm2_135m,algo={algo}"
    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config(arg)
    return set_fields(cfg, {**SMALL, **fields})


def _flat(tree) -> dict[str, np.ndarray]:
    """The first decoder layer's weights by their path ('layers/0/...'), as float32 NumPy
    arrays: a full-weight update moves them all, and AdamW's decay each by the same factor;
    host copies of the whole model would cost another 540 MB."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        name = "/".join(k for k in keys if k != "value")  # nnx.Variable's own level.
        if "/0/" in f"/{name}/":
            out[name] = np.asarray(leaf, dtype=np.float32)
    assert out, f"no first-layer leaf in {[jax.tree_util.keystr(p) for p, _ in leaves[:5]]}"
    return out


def _relative_change(workdir: Path, initial: dict[str, np.ndarray]) -> float:
    """||saved params - GGUF params|| / ||GGUF params|| over the first layer's weights."""
    from bpo_jax.io.checkpoint import Checkpointer

    with Checkpointer(workdir / "checkpoints") as ckpt:
        _, tree, _ = ckpt.restore()
    saved = _flat(tree["train_state"]["params"])
    assert saved.keys() == initial.keys(), sorted(set(saved) ^ set(initial))[:5]
    diff = sum(float(np.sum(np.square(saved[k] - initial[k], dtype=np.float64))) for k in initial)
    norm = sum(float(np.sum(np.square(initial[k], dtype=np.float64))) for k in initial)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def gguf_params():
    """The weights every run starts from, as the checkpoint's leaves are named (host copies:
    the session's own SmolLM2 fixture would keep a second model on the device)."""
    from bpo_jax.models.gguf import load_gguf

    _, model = load_gguf("smollm2_135m_instruct")
    return _flat(nnx.split(model)[1].to_pure_dict())


def _check_weights_moved(workdir: Path, initial, grad_norms, steps: int) -> float:
    """The checkpoint's weights moved from the GGUF's: by the policy gradient where there was
    one, else by exactly `steps` AdamW weight decays. Returns the relative change."""
    change = _relative_change(workdir, initial)
    if max(grad_norms) > 0:
        assert change > 0.0
    else:
        decayed = 1.0 - (1.0 - LR * WEIGHT_DECAY) ** steps
        assert change == pytest.approx(decayed, rel=1e-2), (change, decayed, steps)
    return change


# 16 min for both on 2 shared cores at load average 8-40 (2026-12-05: BPO 687 s with its resume,
# GRPO 260 s); not measured on a quiet machine.
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["bpo", "grpo"])
def test_two_iterations_from_the_real_model(tmp_path, algo, gguf_params):
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = smollm_rl_config(algo)
    start = time.perf_counter()
    summary = train_and_evaluate(cfg, tmp_path)
    seconds = time.perf_counter() - start
    assert summary["iterations"] == 2 and summary["eval_tasks"] == 1
    for key in ("success_before_rl", "success_after_rl"):
        assert 0.0 <= summary[key] <= 1.0
    records = read_metrics(tmp_path)
    iters = [r for r in records if "train/iteration" in r]
    assert [r["train/iteration"] for r in iters] == [1, 2]
    assert all(r["compute/generated_tokens"] > 0 and r["compute/env_steps"] > 0 for r in iters)
    if algo == "bpo":
        assert sum(r["train/branch_points"] for r in iters) > 0  # A tree, not two backbones.
    norms = [r["update/grad_norm"] for r in records if "update/grad_norm" in r]
    # One minibatch an iteration, each a full forward and backward pass.
    assert len(norms) == summary["updates"] == 2 and all(np.isfinite(norms)), norms
    change = _check_weights_moved(tmp_path, gguf_params, norms, steps=2)
    evals = json.loads((tmp_path / "evals.json").read_text())
    assert evals["after_rl"]["eval/update_step"] == 2
    line = (
        f"\n{algo}: 2 iterations {seconds:.0f} s; returns "
        f"{[round(r['train/return'], 3) for r in iters]}, grad norms {norms}, weights moved by "
        f"{change:.3e} (relative); greedy success before {summary['success_before_rl']}, after "
        f"{summary['success_after_rl']}"
    )
    if algo == "grpo":
        print(line)
        return

    # A third iteration resumes from the saved state: iterations 1 and 2 are not replayed, and
    # the optimizer continues from the saved step (three decays in all, not one).
    cfg.train.iterations = 3
    start = time.perf_counter()
    summary = train_and_evaluate(cfg, tmp_path)
    resume_seconds = time.perf_counter() - start
    assert summary["iterations"] == 3 and summary["updates"] == 3
    records = read_metrics(tmp_path)
    assert [r["train/iteration"] for r in records if "train/iteration" in r] == [1, 2, 3]
    norms = [r["update/grad_norm"] for r in records if "update/grad_norm" in r]
    change = _check_weights_moved(tmp_path, gguf_params, norms, steps=3)
    assert json.loads((tmp_path / "evals.json").read_text())["after_rl"]["eval/update_step"] == 3
    print(f"{line}; resumed third iteration {resume_seconds:.0f} s, weights moved by {change:.3e}")


# About two minutes on 2 cores (its programs are the BPO case's plus the adapters').
@pytest.mark.slow
def test_two_iterations_with_lora_on_the_real_model(tmp_path):
    """LoRA over the real weights (`model.lora.rank=8`): two GRPO iterations train the adapters
    only, and the checkpoint holds them with the GGUF file named as their base. The base is
    never saved; with no policy gradient (see the module's docstring) B stays exactly 0 and
    AdamW's decay moves A alone."""
    from bpo_jax.io.checkpoint import Checkpointer
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = smollm_rl_config("grpo")
    cfg.model.lora.rank = 8
    cfg.model.lora.alpha = 16.0
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 2 and summary["updates"] == 2
    norms = [r["update/grad_norm"] for r in read_metrics(tmp_path) if "update/grad_norm" in r]
    assert len(norms) == 2 and all(np.isfinite(norms)), norms
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        _, tree, meta = ckpt.restore()
    assert meta["lora_base"] == "smollm2_135m_instruct"
    saved = _flat(tree["train_state"]["params"])
    assert saved and all("_lora_" in k for k in saved), sorted(saved)[:5]
    a = {k: v for k, v in saved.items() if "_lora_a" in k}
    b = {k: v for k, v in saved.items() if "_lora_b" in k}
    assert len(a) == len(b) > 0
    # Rank 8 on every projection of the first layer: a few thousand numbers a matrix, not the
    # layer's 3.5M weights.
    assert all(8 in v.shape for v in saved.values())
    if max(norms) == 0:
        assert all(not np.any(v) for v in b.values())
    else:
        assert any(np.any(v) for v in b.values())
    assert all(np.any(v) for v in a.values())
