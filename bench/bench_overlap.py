"""Overlapping sampling with environment steps: rollout time against its environment floor.

ALFWorld's CPU configuration (`experiments/alfworld.py:cpu`: fork-server sandboxes, the tiny
policy with random weights, `env.num_workers` workers), batches of 4 tasks x 4 independent
episodes (forks of one reset). Each batch is played with every `--cohorts` value in turn, on the
same tasks (the order alternates from batch to batch), after one unrecorded warm-up batch per
value (compilation; a prompt-length bucket first seen later compiles then, reported per row).
Per batch and value: rollout seconds, resets, sampling, time blocked on the env steps, the
steps' summed send-to-reply latency, the environment floor (env steps x mean step latency /
workers, `bpo_jax.rollout.timing.env_floor_metrics`) and the rollout's ratio to it, with and without
the resets. Prints a table and writes JSON.

  source scripts/_data_env.sh
  python bench/bench_overlap.py --batches 3 --out bench/results/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bpo_jax import builders  # noqa: E402
from bpo_jax.config import validate  # noqa: E402
from bpo_jax.experiment import load_experiment  # noqa: E402
from bpo_jax.rollout.engine import TreeSpec, play_forest  # noqa: E402
from bpo_jax.rollout.timing import CompileClock, env_floor_metrics  # noqa: E402
from bpo_jax.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BC_TOKENIZER = Path("/work/runs/bc_all_games/tokenizer.model")


def make_policy(cfg, tokenizer_path: Path):
    """The configured tiny policy with random weights, over the behaviour-cloned run's
    tokenizer (its prompts and actions have the training run's token counts)."""
    tok = load_tokenizer(tokenizer_path)
    mcfg, model = builders.build_model(cfg, tok, None)
    graphdef, params = nnx.split(model)
    return builders.make_policy(cfg, graphdef, params, tok, mcfg)


def one_batch(pool, policy, agent, tasks, cohorts: int, seed: int) -> dict:
    compile0 = CompileClock.total()
    t0 = time.perf_counter()
    forest = play_forest(
        pool, policy, agent, tasks, TreeSpec(root_group=4), rng=jax.random.key(seed),
        cohorts=cohorts,
    )  # fmt: skip
    rollout = time.perf_counter() - t0
    sec, steps = forest.seconds, forest.stats.env_steps
    floor = env_floor_metrics(sec, steps, pool.num_workers, rollout)
    reset = sec.get("reset", 0.0)
    return {
        "cohorts": cohorts,
        "rollout_s": rollout,
        "reset_s": reset,
        "sampling_s": sec.get("sampling", 0.0),
        # JAX compiling a new prompt-length bucket, inside `sampling_s` (and the rollout).
        "compile_s": CompileClock.total() - compile0,
        "env_wait_s": sec.get("env", 0.0),
        "env_busy_s": sec.get("env_busy", 0.0),
        "step_latency_s": floor["time/env_step_latency_seconds"],
        "env_floor_s": floor["time/env_floor_seconds"],
        "over_floor": floor["time/rollout_over_floor"],
        "over_floor_without_resets": (rollout - reset) / floor["time/env_floor_seconds"],
        "env_steps": steps,
        "generated_tokens": forest.stats.generated_tokens,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3, help="recorded batches per cohorts value")
    ap.add_argument("--cohorts", default="1,2", help="values of rollout.overlap_cohorts")
    ap.add_argument("--tasks", type=int, default=4, help="tasks per batch")
    ap.add_argument("--workers", type=int, default=0, help="env.num_workers (0: the config's)")
    ap.add_argument("--tokenizer", default=str(BC_TOKENIZER))
    ap.add_argument("--out", default="bench/results/overlap.json")
    args = ap.parse_args()
    raw = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu,algo=grpo")
    if args.workers:
        raw.env.num_workers = args.workers
    cfg = validate(raw)
    values = [int(v) for v in args.cohorts.split(",")]
    policy = make_policy(cfg, Path(args.tokenizer))
    agent = builders.make_agent(cfg, policy.tokenizer)
    train, _ = builders.select_tasks(cfg)
    n = args.tasks
    batches = [[train[(i * n + j) % len(train)] for j in range(n)] for i in range(args.batches + 1)]
    rows = []
    t_start = time.time()
    with builders.make_pool(cfg) as pool:
        for b, tasks in enumerate(batches):
            order = values if b % 2 == 0 else values[::-1]
            for c in order:
                row = one_batch(pool, policy, agent, tasks, c, seed=b)
                row["batch"] = b - 1  # -1: the warm-up.
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)  # fmt: skip
                if b > 0:
                    rows.append(row)
    summary = {}
    for c in values:
        mine = [r for r in rows if r["cohorts"] == c]
        summary[str(c)] = {k: float(np.mean([r[k] for r in mine])) for k in mine[0] if k != "batch"}
    base = {r["batch"]: r["rollout_s"] for r in rows if r["cohorts"] == values[0]}
    paired = {
        str(c): [r["rollout_s"] / base[r["batch"]] for r in rows if r["cohorts"] == c]
        for c in values[1:]
    }
    cols = [
        ("C", "cohorts", "d"), ("rollout s", "rollout_s", ".1f"), ("resets s", "reset_s", ".1f"),
        ("sampling s", "sampling_s", ".1f"), ("of it compiling", "compile_s", ".1f"),
        ("env wait s", "env_wait_s", ".1f"),
        ("step latency s", "step_latency_s", ".3f"), ("env floor s", "env_floor_s", ".1f"),
        ("rollout / floor", "over_floor", ".2f"),
        ("(rollout - resets) / floor", "over_floor_without_resets", ".2f"),
    ]  # fmt: skip
    print("\nmean over batches")
    print(" | ".join(name for name, _, _ in cols))
    for c in values:
        s = summary[str(c)]
        print(" | ".join(format(s[k], f) if f != "d" else str(c) for _, k, f in cols))
    for c, ratios in paired.items():
        print(f"rollout seconds, C = {c} / C = {values[0]} per batch: {np.round(ratios, 2)}")
    record = {
        "config": "experiments/alfworld.py:cpu,algo=grpo (random-init tiny policy)",
        "tasks_per_batch": n,
        "episodes_per_task": 4,
        "num_workers": cfg.env.num_workers,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "wall_seconds": time.time() - t_start,
        "rows": rows,
        "mean": summary,
        "paired_rollout_ratio": paired,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
