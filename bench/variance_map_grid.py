"""The variance map's first grid (issue 13, item 3; 24 points, recorded 2026-12-01): trees on
the H = 3, 4, 6 tabular MDPs, branching by the `interval` rule, against RLOO(N).

Per point: RLOO plays M tasks as groups of N; its measured mean cost per task becomes the tree's
budget; BPO plays M tasks (K0 backbones, K children at steps d, 2d, ..., up to B branch points
per backbone and B nested, `target` budget mode); the trace ratio of the per-task gradient
covariances with a bootstrap CI; and the first-order model evaluated on the grown forests
(`variance_model.forest_trace`). `bench_variance_map.py` keeps these rows in its record
(`grid_row` adds the map's common fields) and can re-run them (`--grid`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import variance_model

from bpo_jax.estimators import step_advantages
from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector
from bpo_jax.rollout.engine import TreeSpec, play_forest
from bpo_jax.study import stats
from envs.sandbox import SandboxPool
from envs.tabular import make_mdp, mdp_tasks, random_logits, reward_density_mdp
from envs.tabular.policy import TabularPolicy, encode_state, forest_task_gradients


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration of the map (see the module docstring)."""

    name: str
    instance: str = "reward_density"
    horizon: int = 4
    density: float | None = 1.0  # None: the instance has no density knob.
    k0: int = 2
    k: int = 2
    n: int = 4
    d: int = 1
    b: int = 2
    num_actions: int = 2
    prefix_scale: float = 1.0  # Logits of the states above the first branch step, scaled.

    def mdp(self):
        if self.instance == "reward_density":
            return reward_density_mdp(0, self.horizon, self.num_actions, self.density)
        return make_mdp(self.instance, 0, self.horizon, self.num_actions)


BASE = Point("base: K0=2 K=2 N=4 d=1 B=2 (H=4 dense)")
GRID = [
    BASE,
    # The tree's shape against the group's size.
    dataclasses.replace(BASE, name="K=3", k=3),
    dataclasses.replace(BASE, name="K=4 B=1", k=4, b=1),
    dataclasses.replace(BASE, name="K0=3", k0=3),
    dataclasses.replace(BASE, name="K0=3 K=3 d=2 B=1", k0=3, k=3, d=2, b=1),
    dataclasses.replace(BASE, name="N=8 B=3", n=8, b=3),
    dataclasses.replace(BASE, name="N=8 K=4", k=4, n=8),
    dataclasses.replace(BASE, name="N=8 K0=4 K=4 B=1", k0=4, k=4, n=8, b=1),
    dataclasses.replace(BASE, name="N=8 K0=6 K=4 B=1", k0=6, k=4, n=8, b=1),
    # The branch budget and the first branch step.
    dataclasses.replace(BASE, name="B=1", b=1),
    dataclasses.replace(BASE, name="B=3", b=3),
    dataclasses.replace(BASE, name="d=2 K=3 B=1", d=2, k=3, b=1),
    dataclasses.replace(BASE, name="d=3 K=5 B=1", d=3, k=5, b=1),
    # Horizon.
    dataclasses.replace(BASE, name="H=3", horizon=3),
    dataclasses.replace(BASE, name="H=6 B=3", horizon=6, b=3),
    dataclasses.replace(BASE, name="H=6 d=2", horizon=6, d=2),
    # Reward density (0: paid only at the last step).
    dataclasses.replace(BASE, name="density=0.3", density=0.3),
    dataclasses.replace(BASE, name="density=0", density=0.0),
    dataclasses.replace(BASE, name="density=0 K=4 B=1", density=0.0, k=4, b=1),
    dataclasses.replace(BASE, name="density=0 K0=3 K=4 B=1", density=0.0, k0=3, k=4, b=1),
    dataclasses.replace(
        BASE, name="first_action_decides", instance="first_action_decides", density=None
    ),
    # A nearly deterministic prefix (its logits x4): low entropy above the branch points and
    # high entropy at them, the situation an entropy rule looks for.
    dataclasses.replace(BASE, name="sharp prefix", prefix_scale=4.0),
    dataclasses.replace(BASE, name="sharp prefix K=4 B=1", prefix_scale=4.0, k=4, b=1),
    dataclasses.replace(BASE, name="sharp prefix d=2 K=3 B=1", prefix_scale=4.0, d=2, k=3, b=1),
]


