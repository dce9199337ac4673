r"""Does a branch rule collapse onto one path? Branch-point concentration per rule, on ALFWorld.

AEPO's failure mode of entropy-triggered branching ("high-entropy rollout collapse"): the paths
in high-entropy states branch, their children are in the same states and branch again, and the
branch points pile up on one path while the task's other backbones get none. From one tiny CPU
policy (a CPU run's checkpoint, via `init_from`), every registered branch rule plays the same
batches of the same ALFWorld training tasks as BPO trees under the same auto budget, each from a
fresh rollout state. Per task with two or more branch points (`bpo_jax.rollout.concentration`):

  backbone   the largest share of the task's branch points under one backbone;
  uniform    the same share if each branch point fell on a backbone drawn uniformly and
             independently (exact, for the task's own counts): the no-collapse reference;
  excess     backbone - uniform, paired per task (> 0: more concentrated than chance);
  path       the largest share on one root-to-leaf path (nested on one line); the `uniform`
             rule's value is its reference (no closed form: where a child may branch depends on
             the tree grown so far);
and per rule the branch points per task, the share of tasks with two or more, and f (the share
of the return variance the chosen histories explain, `rollout.explained`). Means over tasks
pooled over batches, 95% bootstrap CIs over those tasks. The config's per-backbone branch budget
(`rollout.branch_budget`) caps a backbone's share at budget / n whatever the rule: raise it with
`--set rollout.branch_budget=...` to let a rule collapse further.

  python -m bpo_jax.main --config=experiments/alfworld.py:cpu --workdir=runs/alfworld_cpu
  python bench/branch_concentration.py --source=runs/alfworld_cpu \
      --json=bench/results/branch_concentration.json

`--source` is a run directory with `config.json` and `checkpoints/` (only its policy is read).
Defaults (three tasks a batch, two batches a rule, the `cpu` settings otherwise) keep the five
rules under about ten minutes on two busy CPU cores.

Measured (bench/results/branch_concentration*.json; the policy of a CPU run, 150 behaviour-
cloning steps and 4 RL iterations; `--set train.group_size=8` so that a task has slack for
several branch points; 6 tasks a rule): no collapse. With `rollout.branch_budget=4` the entropy
rule's backbone share is 0.50 [0.37, 0.71] against 0.54 under uniform placement, its path share
0.34 [0.25, 0.47] against the uniform rule's 0.32 [0.28, 0.36]; without the per-backbone cap
(`branch_budget=12`, `max_depth=4`) 0.53 against 0.53, and 0.38 against 0.41. Only
`action_samples` sits higher on one path (0.48 [0.42, 0.57] in both). Six tasks are few: these
say the tiny policy shows no collapse, not that a 7B policy cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from bench_branch_rules import (  # bench/ is on sys.path
    add_source_flags,
    source_config,
    source_record,
    source_run,
)

from bpo_jax.parallel import platforms
from bpo_jax.rl import RolloutState, play_batch
from bpo_jax.rollout.branching import SELECTORS
from bpo_jax.rollout.concentration import task_concentration, uniform_backbone_share
from bpo_jax.study import stats
from bpo_jax.train import iteration_tasks


def summarise(rows: list[dict], tasks: int, f: float | None, seconds: float, rng) -> dict:
    """A rule's figures from its task rows (`task_concentration` plus `uniform`)."""

    def mean_ci(xs):
        if not xs:
            return None, [None, None]
        ci = stats.bootstrap_mean_ci(xs, rng) if len(xs) > 1 else (None, None)
        return float(np.mean(xs)), [None if c is None else float(c) for c in ci]

    backbone = [r["backbone_share"] for r in rows]
    uniform = [r["uniform"] for r in rows]
    out = {"tasks": tasks, "tasks_counted": len(rows)}
    out["branch_points_per_task"] = float(sum(r["n"] for r in rows)) / max(tasks, 1)
    out["backbone"], out["backbone_ci95"] = mean_ci(backbone)
    out["uniform"] = float(np.mean(uniform)) if rows else None
    out["excess"], out["excess_ci95"] = mean_ci([b - u for b, u in zip(backbone, uniform)])
    out["path"], out["path_ci95"] = mean_ci([r["path_share"] for r in rows])
    out["f"] = f
    out["seconds"] = seconds
    out["task_rows"] = rows
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_source_flags(ap)
    ap.add_argument("--rules", default=",".join(sorted(SELECTORS)))
    ap.add_argument("--batches", type=int, default=2, help="batches per rule")
    ap.add_argument("--tasks", type=int, default=3, help="tasks per batch")
    args = ap.parse_args(argv)
    platforms.quiet_start()  # Before anything touches a device: no TPU discovery on a CPU.
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = sorted(set(rules) - set(SELECTORS))
    if unknown:
        ap.error(f"unknown rules {unknown}; registered: {sorted(SELECTORS)}")
    fields = {"train.tasks_per_iter": args.tasks, "eval.initial": False}
    cfg = source_config(ap, args, **fields)
    out = {
        **source_record(args),
        "batches": args.batches,
        "tasks_per_batch": args.tasks,
        "root_group": cfg.rollout.root_group,
        "branch_budget": cfg.rollout.branch_budget,
        "max_depth": cfg.rollout.max_depth,
        "rules": {},
    }
    rng = np.random.default_rng(args.seed)
    with source_run(cfg) as run:
        for name in rules:
            rcfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, selector=name))
            rollout = RolloutState.create(rcfg)
            rows, tasks, t0 = [], 0, time.time()
            for b in range(args.batches):
                key = jax.random.fold_in(jax.random.key(args.seed), b)
                # The same tasks and keys for every rule (paired).
                forest, _ = play_batch(
                    run.pool, run.policy, iteration_tasks(run, b), rcfg, rollout, key
                )
                tasks += len(forest.task_ids)
                got = task_concentration(forest)
                for r in got:
                    r.update(batch=b, uniform=uniform_backbone_share(r["n"], r["k0"]))
                rows += got
                print(
                    f"{name:14} batch {b}: {forest.num_branch_points} branch points, "
                    f"{len(got)} tasks with 2+",
                    flush=True,
                )
            f = rollout.explained.summary()["f"]
            out["rules"][name] = summarise(rows, tasks, f, time.time() - t0, rng)
            if args.json:  # Written after every rule: a long run keeps what it measured.
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"\n{'rule':14} {'points/task':>11} {'counted':>8} {'backbone':>20} {'uniform':>8} "
        f"{'excess':>22} {'path':>20} {'f':>6} {'s':>5}"
    )

    def fmt(v, ci):
        if v is None:
            return "-"
        return f"{v:.3f} [{ci[0]:.2f},{ci[1]:.2f}]" if ci[0] is not None else f"{v:.3f}"

    for name, r in out["rules"].items():
        f = "-" if r["f"] is None else f"{r['f']:.2f}"
        uni = "-" if r["uniform"] is None else f"{r['uniform']:.3f}"
        print(
            f"{name:14} {r['branch_points_per_task']:11.2f} "
            f"{r['tasks_counted']:>3}/{r['tasks']:<4} {fmt(r['backbone'], r['backbone_ci95']):>20} "
            f"{uni:>8} {fmt(r['excess'], r['excess_ci95']):>22} "
            f"{fmt(r['path'], r['path_ci95']):>20} {f:>6} {r['seconds']:5.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
