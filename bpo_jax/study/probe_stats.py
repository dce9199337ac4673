"""The probe's statistics: from each algorithm's recorded batch gradients, the trace of their
covariance (`E||g - E g||^2`) and its ratio to the reference's with bootstrap CIs, per batch and
per task, the spend check, and the report (probe.json, the run's `probe/*` metrics, the table).

`bpo_jax.study.probe` says what is measured and why; `bpo_jax.study.probe_sample` plays the
batches.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bpo_jax.io import files
from bpo_jax.study import stats

SPEND_TOLERANCE = (0.95, 1.05)


class StreamedTrace:
    """`E||g - mean g||^2` (unbiased over M) of gradients seen one at a time, kept as a running
    sum (one parameter-sized buffer) and each gradient's squared norm. `add(None)` counts an
    exactly zero gradient (a batch that won nothing): it is one of the M draws."""

    def __init__(self, total=None, sq=()):
        self.total, self.sq = total, list(sq)

    def add(self, tree) -> None:
        if tree is None:
            self.sq.append(0.0)
            return
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
        self.total = leaves if self.total is None else [a + b for a, b in zip(self.total, leaves)]
        self.sq.append(float(optax.tree.norm(leaves)) ** 2)

    def value(self) -> float:
        m = len(self.sq)
        total = 0.0 if self.total is None else float(optax.tree.norm(self.total)) ** 2
        return float((np.mean(self.sq) - total / m**2) * m / max(m - 1, 1))


@dataclasses.dataclass
class Recorded:
    """One algorithm's recorded batches, as its statistics read them (one entry per batch)."""

    rows: list[np.ndarray]  # float[tasks, D]: each task's gradient (flattened or sketched).
    costs: list[np.ndarray]  # float[tasks]: each task's cost (`rollout.budget_unit`).
    leaves: list[int]  # Leaves of the batch's forest.
    tokens: list[int]  # Tokens the batch generated.
    trace: StreamedTrace | None  # The exact batch-level trace; None where gradients are sketches.
    # Tree algorithms: each batch's f parts per (task, depth) (`rollout.explained`; None for a
    # batch stored before they were), and `bpo_shrink`'s lam per batch (from earlier batches).
    parts: list[dict | None] = dataclasses.field(default_factory=list)
    shrinks: list[float] = dataclasses.field(default_factory=list)
    # Other estimators' gradients on the same batches (`BatchSampler.record`'s `variants`).
    variants: dict[str, Recorded] = dataclasses.field(default_factory=dict)


def _trace_summary(k: np.ndarray, norms: np.ndarray) -> dict:
    m = k.shape[0]
    trace = stats.trace_covariance_from_gram(k)
    mean_sq = float(k.sum()) / m**2
    signal = max(mean_sq - trace / m, 0.0)  # ||E g||^2 without the trace / M of the mean.
    return {
        "batches": m,
        "trace_var": trace,
        "signal_sq": signal,
        # Comparable across estimators that scale advantages differently (GRPO).
        "noise_to_signal": trace / signal if signal > 0 else float("inf"),
        "norm_var": float(np.var(norms, ddof=1)),
        "norm_mean": float(norms.mean()),
        "mean_grad_norm": float(np.sqrt(mean_sq)),
    }


def algorithm_statistics(
    algo: str,
    reference: str,
    recorded: Recorded,
    ref_cost: float | None,
    budget: float | None,
) -> tuple[dict, np.ndarray, list[np.ndarray]]:
    """One algorithm's statistics, before the ratios to the reference (`add_ratios`).

    Args:
      algo, reference: the algorithm's name and the reference's (for the spend warning).
      recorded: its M recorded batches.
      ref_cost: the reference's measured mean cost per task; None for the reference itself.
      budget: the explicit budget a tree algorithm played at (None: the reference, or no tree).

    Returns:
      The statistics, the Gram matrix of the M batch gradients, and one per task.
    """
    g_mtd = np.stack(recorded.rows)  # [M, tasks, D]
    costs = np.stack(recorded.costs)  # [M, tasks]
    batch = g_mtd.mean(axis=1)
    gram = stats.gram(batch)
    per_task_grams = [stats.gram(g_mtd[:, t]) for t in range(g_mtd.shape[1])]
    r = _trace_summary(gram, np.linalg.norm(batch, axis=1))
    r["per_task_trace_var"] = [stats.trace_covariance_from_gram(k) for k in per_task_grams]
    if recorded.trace is not None:
        r["exact_trace_var"] = recorded.trace.value()
    r["leaves"], r["generated_tokens"] = recorded.leaves, recorded.tokens
    r["task_cost_mean"] = float(costs.mean())
    r["task_cost_per_task"] = costs.mean(axis=0).tolist()
    if ref_cost is None:
        ref_cost = float(costs.mean())
    r["budget"] = budget
    if recorded.shrinks:
        r["shrink_lambda_mean"] = float(np.mean(recorded.shrinks))
    parts = [p for p in recorded.parts if p is not None]
    if parts:  # f per depth and Table 2a over the recorded batches (units: a batch's task).
        from bpo_jax.study.fshare import f_tables, jsonable

        r["explained"] = jsonable(f_tables([_listed(p) for p in parts], "tasks"))
    r["spend_ratio"] = float(costs.mean() / ref_cost)
    r["spend_ratio_per_task"] = (costs.mean(axis=0) / ref_cost).tolist()
    lo, hi = SPEND_TOLERANCE
    r["spend_matched"] = bool(lo <= r["spend_ratio"] <= hi)
    r["spend_warning"] = None
    if not r["spend_matched"]:
        r["spend_warning"] = (
            f"{algo} spent {r['spend_ratio']:.3f} of {reference}'s measured cost per task "
            f"(outside [{lo}, {hi}]): its variance ratio is not at matched spend."
        )
    return r, gram, per_task_grams


