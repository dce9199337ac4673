"""Table 2a: the paper's per-decision variance claim, measured on the recorded trees.

The claim: at a branch point with history h, the advantage of an action from m siblings has
`E[A^2] = (1 + 1/m)(1 - f) sigma^2`, against `(1 + 1/m) sigma^2` from m independent episodes,
so the reduction is `(1 + 1/m) Var(E[R | h])`. Both baselines are applied to the same trees
(`bpo_jax.estimators.decomposition`): per branch point the sibling leave-one-out baseline and
a baseline of m episodes of the task's other backbones, and beside the measured reduction
- "predicted": the paper's `(1 + 1/m) Bhat`, Bhat the measured between part (f's numerator);
- "identity": `Bhat + (sigma^2 - W) / m`, what the reduction is whatever chose the branch points
  and however the children branch again; the two agree when the branch points are on-policy
  histories of one step and the children run to the end unbranched.

Input: per forest (one iteration of a run) the columns of `estimators.task_depth_parts`, which
a run can record; `forest_parts` computes them from a forest. The bootstrap resamples tasks
(one forest's task is one unit; its branch points share backbones, so they are not independent
of each other), and every statistic is a ratio of sums over the resampled tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.stats

from bpo_jax.estimators import Forest, branch_stats, task_depth_parts

CI_METHODS = ("bootstrap", "normal")

# Table column -> (numerator, denominator) of its ratio of sums over tasks; a numerator may be
# a difference of two parts.
RATIOS = {
    "sibling_sq": ("sibling_sq", "branch_points"),
    "trajectory_sq": ("trajectory_sq", "branch_points"),
    "reduction": (("trajectory_sq", "sibling_sq"), "branch_points"),
    "predicted": ("predicted", "branch_points"),
    "identity": ("predicted_identity", "branch_points"),
    "f": ("between", "var_return"),
    "sibling_over_trajectory": ("sibling_sq", "trajectory_sq"),
}
WITH_CI = ("reduction", "predicted", "identity", "f", "sibling_over_trajectory")
_POINT = {"between": "branch_points", "within": "branch_points", "var_return": "branch_points"}


def forest_parts(forest, *, by: str = "step") -> dict[str, np.ndarray]:
    """`task_depth_parts(branch_stats(...))` of one forest.

    Args:
      forest: a `rollout.RolloutForest` (or anything with `.arrays()`), its `ForestArrays`, an
        `estimators.Forest` (step counts from its step_segment), or a (Forest, seg_len) pair.
      by: "step" or "level" (see `task_depth_parts`).
    """
    if hasattr(forest, "arrays"):
        forest = forest.arrays()
    if isinstance(forest, tuple):
        forest, seg_len = forest
    elif isinstance(forest, Forest):
        seg_len = None
    else:
        forest, seg_len = forest.forest, forest.seg_len
    return task_depth_parts(branch_stats(forest, seg_len), by=by)


def _numerator(col, name) -> np.ndarray:
    if isinstance(name, tuple):
        return col[name[0]] - col[name[1]]
    return col[name]


def _ratio_of_sums(num, den, axis=-1):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sum(num, axis=axis) / np.sum(den, axis=axis)


def ratio_ci(
    num, den, *, method: str, level: float, num_resamples: int, rng: np.random.Generator
) -> tuple[float, tuple[float, float]]:
    """`sum num / sum den` over units (tasks) and its CI, the units resampled as pairs.

    method "bootstrap": percentile bootstrap (units drawn with replacement, paired). A resample
    whose denominator sums to 0 has no ratio (e.g. f where only a few tasks had any return
    variance) and is left out: the interval is conditional on the ratio being defined, and NaN
    when under half the resamples define it. "normal": the delta method's standard error,
    `estimate +- z * se` (for many units). Fewer than two units: a NaN interval.
    """
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    value = float(_ratio_of_sums(num, den))
    nan = (float("nan"), float("nan"))
    if num.size < 2 or not np.isfinite(value):
        return value, nan
    if method == "normal":
        influence = (num - value * den) / den.mean()
        se = influence.std(ddof=1) / np.sqrt(num.size)
        z = scipy.stats.norm.ppf(0.5 + level / 2)
        return value, (value - z * se, value + z * se)
    per_batch = max(1, 4_000_000 // num.size)  # Resamples drawn at once: 32 MB of indices.
    ratios = []
    for start in range(0, num_resamples, per_batch):
        idx = rng.integers(0, num.size, (min(per_batch, num_resamples - start), num.size))
        ratios.append(_ratio_of_sums(num[idx], den[idx]))
    ratios = np.concatenate(ratios)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size < num_resamples / 2:
        return value, nan
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return value, (float(lo), float(hi))


def _concat(parts_list: Sequence[dict]) -> dict[str, np.ndarray]:
    """One column set; "unit" numbers the (forest, task) pairs."""
    if not parts_list:
        raise ValueError("no forests' parts to build Table 2a from")
    out = {k: np.concatenate([np.asarray(p[k]) for p in parts_list]) for k in parts_list[0]}
    pairs = np.concatenate(
        [np.stack([np.full(len(p["task"]), i), p["task"]], 1) for i, p in enumerate(parts_list)]
    )
    out["unit"] = np.unique(pairs, axis=0, return_inverse=True)[1].ravel()
    return out


def _row(col: dict, depth, *, ci: str, level: float, num_resamples: int, rng) -> dict:
    # Sum each task's rows (one per depth already; several for the "all" row).
    units, inverse = np.unique(col["unit"], return_inverse=True)
    per_unit = {
        k: np.bincount(inverse, np.asarray(v, np.float64), minlength=len(units))
        for k, v in col.items()
        if k not in ("unit", "task", "depth")
    }
    n = per_unit["branch_points"].sum()
    row = {"depth": depth, "branch_points": int(n), "tasks": int(len(units))}
    row["m"] = float(per_unit["m"].sum() / n)
    for name, den in _POINT.items():
        row[name] = float(per_unit[name].sum() / per_unit[den].sum())
    for name, (num, den) in RATIOS.items():
        num_u, den_u = _numerator(per_unit, num), per_unit[den]
        if name in WITH_CI:
            row[name], row[f"{name}_ci"] = ratio_ci(
                num_u, den_u, method=ci, level=level, num_resamples=num_resamples, rng=rng
            )
        else:
            row[name] = float(_ratio_of_sums(num_u, den_u))
    return row


def table2a(
    parts_list: Sequence[dict],
    *,
    ci: str = "bootstrap",
    level: float = 0.95,
    num_resamples: int = 2000,
    rng: np.random.Generator | None = None,
) -> list[dict]:
    """The rows of Table 2a, one per branch-point depth and one over all ("all").

    Args:
      parts_list: per forest (e.g. per iteration of a run), `task_depth_parts` columns (the
        recorded dicts, lists or arrays); tasks of different forests are different units.
      ci: "bootstrap" (percentile, tasks resampled) or "normal" (delta method).
      level: the CIs' coverage.
      num_resamples: bootstrap resamples.
      rng: the resamples' generator (default: seed 0, so a table is reproducible).

    Returns:
      Per depth: depth, branch_points, tasks, m (mean baseline size), between, within,
      var_return (per branch point), sibling_sq and trajectory_sq (E[A^2] per branch point with
      each baseline), reduction, predicted, identity, f and sibling_over_trajectory, each of
      the last five with a `<name>_ci` (lo, hi).
    """
    if ci not in CI_METHODS:
        raise ValueError(f"ci must be one of {CI_METHODS}, got {ci!r}")
    rng = np.random.default_rng(0) if rng is None else rng
    col = _concat(parts_list)
    options = dict(ci=ci, level=level, num_resamples=num_resamples, rng=rng)
    rows = []
    for depth in np.unique(col["depth"]):
        keep = col["depth"] == depth
        rows.append(_row({k: v[keep] for k, v in col.items()}, int(depth), **options))
    if rows:
        rows.append(_row(col, "all", **options))
    return rows


def table2a_from_forests(forests, *, by: str = "step", **options) -> list[dict]:
    """`table2a` of forests (each as `forest_parts` takes it); options as `table2a`'s."""
    return table2a([forest_parts(f, by=by) for f in forests], **options)


def _ci_text(row: dict, name: str, digits: int) -> str:
    lo, hi = row[f"{name}_ci"]
    return f"{row[name]:.{digits}f} ({lo:.{digits}f}, {hi:.{digits}f})"


def markdown(rows: Sequence[dict], digits: int = 3) -> str:
    """Table 2a as a Markdown table (CIs in parentheses)."""
    head = (
        "| depth | branch points | tasks | m | E[A²] sibling | E[A²] trajectory | reduction |"
        " predicted (1+1/m)·Var(E[R|h]) | identity B+(σ²−W)/m | f |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['depth']} | {r['branch_points']} | {r['tasks']} | {r['m']:.2f} |"
        f" {r['sibling_sq']:.{digits}f} | {r['trajectory_sq']:.{digits}f} |"
        f" {_ci_text(r, 'reduction', digits)} | {_ci_text(r, 'predicted', digits)} |"
        f" {_ci_text(r, 'identity', digits)} | {_ci_text(r, 'f', digits)} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"