def play(
    mdp, policy, tasks, spec: TreeSpec, selector, seed: int, lengths: LengthModel | None = None
):
    """The forest `policy` plays on `mdp`'s `tasks` in process; `lengths` is the episode-length
    model the budget plans with (a fresh one, the worst case, by default)."""
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        return play_forest(
            pool,
            policy,
            encode_state,
            tasks,
            spec,
            rng=jax.random.key(seed),
            selector=selector,
            lengths=LengthModel(mdp.horizon) if lengths is None else lengths,
            costs=CostModel(spec.budget_unit),
        )


def task_gradients(forest, policy, method: str) -> np.ndarray:
    arrays = forest.arrays()
    adv = arrays.unpad_steps(np.asarray(step_advantages(arrays.forest, method)))
    return forest_task_gradients(forest, policy, forest.step_weights("trajectory") * adv)


def run_point(p: Point, num_tasks: int, seed: int, rng: np.random.Generator, cache: dict):
    mdp = p.mdp()
    logits = random_logits(mdp, seed=1, scale=0.7)
    logits[mdp.depth[: mdp.num_states] < p.d] *= p.prefix_scale
    policy = TabularPolicy(logits)
    tasks = mdp_tasks(mdp, copies=num_tasks)
    t0 = time.time()
    key = (mdp.name, p.n, p.d if p.prefix_scale != 1.0 else 0, p.prefix_scale)
    if key not in cache:  # RLOO depends on the MDP, the policy and N only: shared by points.
        forest = play(mdp, policy, tasks, TreeSpec(p.n, budget_unit="env_steps"), None, seed)
        grads = task_gradients(forest, policy, "rloo")
        cache[key] = (stats.gram(grads), forest.task_cost.copy(), forest)
    k_rloo, rloo_cost, rloo_forest = cache[key]
    budget = float(np.mean(rloo_cost))  # The reference's measured spend per task.
    spec = TreeSpec(
        root_group=p.k0,
        num_branches=p.k,
        branch_budget=p.b,
        max_depth=p.b,
        budget=budget,
        budget_unit="env_steps",
        budget_mode="target",
    )
    forest = play(mdp, policy, tasks, spec, make_selector("interval", interval=p.d), seed + 1)
    grads = task_gradients(forest, policy, "bpo")
    ratio, ci = stats.trace_ratio_ci(stats.gram(grads), k_rloo, rng)
    m = variance_model.moments(mdp, logits)
    model_bpo = variance_model.forest_trace(forest, m).mean()
    model_rloo = variance_model.forest_trace(rloo_forest, m).mean()
    spend = forest.task_cost / budget
    branched = {lf.segments[0] for lf in forest.leaves if len(lf.segments) > 1}
    return {
        **dataclasses.asdict(p),
        "mdp": mdp.name,
        "tasks": num_tasks,
        "budget": budget,
        "spend_ratio": float(np.mean(forest.task_cost) / budget),
        "spend_ratio_task_p05_p95": [float(x) for x in np.percentile(spend, [5, 95])],
        "branch_points_per_task": forest.num_branch_points / num_tasks,
        "backbones_branched": len(branched) / (p.k0 * num_tasks),
        "leaves_per_task": len(forest.leaves) / num_tasks,
        "trace_bpo": stats.trace_covariance_from_gram(stats.gram(grads)),
        "trace_rloo": stats.trace_covariance_from_gram(k_rloo),
        "ratio": ratio,
        "ratio_ci95": list(ci),
        "predicted_ratio": float(model_bpo / model_rloo),
        **variance_model.identity_prediction(m, p.d, p.k, p.n),
        "seconds": time.time() - t0,
    }


def grid_row(row: dict) -> dict:
    """A grid point's record with the map's common fields added (its own fields kept): the tree
    as the `interval` rule's steps (d, 2d, ... while below H and B; the branch budget B per
    backbone may stop the nesting short), and the forest-evaluated model as the prediction."""
    levels = [
        [row["d"] * j, row["k"]] for j in range(1, row["b"] + 1) if row["d"] * j < row["horizon"]
    ]
    return {
        "name": row["name"],
        "source": "grid",
        "mdp": row["mdp"],
        "horizon": row["horizon"],
        "tree": [[0, row["k0"]], *levels],
        "rloo_n": row["n"],
        "tokens_ratio": row["spend_ratio"],
        "ratio": row["ratio"],
        "ci95": row["ratio_ci95"],
        "predicted": row["predicted_ratio"],
        "f": row["f_explained"],
        "weighting": "trajectory",
        **{k: v for k, v in row.items() if k not in ("name", "mdp", "horizon")},
    }
