r"""Branch rules at matched spend: where do they put branch points, and do those carry signal?

From one saved policy (a behaviour-cloned run's checkpoint, via `init_from`), every rule plays
the same batches of the same tasks as BPO trees under the same auto budget (`group_size` times
the measured cost of an independent episode), each from a fresh rollout state with one warm-up
batch that is not counted. Per rule it reports:

  spend       spend / budget per task: mean over batches and its per-task spread (the budget
              must be spent, 0.95-1.05 on average);
  divergent   the fraction of branch points whose children's values (subtree mean returns)
              differ: a branch point where every child ends alike teaches nothing;
  children_var  the mean variance of the children's values at a branch point, an estimate of
              Var(E[R | h, a]) the node's baseline takes out (what branching there captured);
  branch step  where branch points fall (mean, and the share at t = 0);
  success     the trees' rollout success (path-mass weighted), as a sanity check.
Means over branch points pooled over batches, with 95% bootstrap CIs over batches.

  python bench/bench_branch_rules.py --source=runs/bc_seed0 --batches=6 \
      --json=bench/results/branch_rules.json

`--source` is a run directory with `config.json` and `checkpoints/` (any algorithm; only its
policy is read). The experiment defaults to `experiments/alfworld.py:cpu`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from bpo_jax.rl import RolloutState, branch_point_spreads, play_batch, rollout_metrics
from bpo_jax.study import stats
from bpo_jax.train import iteration_tasks, open_run, setup

# name -> rollout overrides. Every rule branches under the same budget mode and auto budget.
RULES = {
    "entropy": {"selector": "entropy"},  # The default: first-token entropy, pooled quantile.
    "entropy_spread": {
        "selector": "entropy",
        "entropy_per_step": True,
        "branch_schedule": "spread",
    },
    "action_samples": {"selector": "action_samples"},  # Probes spend half the slack.
    # Probes wherever the slack pays for them (before rollout.probe_share existed).
    "action_samples_every_step": {"selector": "action_samples", "probe_share": 1.0},
    "action_samples_2": {"selector": "action_samples", "probe_samples": 2},
    "uniform": {"selector": "uniform"},
    "action_samples_spread": {"selector": "action_samples", "branch_schedule": "spread"},
    "uniform_spread": {"selector": "uniform", "branch_schedule": "spread"},
    "interval": {"selector": "interval"},
}


def branch_steps(forest) -> list[int]:
    """The step t of every branch point (steps taken from the task's reset to the node)."""
    roots = len(forest.task_ids)
    node_step = {n: 0 for n in range(roots)}
    for seg in forest.segments:  # Parents come before their children.
        if seg.child >= 0:
            node_step[seg.child] = node_step[seg.parent] + len(seg.steps)
    return sorted(
        node_step[n] for n in {seg.parent for seg in forest.segments if seg.parent >= roots}
    )


def with_rollout(cfg, **overrides):
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **overrides))


def summarise(batches: list[dict], rng) -> dict:
    spreads = [b["spreads"] for b in batches]
    pooled = np.concatenate(spreads) if spreads else np.zeros((0,))
    ratios = np.concatenate([b["spend"] for b in batches])
    steps = np.concatenate([b["steps"] for b in batches]).astype(np.float64)

    def ci(per_batch):
        per_batch = [x for x in per_batch if np.isfinite(x)]
        return list(stats.bootstrap_mean_ci(per_batch, rng)) if per_batch else [None, None]

    div = [np.mean(s > 1e-12) if s.size else np.nan for s in spreads]
    var = [s.mean() if s.size else np.nan for s in spreads]
    return {
        "batches": len(batches),
        "spend_mean": float(ratios.mean()),
        "spend_per_batch": [float(b["spend"].mean()) for b in batches],
        "spend_ci95": ci([b["spend"].mean() for b in batches]),
        "spend_task_min": float(ratios.min()),
        "spend_task_max": float(ratios.max()),
        "spend_task_std": float(ratios.std()),
        "branch_points": int(pooled.size),
        "divergent": float(np.mean(pooled > 1e-12)) if pooled.size else None,
        "divergent_ci95": ci(div),
        "children_var": float(pooled.mean()) if pooled.size else None,
        "children_var_ci95": ci(var),
        "branch_step_mean": float(steps.mean()) if steps.size else None,
        "branch_step_share_t0": float(np.mean(steps == 0)) if steps.size else None,
        "branch_step_hist": np.bincount(steps.astype(int)).tolist() if steps.size else [],
        "success": float(np.mean([b["success"] for b in batches])),
        "probe_tokens": int(sum(b["probe_tokens"] for b in batches)),
        "seconds": float(sum(b["seconds"] for b in batches)),
    }


