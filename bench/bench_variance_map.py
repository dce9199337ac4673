"""Where BPO wins at equal tokens: the BPO/RLOO gradient-variance map, with the design model's
predictions and where `rollout.tree=auto` lands.

The real engine, in process: `bpo_jax.rollout.engine.play_forest` (sandbox pool with the
`inprocess` backend, the branch planner in `target` budget mode, the forest builder), the
estimator kernels (`estimators.step_advantages`, "bpo" and "rloo") and
`RolloutForest.step_weights` play tabular MDPs (`envs.tabular`) with a softmax-table policy
(`envs.tabular.policy.TabularPolicy`, logits N(0, 0.7^2), seed 1), whose score is exact, so each
task's gradient estimate is `sum over its steps of weight * advantage * grad log pi`.

Per design point (`DESIGNS`: an MDP, RLOO's N, a tree `[[0, K0], [d_1, K], ...]`):
1. RLOO plays M tasks as groups of N; its measured mean cost per task (env steps, one token an
   action) becomes the tree's per-task budget;
2. BPO plays M tasks: K0 backbones, every path branching into K at the design's steps
   (`design.StepsSelector`) while the budget lasts (the planner spends it in step order, a
   partly fitting branch by its coin, its length model knowing the MDP's lengths as a run's
   does after its first batches: `known_lengths`): equal tokens in expectation
   (`tokens_ratio`) where the tree can spend the budget;
3. the ratio of the traces of the two per-task gradient covariances, a 95% percentile bootstrap
   CI (each estimator's tasks resampled on their own), and `predicted`: the design model
   (`bpo_jax.rollout.design.predicted_ratio`) on the MDP's exact profile
   (`envs.tabular.profile`); on fixed-length MDPs also `predicted_forest`, the same model
   evaluated on the grown forests (`variance_model.forest_trace`).
`auto` points play what `rollout.tree=auto` would: a warm-up batch of the prior tree (K0 = N/2,
K = 2, uniform branch steps), its measurements (`design_stats.TreeChooser`), the design chosen
from them, then steps 1-3 for that design. Fixed-length points weight steps by `trajectory`
(the default; the same as `path_mass` divided by H); variable-length points by `path_mass` (both
estimators then estimate dJ).

The record (`--out`) holds the 2026-12-01 grid's rows (`variance_map_grid.py`) and one row per
design point with `{"name", "mdp", "horizon", "tree", "rloo_n", "tokens_ratio", "ratio", "ci95",
"predicted", "f", ...}`; a run appends each finished point and skips the points already there,
so an interrupted run resumes where it stopped:

  nohup nice -n 10 python bench/bench_variance_map.py --tasks 512 \
      > bench/results/variance_map.log 2>&1 &
  python bench/variance_map_report.py   # the figure and the page's table from the record
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import variance_model  # noqa: E402
from design_mdps import split_mdp  # noqa: E402
from variance_map_grid import play as grid_play  # noqa: E402

from bpo_jax.estimators import step_advantages  # noqa: E402
from bpo_jax.rollout.branching import LengthModel, make_selector  # noqa: E402
from bpo_jax.rollout.design import Design, Profile, predicted_ratio  # noqa: E402
from bpo_jax.rollout.design_stats import TreeChooser  # noqa: E402
from bpo_jax.rollout.engine import TreeSpec  # noqa: E402
from bpo_jax.study import stats  # noqa: E402
from envs.tabular import (  # noqa: E402
    first_action_decides_mdp,
    mdp_tasks,
    random_logits,
    reward_density_mdp,  # noqa: E402
)
from envs.tabular.mdp import variable_length_mdp  # noqa: E402
from envs.tabular.policy import TabularPolicy, forest_task_gradients  # noqa: E402
from envs.tabular.profile import step_profile  # noqa: E402

# The MDPs of the design points (f at each step: `envs.tabular.profile.step_profile`).
MDPS = {
    "sparse_end": lambda: reward_density_mdp(0, 8, 2, 0.0),  # f(1) = 0.02, f(4) = 0.09.
    "dense": lambda: reward_density_mdp(0, 8, 2, 1.0),  # f(2) = 0.22.
    "decided_at_1": lambda: first_action_decides_mdp(0, 8, 2),  # f = 1 from step 1.
    # ALFWorld-like: a 0/1 success at the end, f = 0.77 (the sweep's pooled guess) at 1 or 4.
    "alf_d1": lambda: split_mdp(8, 1, 0.77, binary=True),
    "alf_d4": lambda: split_mdp(8, 4, 0.77, binary=True),
    "split_d2_f50": lambda: split_mdp(8, 2, 0.5),
    "split_d4_f50": lambda: split_mdp(8, 4, 0.5),
    "split_d2_f93": lambda: split_mdp(8, 2, 0.93),
    "varlen_h8": lambda: variable_length_mdp(1, 8, 2, 0.1),  # 82% of episodes reach 8 steps.
    "varlen_h6": lambda: variable_length_mdp(2, 6, 2, 0.15),  # Half end by step 3.
}


@dataclasses.dataclass(frozen=True)
class DesignPoint:
    """One point of the map: `tree` [(step, children), ...] (root first) against RLOO(n);
    `auto`: the tree is `rollout.tree=auto`'s choice instead (module docstring)."""

    name: str
    mdp: str
    n: int = 8
    tree: tuple = ()
    auto: bool = False

    def design(self) -> Design:
        (_, k0), *levels = self.tree
        return Design(k0, levels[0][1] if levels else 2, tuple(d for d, _ in levels))


