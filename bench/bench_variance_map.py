"""Where BPO wins: the BPO/RLOO gradient-variance ratio mapped over the tree's shape and the MDP.

The real engine, in process: `bpo_jax.rollout.engine.play_forest` (sandbox pool with the `inprocess`
backend, the branch planner with its `target` budget rule, the forest builder), the estimator
kernels (`estimators.step_advantages`, "bpo" and "rloo") and `RolloutForest.step_weights`
("trajectory", the default) play tabular MDPs (`envs.tabular`, gym id bpo_jax/TabularTree-v0)
with a softmax-table policy (`envs.tabular.policy.TabularPolicy`), whose score is exact, so each
task's gradient estimate is `sum over its steps of weight * advantage * grad log pi`.

Per map point (MDP, horizon H, reward density; K0, K, N, first branch step d, branch budget B):
1. RLOO plays M tasks as groups of N; its measured mean cost per task (env steps; one token per
   action, so tokens are the same) becomes the tree's per-task budget;
2. BPO plays M tasks: K0 backbones, K children at steps d, 2d, ... (the `interval` rule), up to
   B branch points per backbone and B nested on a path, while the budget lasts (`target` mode:
   randomised acceptance of the branch that only partly fits);
3. the ratio of the traces of the two per-task gradient covariances, with a 95% percentile
   bootstrap CI (each estimator's tasks resampled on their own); the realised spend ratio
   (BPO's mean cost per task over RLOO's); and the predictions of `variance_model`.

A batch of b tasks has b times less covariance for both estimators alike, so the per-task ratio
is the per-batch ratio at any batch size; each task here is one batch of size 1.

  nice -n 10 python bench/bench_variance_map.py --tasks 1024 \
      --out bench/results/variance_map.json --figure docs/variance_map.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import variance_model  # noqa: E402

from bpo_jax.estimators import step_advantages  # noqa: E402
from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector  # noqa: E402
from bpo_jax.rollout.engine import TreeSpec, play_forest  # noqa: E402
from bpo_jax.study import stats  # noqa: E402
from envs.sandbox import SandboxPool  # noqa: E402
from envs.tabular import make_mdp, mdp_tasks, random_logits, reward_density_mdp  # noqa: E402
from envs.tabular.policy import TabularPolicy, encode_state, forest_task_gradients  # noqa: E402


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


def play(mdp, policy, tasks, spec: TreeSpec, selector, seed: int):
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        return play_forest(
            pool,
            policy,
            encode_state,
            tasks,
            spec,
            rng=jax.random.key(seed),
            selector=selector,
            lengths=LengthModel(mdp.horizon),
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


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    y = np.arange(len(rows))
    r = np.array([row["ratio"] for row in rows])
    lo = np.array([row["ratio_ci95"][0] for row in rows])
    hi = np.array([row["ratio_ci95"][1] for row in rows])
    pred = np.array([row["predicted_ratio"] for row in rows])
    colors = [
        "tab:green" if top < 1 else ("tab:red" if low > 1 else "tab:gray")
        for low, top in zip(lo, hi)
    ]
    for yi, ri, low, top, c in zip(y, r, lo, hi, colors):
        ax.errorbar(ri, yi, xerr=[[ri - low], [top - ri]], fmt="none", ecolor=c, capsize=3)
    ax.scatter(r, y, c=colors, zorder=3, label="measured (95% bootstrap CI)")
    ax.scatter(pred, y, marker="x", c="k", zorder=4, label="first-order prediction")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yticks(y, [f"{row['name']}  (spend {row['spend_ratio']:.2f})" for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("BPO / RLOO trace of the gradient covariance (equal measured spend)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Where BPO wins (< 1) on the tabular MDPs")
    for pi, ri, low, top, c in zip(pred, r, lo, hi, colors):
        bx.errorbar(pi, ri, yerr=[[ri - low], [top - ri]], fmt="none", ecolor=c, capsize=2)
    bx.scatter(pred, r, c=colors, s=18, zorder=3)
    span = [min(pred.min(), lo.min()) * 0.9, max(pred.max(), hi.max()) * 1.1]
    bx.plot(span, span, color="k", lw=0.8, ls=":", label="measured = predicted")
    bx.axhline(1.0, color="k", lw=0.8, ls="--")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("first-order prediction (variance_model.py)")
    bx.set_ylabel("measured ratio (95% CI)")
    bx.legend(loc="upper left", fontsize=8)
    bx.set_title("Measured against predicted")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1024, help="tasks (= batches) per estimator")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="';'-separated point names (default: all)")
    ap.add_argument("--out", default="bench/results/variance_map.json")
    ap.add_argument("--figure", default="docs/variance_map.png")
    ap.add_argument(
        "--merge", nargs="*", default=[], help="write --out and --figure from these JSON files"
    )
    args = ap.parse_args()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        order = {p.name: i for i, p in enumerate(GRID)}
        rows = sorted((r for m in parts for r in m["points"]), key=lambda r: order[r["name"]])
        meta = {k: v for k, v in parts[0].items() if k != "points"}
        meta["tasks_per_estimator"] = sorted({r["tasks"] for r in rows})
        Path(args.out).write_text(json.dumps({**meta, "points": rows}, indent=1))
        figure(rows, Path(args.figure))
        return
    points = GRID
    if args.only:
        names = set(args.only.split(";"))
        points = [p for p in GRID if p.name in names]
    rng = np.random.default_rng(args.seed)
    cache, rows = {}, []
    print(f"{'point':38} {'spend':>6} {'ratio':>7} {'95% CI':>15} {'pred':>6} {'f':>5} {'f*':>5}")
    for i, p in enumerate(points):
        row = run_point(p, args.tasks, 1000 * args.seed + 10 * i, rng, cache)
        rows.append(row)
        print(
            f"{p.name:38} {row['spend_ratio']:6.3f} {row['ratio']:7.3f} "
            f"[{row['ratio_ci95'][0]:5.3f}, {row['ratio_ci95'][1]:5.3f}] "
            f"{row['predicted_ratio']:6.3f} {row['f_explained']:5.2f} {row['f_threshold']:5.2f}"
            f"  ({row['seconds']:.0f} s)",
            flush=True,
        )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "engine": "bpo_jax.rollout.engine.play_forest, SandboxPool(backend='inprocess'), "
            "TabularPolicy; estimators.step_advantages; step_weights('trajectory')",
            "tasks_per_estimator": args.tasks,
            "budget_unit": "env_steps",
            "bootstrap": "percentile, 2000 resamples, each estimator's tasks on their own",
            "points": rows,
        }
        out.write_text(json.dumps(meta, indent=1))
    if args.figure:
        figure(rows, Path(args.figure))


if __name__ == "__main__":
    main()