def _listed(parts: dict) -> dict:
    return {k: np.asarray(v).tolist() for k, v in parts.items()}


def add_ratios(results, grams, per_task_grams, algos, boot, num_resamples: int) -> None:
    """Adds each algorithm's ratios to the reference (`algos[0]`) to its `results` entry: the
    trace's with its bootstrap CI (each algorithm's batches resampled on their own), per task
    likewise, the norm variance's and the noise-to-signal's."""
    base = algos[0]
    for algo in algos:
        r, b = results[algo], results[base]
        ratio, ci = stats.trace_ratio_ci(grams[algo], grams[base], boot, num_resamples)
        r["trace_var_ratio"], r["trace_var_ratio_ci95"] = ratio, list(ci)
        r["per_task"] = []
        for k_a, k_b in zip(per_task_grams[algo], per_task_grams[base]):
            if stats.trace_covariance_from_gram(k_b) <= 0:
                r["per_task"].append({"trace_var_ratio": None, "ci95": None})
                continue
            t_ratio, t_ci = stats.trace_ratio_ci(k_a, k_b, boot, num_resamples)
            r["per_task"].append({"trace_var_ratio": t_ratio, "ci95": list(t_ci)})
        r["norm_var_ratio"] = r["norm_var"] / max(b["norm_var"], 1e-30)
        r["noise_to_signal_ratio"] = r["noise_to_signal"] / max(b["noise_to_signal"], 1e-30)


def write_report(workdir, step, task_ids, results: dict, algos, design: dict | None = None):
    """Writes `probe.json` and the `probe/*` ratios (into the run's metrics) in `workdir`, and
    prints the table and the spend warnings. `design`: a fixed design's record (its tree and
    predicted ratio, `probe.design_record`), kept in probe.json when given."""
    from bpo_jax.io.metrics import MetricWriter

    warnings = [r["spend_warning"] for r in results.values() if r["spend_warning"]]
    out = {
        "update_step": step,
        "tasks": list(task_ids),
        "results": results,
        "warnings": warnings,
    }
    if design is not None:
        out["design"] = design
    files.write_text(workdir / "probe.json", json.dumps(out, indent=2))
    writer = MetricWriter(workdir)
    for algo in algos[1:]:
        lo, hi = results[algo]["trace_var_ratio_ci95"]
        writer.write(
            step,
            {
                f"probe/{algo}_over_{algos[0]}_trace_var": results[algo]["trace_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_trace_var_lo": lo,
                f"probe/{algo}_over_{algos[0]}_trace_var_hi": hi,
                f"probe/{algo}_spend_ratio": results[algo]["spend_ratio"],
                f"probe/{algo}_over_{algos[0]}_norm_var": results[algo]["norm_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_noise_to_signal": results[algo][
                    "noise_to_signal_ratio"
                ],
            },
        )
    writer.close()
    print(
        f"{'algo':8} {'E|g-mean g|^2':>14} {'ratio':>7} {'95% CI':>15} {'Var|g|':>10} "
        f"{'ratio':>7} {'spend':>6} {'cost/task':>10}"
    )
    for algo in algos:
        r = results[algo]
        lo, hi = r["trace_var_ratio_ci95"]
        print(
            f"{algo:8} {r['trace_var']:14.4g} {r['trace_var_ratio']:7.3f} [{lo:5.3f}, {hi:5.3f}] "
            f"{r['norm_var']:10.4g} {r['norm_var_ratio']:7.3f} {r['spend_ratio']:6.3f} "
            f"{r['task_cost_mean']:10.1f}"
        )
    for w in warnings:
        print("WARNING:", w)