def _p(mdp: str, *tree, n: int = 8) -> DesignPoint:
    levels = "".join(f",({d},{k})" for d, k in tree[1:])
    return DesignPoint(f"{mdp} N={n} [(0,{tree[0][1]}){levels}]", mdp, n, tuple(tree))


DESIGNS = [
    # K0 = N - 1 or N / 2 at exactly equal tokens, branching near the start and in the middle.
    _p("decided_at_1", (0, 7), (1, 2)),
    _p("decided_at_1", (0, 4), (1, 3)),
    _p("decided_at_1", (0, 4), (4, 3)),
    _p("alf_d1", (0, 7), (1, 2)),
    _p("alf_d1", (0, 4), (1, 4)),
    _p("alf_d4", (0, 7), (4, 2)),
    _p("alf_d4", (0, 4), (4, 3)),
    _p("alf_d4", (0, 4), (4, 2), (6, 2)),
    _p("split_d2_f93", (0, 7), (2, 3)),
    _p("split_d2_f50", (0, 4), (2, 4)),
    _p("split_d4_f50", (0, 7), (4, 4)),
    _p("sparse_end", (0, 7), (1, 2)),
    _p("sparse_end", (0, 4), (1, 2), (4, 2)),
    _p("sparse_end", (0, 4), (4, 3)),
    _p("sparse_end", (0, 4), (6, 4), (7, 4)),  # Late branching, where the model says it wins.
    _p("dense", (0, 7), (2, 2)),
    _p("decided_at_1", (0, 4), (2, 2), n=7),  # DESIGN.md's example (4 x 8 + 4 x 6 = 7 x 8).
    _p("split_d2_f93", (0, 4), (2, 2), n=7),
    _p("varlen_h8", (0, 7), (3, 2)),
    _p("varlen_h6", (0, 4), (2, 3)),
    _p("alf_d1", (0, 8)),  # Control: no branching, K0 = N (the ratio must be 1).
    *(
        DesignPoint(f"auto: {m} N=8", m, 8, auto=True)
        for m in ("sparse_end", "dense", "alf_d1", "alf_d4", "split_d2_f50", "varlen_h6")
    ),
    *(
        DesignPoint(f"auto: {m} N={n}", m, n, auto=True)
        for m, n in (
            ("decided_at_1", 8),
            ("split_d2_f93", 8),
            ("split_d4_f50", 8),
            ("varlen_h8", 8),
            ("alf_d1", 4),  # N = 4: the CPU tables' group size.
            ("alf_d4", 4),
            ("dense", 4),
        )
    ),
]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % (2**31)


def known_lengths(mdp, logits, size: int = 2048) -> LengthModel:
    """A length model that has seen `size` episodes in the exact proportions of their lengths,
    as a run's has after its first batches (a fresh one plans with the worst case, H - t steps
    still to go, and under-spends where episodes end early). The shortest come first (oldest):
    the batch's own episodes, short ones finishing first, displace those, which `remaining(t)`
    at the steps they passed no longer reads."""
    survival = step_profile(mdp, logits)["survival"]
    model = LengthModel(mdp.horizon, window=size)
    for length, p in enumerate(survival[:-1] - survival[1:], start=1):
        model.lengths.extend([length] * int(round(p * size)))
    return model