def add_source_flags(ap: argparse.ArgumentParser) -> None:
    """--source, --config, --seed, --json and --set (a bench that plays a saved policy)."""
    ap.add_argument("--source", required=True, help="run directory whose policy is measured")
    ap.add_argument("--config", default="experiments/alfworld.py:cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="config override, e.g. rollout.root_group=3 (repeatable)",
    )


def source_config(ap: argparse.ArgumentParser, args, **fields):
    """The validated BPO config of `--config` playing `--source`'s policy, with `fields`
    ({"section.name": value}) and then the `--set` overrides; a mistake is `ap.error`."""
    source = Path(args.source).absolute()
    if not (source / "checkpoints").is_dir():
        ap.error(f"--source={source} has no checkpoints/ folder")
    path, _, variant = args.config.partition(":")
    raw = load_experiment(path).get_config(",".join(filter(None, [variant, "algo=bpo"])))
    raw.init_from = str(source)
    raw.seed = args.seed
    for key, value in fields.items():
        section, name = key.split(".")
        raw[section][name] = value
    for item in args.set:
        field, eq, value = item.partition("=")
        section, _, name = field.partition(".")
        if not eq or not name or section not in raw or name not in raw[section]:
            ap.error(f"--set {item!r}: expected SECTION.FIELD=VALUE naming a config field")
        old = raw[section][name]
        raw[section][name] = value.lower() == "true" if isinstance(old, bool) else type(old)(value)
    return validate(raw)


def source_record(args) -> dict:
    """The head of a bench's JSON record: the `--source` run, `--config`, `--set` and `--seed`."""
    return {
        "source": str(Path(args.source).absolute()),
        "config": args.config,
        "overrides": args.set,
        "seed": args.seed,
    }


@contextlib.contextmanager
def source_run(cfg):
    """A throwaway run of `cfg` (a temporary workdir) whose policy is the source's."""
    with tempfile.TemporaryDirectory() as tmp, open_run(cfg, Path(tmp)) as (run, mcfg, params):
        state = setup(run, mcfg, params)
        run.policy.params = state.train.params
        yield run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_source_flags(ap)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--batches", type=int, default=6, help="counted batches per rule")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted batches per rule first")
    args = ap.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        ap.error(f"unknown rules {unknown}; known: {sorted(RULES)}")
    cfg = source_config(ap, args)
    out = {**source_record(args), "rules": {}}
    rng = np.random.default_rng(args.seed)
    with source_run(cfg) as run:
        for name in rules:
            rcfg = with_rollout(cfg, **RULES[name])
            rollout = RolloutState.create(rcfg)
            batches = []
            for b in range(args.warmup + args.batches):
                tasks = iteration_tasks(run, b)  # The same tasks for every rule (paired).
                key = jax.random.fold_in(jax.random.key(args.seed), b)
                t0 = time.time()
                forest, spec = play_batch(run.pool, run.policy, tasks, rcfg, rollout, key)
                if b < args.warmup:
                    continue
                adv = np.zeros((sum(len(s.steps) for s in forest.segments),))
                batches.append(
                    {
                        "spend": np.asarray(forest.spend_ratio, np.float64),
                        "spreads": branch_point_spreads(forest),
                        "steps": np.array(branch_steps(forest)),
                        "success": rollout_metrics(forest, adv)["train/success"],
                        "probe_tokens": forest.stats.probe_tokens,
                        "seconds": time.time() - t0,
                    }
                )
                print(
                    f"{name:22} batch {b}: spend {batches[-1]['spend'].mean():.3f} "
                    f"branch points {batches[-1]['spreads'].size} "
                    f"divergent {np.mean(batches[-1]['spreads'] > 1e-12):.2f}",
                    flush=True,
                )
            out["rules"][name] = summarise(batches, rng)
            if args.json:  # Written after every rule: a long run keeps what it measured.
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(out, indent=2))
    print(
        f"\n{'rule':22} {'spend':>6} {'task range':>12} {'points':>6} {'divergent':>18} "
        f"{'children var':>20} {'step':>5} {'t=0':>5} {'success':>7}"
    )
    for name, r in out["rules"].items():

        def fmt(v, c):
            if v is None:
                return "-"
            return f"{v:.3f} [{c[0]:.2f},{c[1]:.2f}]" if c[0] is not None else f"{v:.3f}"

        print(
            f"{name:22} {r['spend_mean']:6.3f} "
            f"{r['spend_task_min']:5.2f}-{r['spend_task_max']:<5.2f} "
            f"{r['branch_points']:6d} {fmt(r['divergent'], r['divergent_ci95']):>18} "
            f"{fmt(r['children_var'], r['children_var_ci95']):>20} "
            f"{r['branch_step_mean'] or 0:5.1f} {r['branch_step_share_t0'] or 0:5.2f} "
            f"{r['success']:7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
