r"""A pilot of a tree's shape: f, survival and score energy measured at a start, then the design.

A powered probe (Table 2) needs its design chosen from measurements made before it, never from
its own batches (DESIGN.md, "When the variance claim holds"). The pilot plays, at a trained
run's fixed parameters, batches of `bpo` in one-level designs that cover the episode: K0 = N
backbones per task (`train.group_size`), every path branching into K = 2 at one step d, each d
of `--depths` in turn, with no budget (every branch point is taken). It plays training tasks the
probe does not (`--first_task` on, in the training order; the probe plays the first
`train.tasks_per_iter`). From its batches:
  - the profile (`rollout.design_stats.DesignStats`: f(t), s(t), c(t), cost(t));
  - f per branch depth with CIs over tasks, and Table 2a (`study.fshare`: the pilot's folder
    holds `branch_parts.jsonl`, so `python -m bpo_jax.study.fshare --run=PILOT` prints them);
  - the design `rollout.design.choose_design` picks at a budget of N episodes, its predicted
    BPO/RLOO trace ratio and expected spend, and the best candidates of each shape;
  - the recorded probe batches per algorithm for the ratio's 95% CI to exclude 1 with 80%
    power if the prediction holds, from the spread of log ratios an earlier probe measured
    (`--reference_probe`: its CI at its batches; the spread shrinks as 1/sqrt(batches)).
It writes `pilot.json`; each batch is kept as it finishes (`pilot_batches.jsonl`), and a re-run
resumes after the batches there.

  python -m bpo_jax.study.pilot --config=experiments/alfworld.py:cpu,algo=bpo \
      --config.init_from=runs/alfworld_cpu/bc/shared --workdir=runs/alfworld_cpu/pilot/shared \
      --depths=1,2,4,6,8,12,16 --tasks=16
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax
import numpy as np

from bpo_jax import cli
from bpo_jax.config import ExperimentConfig, validate
from bpo_jax.io import files
from bpo_jax.io.metrics import BRANCH_PARTS_FILE
from bpo_jax.parallel import platforms
from bpo_jax.rl import RolloutState, tree_spec
from bpo_jax.rollout.design import (
    DEFAULT_KS,
    Design,
    Profile,
    candidate_depths,
    candidates,
    choose_design,
    expected_cost,
    predicted_trace,
)
from bpo_jax.rollout.design_stats import DesignStats
from bpo_jax.rollout.engine import play_forest
from bpo_jax.rollout.explained import measure_parts

PROG = "python -m bpo_jax.study.pilot"
BATCHES_FILE = "pilot_batches.jsonl"
Z95, Z80 = 1.959964, 0.841621  # Two-sided 95% CI; 80% power.


def pilot_designs(n: int, depths) -> list[Design]:
    """One design per depth: K0 = n backbones, each path branching into 2 at that step."""
    return [Design(n, 2, (int(d),)) for d in depths]


def unbudgeted(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with no budget to stop a branch point (`cap` at an unreachable spend)."""
    rollout = dataclasses.replace(cfg.rollout, budget=1e12, budget_mode="cap")
    return dataclasses.replace(cfg, rollout=rollout)


def batches_needed(ratio: float, sd: float, at: int, power_z: float = Z80) -> int | None:
    """Batches per algorithm for a 95% CI of the trace ratio to exclude 1 with the power of
    `power_z` when the true ratio is `ratio`, if the log ratio's SD is `sd` at `at` batches."""
    if not 0 < ratio < 1 or not sd > 0:
        return None
    return int(math.ceil(at * ((Z95 + power_z) * sd / -math.log(ratio)) ** 2))


def reference_spread(probe_json) -> tuple[float, int] | None:
    """(SD of the log trace ratio, batches) of an earlier probe's tree algorithm, from its
    95% CI; None without one."""
    data = json.loads(files.as_path(probe_json).read_text())
    for algo, r in data["results"].items():
        lo, hi = r.get("trace_var_ratio_ci95") or (None, None)
        if algo != next(iter(data["results"])) and lo and hi and lo > 0:
            return (math.log(hi) - math.log(lo)) / (2 * Z95), int(r["batches"])
    return None


def ranked(profile: Profile, n: int, budget: float, ks=DEFAULT_KS, top: int = 10) -> list[dict]:
    """The `top` candidate designs by predicted trace ratio, and the best of each (K0, K,
    levels) shape, with their expected spend over the budget."""
    rloo = predicted_trace(Design(n), profile)
    rows = []
    for d in candidates(n, candidate_depths(profile), ks, 2):
        rows.append(
            {
                "tree": d.tree,
                "predicted_ratio": predicted_trace(d, profile, budget) / rloo,
                "spend": expected_cost(d, profile, budget) / budget,
                "shape": [d.root_group, d.num_branches, len(d.depths)],
            }
        )
    rows.sort(key=lambda r: r["predicted_ratio"])
    best_of_shape = {}
    for r in rows:
        best_of_shape.setdefault(tuple(r["shape"]), r)
    keep = rows[:top] + [r for r in best_of_shape.values() if r not in rows[:top]]
    return keep


def summarize(stats: DesignStats, n: int, reference: tuple[float, int] | None) -> dict:
    """The profile, the chosen design and the probe's size (module docstring)."""
    profile = stats.profile()
    if profile is None:
        return {"profile": None, "choice": None, "why": "no branch point with return variance"}
    budget = n * profile.remaining(0)
    choice = choose_design(profile, n, budget)
    out = {
        "profile": {
            "explained": profile.explained.tolist(),
            "survival": profile.survival.tolist(),
            "energy": profile.energy.tolist(),
            "cost": profile.cost.tolist(),
        },
        "budget": budget,
        "choice": {
            "tree": choice.design.tree,
            "predicted_ratio": choice.ratio,
            "spend": choice.spend,
            "best_tree_ratio": choice.best_tree_ratio,
            "spec_fields": choice.design.spec_fields(),
        },
        "candidates": ranked(profile, n, budget),
    }
    if reference is not None and choice.design.branches:
        sd, at = reference
        out["probe_batches"] = {
            "reference_log_sd": sd,
            "reference_batches": at,
            "needed_80pct_power": batches_needed(choice.ratio, sd, at),
            "needed_50pct_power": batches_needed(choice.ratio, sd, at, power_z=0.0),
        }
    return out