def play(mdp, policy, tasks, spec: TreeSpec, selector, seed: int):
    """`variance_map_grid.play` with the length model of `known_lengths`."""
    return grid_play(mdp, policy, tasks, spec, selector, seed, known_lengths(mdp, policy.logits))


def task_gradients(forest, policy, method: str, weighting: str) -> np.ndarray:
    arrays = forest.arrays()
    adv = arrays.unpad_steps(np.asarray(step_advantages(arrays.forest, method)))
    return forest_task_gradients(forest, policy, forest.step_weights(weighting) * adv)


def rloo_reference(mdp, policy, n, tasks, weighting, cache_dir: Path | None):
    """RLOO(n)'s Gram matrix of per-task gradients, per-task costs and (fixed length) the
    forest-evaluated model's mean trace; cached on disk by MDP, n, tasks and weighting."""
    key = f"{seed_of(mdp.name, n, tasks, weighting):x}"
    path = cache_dir / f"rloo_{key}.npz" if cache_dir else None
    if path is not None and path.exists():
        z = np.load(path)
        return z["gram"], z["cost"], float(z["model"])
    forest = play(mdp, policy, mdp_tasks(mdp, copies=tasks), TreeSpec(n, budget_unit="env_steps"),
                  None, seed_of("rloo", mdp.name, n))  # fmt: skip
    gram = stats.gram(task_gradients(forest, policy, "rloo", weighting))
    model = np.nan
    if not mdp.variable_length:
        logits = policy.logits
        model = variance_model.forest_trace(forest, variance_model.moments(mdp, logits)).mean()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, gram=gram, cost=forest.task_cost, model=model)
    return gram, forest.task_cost.copy(), float(model)


def auto_design(p: DesignPoint, mdp, policy, budget: float, warmup: int):
    """What `rollout.tree=auto` plays after one warm-up batch of its prior: (Choice, record)."""
    prior = TreeSpec(
        root_group=p.n // 2,
        num_branches=2,
        branch_budget=3,
        max_depth=2,
        budget=budget,
        budget_unit="env_steps",
    )
    selector = make_selector("uniform", branch_prob=0.25, seed=seed_of("prior", p.name))
    forest = play(mdp, policy, mdp_tasks(mdp, copies=warmup), prior, selector, seed_of(p.name, 0))
    chooser = TreeChooser(p.n, mdp.horizon, "env_steps", explore_every=0)
    chooser.record(forest)
    choice = chooser.next_design(p.n)
    profile = chooser.stats.profile()
    return choice, {
        "warmup_tasks": warmup,
        "prior": "K0=N/2 K=2, uniform steps (p=0.25), 3 branch points per backbone, 2 nested",
        "measured_f": None if profile is None else [round(float(x), 4) for x in profile.explained],
        "predicted_measured": None if choice is None else float(choice.ratio),
        "best_tree_measured": None if choice is None else float(choice.best_tree_ratio),
    }


