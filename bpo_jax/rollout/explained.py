"""f, the share of the return variance a branch point's history explains, measured every batch.

DESIGN.md ("When the variance claim holds"): whether a tree beats independent groups depends on
`f = Var(E[R | h]) / Var(R)` where it branches. A tree algorithm's run measures it on every
batch's own forest, with no model: `estimators.branch_stats` per branch point, summed per
(task, depth) by `estimators.task_depth_parts` (depth: agent steps from the root), the same
parts `rollout.tree=auto`'s chooser records (`design_stats.branch_parts`; a batch is measured
once and both use it). In a run of several shares every host holds the merged forest, so every
host measures the same numbers and nothing is exchanged.

From the parts:
- a batch's metrics (`batch_metrics`): f pooled over the batch's branch points per depth and
  over all, and the sums it is the ratio of, so that f re-pools exactly over iterations: sum
  the numerators and the denominators, never average the f's;
- the run's sums (`ExplainedShare`, saved with the rollout state in checkpoints), per depth and
  over all, for summary.json;
- `bpo_shrink`'s lam for batch i from the parts of batches < i only (`ExplainedShare.
  shrink_lambda`; `estimators.lambda_from_parts`): a lam that looked at the batch's own returns
  would break the estimator's unbiasedness (`estimators.baselines`). The first batch, and any
  batch before one with branch points and return variance, plays the option's default.
"""

from __future__ import annotations

import numpy as np

from bpo_jax.estimators import DEFAULT_SHRINK, PART_SUMS, lambda_from_parts
from bpo_jax.rollout.design_stats import branch_parts

F_KEY = "train/f"  # Pooled f of the batch; per depth `train/f/depth_<d>`.
PARTS_PREFIX = "train/f_parts/"  # The sums: `<prefix><name>`, `<prefix>depth_<d>/<name>`.
DEPTH_PARTS = ("branch_points", "between", "var_return")  # Summed per depth in the metrics.
SUMMED = ("branch_points", *PART_SUMS)
COLUMNS = ("task", "depth", *SUMMED)  # A batch's record (`io.metrics.BRANCH_PARTS_FILE`).


def complete(parts: dict) -> dict[str, np.ndarray]:
    """`task_depth_parts` columns as arrays, every column present (empty without branch points)."""
    n = len(parts.get("depth", ()))
    out = {}
    for name in COLUMNS:
        kind = np.int64 if name in ("task", "depth", "branch_points") else np.float64
        out[name] = np.asarray(parts[name], kind) if n else np.zeros(0, kind)
    return out


def measure_parts(forest) -> dict[str, np.ndarray]:
    """The batch's branch points summed per (task, step depth), every column present."""
    return complete(branch_parts(forest))


def ratio(between: float, var_return: float) -> float | None:
    """f of summed parts; None without return variance to scale by."""
    return float(between / var_return) if var_return > 0 else None


def by_depth(parts: dict) -> dict[int, dict[str, float]]:
    """Depth -> the sums of `SUMMED` over the tasks' rows at that depth."""
    out: dict[int, dict[str, float]] = {}
    for i, depth in enumerate(np.asarray(parts["depth"]).tolist()):
        row = out.setdefault(int(depth), dict.fromkeys(SUMMED, 0.0))
        for name in SUMMED:
            row[name] += float(parts[name][i])
    return dict(sorted(out.items()))


def batch_metrics(parts: dict) -> dict[str, float]:
    """One batch's metrics: `train/f` and `train/f/depth_<d>` (where there is return variance),
    `train/f_parts/<name>` for `SUMMED`, and `train/f_parts/depth_<d>/<name>` for
    `DEPTH_PARTS` (what f per depth re-pools from)."""
    parts = complete(parts)
    out: dict[str, float] = {f"{PARTS_PREFIX}{name}": float(np.sum(parts[name])) for name in SUMMED}
    out[f"{PARTS_PREFIX}branch_points"] = int(np.sum(parts["branch_points"]))
    f = ratio(out[f"{PARTS_PREFIX}between"], out[f"{PARTS_PREFIX}var_return"])
    if f is not None:
        out[F_KEY] = f
    for depth, row in by_depth(parts).items():
        for name in DEPTH_PARTS:
            value = row[name]
            out[f"{PARTS_PREFIX}depth_{depth}/{name}"] = (
                int(value) if name == "branch_points" else value
            )
        f = ratio(row["between"], row["var_return"])
        if f is not None:
            out[f"{F_KEY}/depth_{depth}"] = f
    return out


class ExplainedShare:
    """The parts of every batch of a run, summed (per depth and over all), and the last batch's.

    Attributes:
      batches: batches added.
      total: the sums of `SUMMED` over every branch point of those batches.
      depths: depth -> the same sums at that depth.
      last: the last batch's columns (`complete`); not saved with checkpoints.
    """

    def __init__(self):
        self.batches = 0
        self.total = dict.fromkeys(SUMMED, 0.0)
        self.depths: dict[int, dict[str, float]] = {}
        self.last: dict[str, np.ndarray] | None = None

    def add(self, parts: dict) -> None:
        """Adds a played batch's parts (after its advantages' lam was fixed)."""
        parts = complete(parts)
        self.last = parts
        self.batches += 1
        for name in SUMMED:
            self.total[name] += float(np.sum(parts[name]))
        for depth, row in by_depth(parts).items():
            into = self.depths.setdefault(depth, dict.fromkeys(SUMMED, 0.0))
            for name in SUMMED:
                into[name] += row[name]
        self.depths = dict(sorted(self.depths.items()))

    def shrink_lambda(self, default: float = DEFAULT_SHRINK) -> float:
        """lam for the next batch from the batches added so far; `default` before any of
        them had a branch point with return variance."""
        try:
            return lambda_from_parts(self.total)
        except ValueError:
            return float(default)

    def record(self) -> dict[str, list] | None:
        """The last batch's columns as JSON lists (a line of `BRANCH_PARTS_FILE`); None
        before any batch."""
        if self.last is None:
            return None
        return {name: self.last[name].tolist() for name in COLUMNS}

    def summary(self) -> dict:
        """For summary.json: f pooled over the run, per depth, and the sums it comes from."""
        return {
            "f": ratio(self.total["between"], self.total["var_return"]),
            "f_by_depth": {
                str(d): ratio(row["between"], row["var_return"]) for d, row in self.depths.items()
            },
            "f_parts": {
                "batches": self.batches,
                "all": dict(self.total),
                "by_depth": {str(d): dict(row) for d, row in self.depths.items()},
            },
        }

    def dump(self) -> dict:
        return {
            "batches": self.batches,
            "total": dict(self.total),
            "depths": {str(d): dict(row) for d, row in self.depths.items()},
        }

    def load(self, data: dict | None) -> ExplainedShare:
        """Adds what `dump` wrote (None, from a checkpoint older than this record: nothing)."""
        data = data or {}
        self.batches += int(data.get("batches", 0))
        for name, value in data.get("total", {}).items():
            self.total[name] = self.total.get(name, 0.0) + float(value)
        for depth, row in data.get("depths", {}).items():
            into = self.depths.setdefault(int(depth), dict.fromkeys(SUMMED, 0.0))
            for name, value in row.items():
                into[name] = into.get(name, 0.0) + float(value)
        self.depths = dict(sorted(self.depths.items()))
        return self