def _append(path, row: dict) -> None:
    with open(path, "a") as f:  # A local folder (the pilot's batches are its own).
        f.write(json.dumps(row) + "\n")


def run_pilot(pool, policy, encode, tasks, cfg: ExperimentConfig, designs, rng, workdir, log=print):
    """Plays one batch of every design (resuming after the batches in `workdir`); returns the
    `DesignStats` of all of them."""
    workdir = files.as_path(workdir)
    path = workdir / BATCHES_FILE
    done = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    stats = DesignStats(cfg.env.max_steps, cfg.rollout.budget_unit, window=len(designs))
    for row in done:
        stats.batches.append(row["sums"])
    state = RolloutState.create(cfg)
    free = unbudgeted(cfg)
    for i in range(len(done), len(designs)):
        design, start = designs[i], time.perf_counter()
        forest = play_forest(
            pool,
            policy,
            encode,
            tasks,
            tree_spec(free, state, design),
            rng=jax.random.fold_in(rng, i),
            selector=design.selector(),
            lengths=state.lengths,
            costs=state.costs,
            cohorts=cfg.rollout.overlap_cohorts,
        )
        parts = measure_parts(forest)
        stats.add(forest, parts)
        listed = {k: np.asarray(v).tolist() for k, v in parts.items()}
        row = {"iteration": i + 1, "tree": design.tree, "sums": stats.batches[-1], "parts": listed}
        _append(workdir / BRANCH_PARTS_FILE, {"iteration": i + 1, **listed})
        _append(path, row)  # Last: the batch counts as done once this line is written.
        log(
            f"pilot batch {i + 1}/{len(designs)} tree {design.tree}: "
            f"{time.perf_counter() - start:.0f} s, {len(forest.leaves)} leaves, "
            f"{int(np.sum(parts['branch_points']))} branch points"
        )
    return stats


def main(argv):
    from absl import flags
    from absl import logging as absl_logging

    from bpo_jax import builders
    from bpo_jax.builders import make_agent
    from bpo_jax.models import sharding
    from bpo_jax.study.probe import load_start, policy_source

    f = flags.FLAGS
    with cli.start_up_errors(PROG):
        cfg = validate(f.config)
        if not cfg.algorithm.branches:
            raise ValueError(f"--config: the pilot plays a tree algorithm, not {cfg.train.algo}.")
        depths = [int(x) for x in f.depths]
        designs = pilot_designs(cfg.train.group_size, depths)
        source = policy_source(cfg, f.workdir)
        if not (source / "checkpoints").is_dir():
            raise ValueError(f"--workdir={f.workdir}: no checkpoints/ in {source} (or init_from).")
    platforms.quiet_start()
    absl_logging.set_verbosity(absl_logging.WARNING)
    workdir = files.as_path(f.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    identity = {"config": f.config.to_dict(), "depths": depths, "first_task": f.first_task}
    identity = json.loads(json.dumps(identity, default=str))
    id_path = workdir / "pilot_identity.json"
    if id_path.exists() and json.loads(id_path.read_text()) != identity:
        raise SystemExit(f"{PROG}: error: {workdir} holds another pilot; use another --workdir.")
    files.write_text(id_path, json.dumps(identity, indent=2, sort_keys=True))
    train_tasks, _ = builders.select_tasks(cfg)
    tasks = train_tasks[f.first_task : f.first_task + f.tasks]
    mesh = sharding.make_mesh(cfg.mesh.axes, dcn_data=cfg.mesh.dcn_data)
    with builders.make_pool(cfg) as pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        start = load_start(cfg, source, mesh)
        encode = make_agent(cfg, start.tokenizer)
        key = jax.random.key(cfg.seed + 11)
        stats = run_pilot(pool, start.policy, encode, tasks, cfg, designs, key, workdir)
    reference = reference_spread(f.reference_probe) if f.reference_probe else None
    out = {
        "update_step": start.step,
        "tasks": [t.task_id for t in tasks],
        "depths": depths,
        **summarize(stats, cfg.train.group_size, reference),
    }
    files.write_text(workdir / "pilot.json", json.dumps(out, indent=2))
    from bpo_jax.study import fshare

    text, tables = fshare.report(workdir, seed=cfg.seed)
    files.write_text(workdir / "explained.json", json.dumps(tables, indent=2))
    print(text)
    print(json.dumps({k: out.get(k) for k in ("choice", "probe_batches")}, indent=2))


if __name__ == "__main__":
    from absl import flags

    from bpo_jax.experiment import define_config_flag, unknown_field

    define_config_flag()
    flags.DEFINE_string("workdir", None, "The pilot's folder (its batches, pilot.json).")
    flags.DEFINE_list(
        "depths", ["1", "2", "4", "6", "8", "12", "16"], "Branch steps, a batch each."
    )
    flags.DEFINE_integer("first_task", 4, "First training task played (the probe plays 0..3).")
    flags.DEFINE_integer("tasks", 16, "Training tasks per batch.")
    flags.DEFINE_string("reference_probe", None, "An earlier probe.json: the spread of its ratio.")
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, PROG, explain=unknown_field)