def run_design_point(p: DesignPoint, num_tasks: int, warmup: int, rng, cache_dir) -> dict:
    t0 = time.time()
    mdp = MDPS[p.mdp]()
    logits = random_logits(mdp, seed=1, scale=0.7)
    policy = TabularPolicy(logits)
    profile = Profile(**step_profile(mdp, logits))
    weighting = "path_mass" if mdp.variable_length else "trajectory"
    k_rloo, rloo_cost, rloo_model = rloo_reference(
        mdp, policy, p.n, num_tasks, weighting, cache_dir
    )
    budget = float(np.mean(rloo_cost))  # The reference's measured spend per task.
    auto = None
    if p.auto:
        choice, auto = auto_design(p, mdp, policy, budget, warmup)
        design = choice.design if choice is not None else Design(p.n // 2, 2, ())
    else:
        design = p.design()
    spec = TreeSpec(**design.spec_fields(), budget=budget, budget_unit="env_steps")
    forest = play(mdp, policy, mdp_tasks(mdp, copies=num_tasks), spec, design.selector(),
                  seed_of("bpo", p.name))  # fmt: skip
    grads = task_gradients(forest, policy, "bpo", weighting)
    ratio, ci = stats.trace_ratio_ci(stats.gram(grads), k_rloo, rng)
    spend = forest.task_cost / budget
    predicted_forest = None
    if not mdp.variable_length:
        model = variance_model.forest_trace(forest, variance_model.moments(mdp, logits)).mean()
        predicted_forest = float(model / rloo_model)
    return {
        "name": p.name,
        "source": "auto" if p.auto else "design",
        "mdp": mdp.name,
        "horizon": mdp.horizon,
        "tree": design.tree,
        "rloo_n": p.n,
        "tokens_ratio": float(np.mean(forest.task_cost) / budget),
        "ratio": ratio,
        "ci95": list(ci),
        "predicted": float(predicted_ratio(design, profile, p.n)),
        "f": float(profile.explained[design.depths[0]]) if design.branches else None,
        "weighting": weighting,
        "tasks": num_tasks,
        "budget": budget,
        "tokens_ratio_task_p05_p95": [float(x) for x in np.percentile(spend, [5, 95])],
        "branch_points_per_task": forest.num_branch_points / num_tasks,
        "predicted_forest": predicted_forest,
        "f_profile": [round(float(x), 4) for x in profile.explained],
        "trace_bpo": stats.trace_covariance_from_gram(stats.gram(grads)),
        "trace_rloo": stats.trace_covariance_from_gram(k_rloo),
        "auto": auto,
        "seconds": time.time() - t0,
    }


META = {
    "engine": "bpo_jax.rollout.engine.play_forest, SandboxPool(backend='inprocess'), "
    "TabularPolicy; estimators.step_advantages; step_weights('trajectory') on fixed lengths, "
    "'path_mass' on variable lengths",
    "budget_unit": "env_steps",
    "bootstrap": "percentile, 2000 resamples, each estimator's tasks on their own",
}


def load_record(path: Path) -> dict:
    """The record, its grid rows brought to the map's common fields (`grid_row`)."""
    from variance_map_grid import grid_row

    if not path.exists():
        return {**META, "points": []}
    record = json.loads(path.read_text())
    record["points"] = [r if "tree" in r else grid_row(r) for r in record["points"]]
    return {**record, **META}


def save_record(path: Path, record: dict) -> None:
    record["tasks_per_estimator"] = sorted({r["tasks"] for r in record["points"]})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=512, help="tasks (= batches) per estimator")
    ap.add_argument("--warmup", type=int, default=128, help="auto points: warm-up batch tasks")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    ap.add_argument("--only", default="", help="';'-separated point names (default: all)")
    ap.add_argument("--out", default="bench/results/variance_map.json")
    ap.add_argument("--cache", default="bench/results/variance_map_cache")
    ap.add_argument("--grid", action="store_true", help="also the 2026-12-01 grid's points")
    args = ap.parse_args()
    out = Path(args.out)
    record = load_record(out)
    save_record(out, record)
    done = {r["name"] for r in record["points"]}
    todo = [p for p in DESIGNS if p.name not in done]
    if args.only:
        todo = [p for p in todo if p.name in set(args.only.split(";"))]
    rng = np.random.default_rng(args.seed)
    print(f"{len(done)} points recorded, {len(todo)} to run", flush=True)
    for p in todo:
        row = run_design_point(p, args.tasks, args.warmup, rng, Path(args.cache))
        record["points"].append(row)
        save_record(out, record)
        print(
            f"{p.name:44} {str(row['tree']):28} tokens {row['tokens_ratio']:5.3f} ratio "
            f"{row['ratio']:6.3f} [{row['ci95'][0]:5.3f}, {row['ci95'][1]:5.3f}] predicted "
            f"{row['predicted']:6.3f} f {row['f'] if row['f'] is None else round(row['f'], 2)}"
            f"  ({row['seconds']:.0f} s)",
            flush=True,
        )
    if args.grid:
        from variance_map_grid import GRID, grid_row, run_point

        cache = {}
        for i, p in enumerate(GRID):
            if p.name not in done:
                row = grid_row(run_point(p, args.tasks, 10 * i, rng, cache))
                record["points"].append(row)
                save_record(out, record)


if __name__ == "__main__":
    main()
