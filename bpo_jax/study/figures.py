"""The PNG figures of `bpo_jax.study.tables` (matplotlib, Agg backend: no display needed).

Each figure is drawn only when the records hold its data; otherwise the returned mapping gets
a `note:<figure>` entry saying why, which results.md prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from bpo_jax.study.records import RunRecord

GRAD_NORM_WINDOW = 8  # Updates per rolling window of the gradient-norm variance.


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _groups(runs: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in runs:
        out.setdefault(r.group, []).append(r)
    return out


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def success_curves(curves: Mapping[str, list[dict]], x_key: str, xlabel: str, path: Path) -> bool:
    """Mean success over seeds at each evaluation point against `x_key`, with the points' 95%
    CIs (`ci95`) as a band where every point has one; False if no data."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    drawn = banded = False
    for name, curve in curves.items():
        pts = [c for c in curve if c[x_key] is not None]
        if len(pts) < 2:
            continue
        xs = [c[x_key] for c in pts]
        (line,) = ax.plot(xs, [c["success"] for c in pts], marker="o", label=name)
        if all(c.get("ci95") for c in pts):
            lo, hi = zip(*(c["ci95"] for c in pts), strict=True)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
            banded = True
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel(xlabel)
    ax.set_ylabel("success (mean over seeds)")
    if banded:
        ax.set_title("bands: 95% CI, episodes resampled per seed", fontsize=8)
    ax.legend()
    _save(fig, path)
    return True


def rolling_variance(values: Sequence[float], window: int) -> np.ndarray:
    """The unbiased variance of each window of `window` consecutive values."""
    x = np.asarray(values, np.float64)
    if x.size < window:
        return np.zeros(0)
    w = np.lib.stride_tricks.sliding_window_view(x, window)
    return w.var(axis=1, ddof=1)


def grad_norm_variance(groups: Mapping[str, list[RunRecord]], path: Path) -> bool:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    drawn = False
    for name, g in groups.items():
        per_seed = [rolling_variance(r.series("update/grad_norm"), GRAD_NORM_WINDOW) for r in g]
        n = min((v.size for v in per_seed), default=0)
        if n == 0:
            continue
        ax.plot(np.arange(n) + GRAD_NORM_WINDOW, np.mean([v[:n] for v in per_seed], 0), label=name)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("RL update")
    ax.set_ylabel(f"Var(grad norm), last {GRAD_NORM_WINDOW} updates")
    ax.set_yscale("log")
    ax.legend()
    _save(fig, path)
    return True


def histograms(
    data: Mapping[str, list[float]],
    xlabel: str,
    path: Path,
    bins=20,
    mark: float | None = None,
    ylabel: str = "batches",
    integer: bool = False,
) -> bool:
    """One histogram per group, overlaid; `integer` gives each whole number its own bin."""
    data = {k: v for k, v in data.items() if v}
    if not data:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    lo = min(min(v) for v in data.values())
    hi = max(max(v) for v in data.values())
    if integer:
        edges = np.arange(np.floor(lo), np.floor(hi) + 2) - 0.5
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    for name, v in data.items():
        ax.hist(v, bins=edges, alpha=0.5, label=name)
    if mark is not None:
        ax.axvline(mark, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    _save(fig, path)
    return True


def spend_ratios(r: RunRecord) -> list[float]:
    """Per RL iteration: mean task cost over the per-task budget (iterations with a budget)."""
    out = []
    for m in r.metrics:
        budget = m.get("train/budget_per_task", 0.0)
        if "compute/task_cost_mean" in m and budget > 0:
            out.append(float(m["compute/task_cost_mean"]) / float(budget))
    return out


def write_figures(
    runs: Sequence[RunRecord], curves: Mapping[str, list[dict]], out: Path
) -> dict[str, str]:
    """Writes the PNGs into `out`; returns file name (or `note:<name>`) -> caption."""
    groups = _groups(runs)
    written: dict[str, str] = {}

    def add(ok: bool, name: str, caption: str, why: str) -> None:
        if ok:
            written[name] = caption
        else:
            written[f"note:{name}"] = f"{name} not drawn: {why}"

    add(
        success_curves(curves, "tokens", "generated tokens", out / "success_vs_tokens.png"),
        "success_vs_tokens.png",
        "Success against generated tokens",
        "needs two or more evaluations and compute/generated_tokens in the metrics",
    )
    add(
        success_curves(curves, "updates", "RL updates", out / "success_vs_updates.png"),
        "success_vs_updates.png",
        "Success against policy updates",
        "needs two or more evaluations with their update steps",
    )
    add(
        grad_norm_variance(groups, out / "grad_norm_variance.png"),
        "grad_norm_variance.png",
        "Gradient-norm variance over training",
        f"needs at least {GRAD_NORM_WINDOW} update/grad_norm values per run",
    )
    spend = {n: [x for r in g for x in spend_ratios(r)] for n, g in groups.items()}
    add(
        histograms(
            spend, "task cost / budget per task (per batch)", out / "spend_budget.png", mark=1.0
        ),
        "spend_budget.png",
        "Spend over budget per batch",
        "no iteration with a per-task budget (train/budget_per_task > 0)",
    )
    branch = {n: [x for r in g for x in r.series("train/branch_points")] for n, g in groups.items()}
    branch = {n: v for n, v in branch.items() if any(x > 0 for x in v)}
    add(
        histograms(branch, "branch points per batch", out / "branch_points.png"),
        "branch_points.png",
        "Branch points per batch",
        "no run recorded branch points (train/branch_points)",
    )
    steps = {n: [t for r in g for t in r.branch_steps()] for n, g in groups.items()}
    add(
        histograms(
            steps,
            "step of the branch point (environment steps from the root)",
            out / "branch_steps.png",
            ylabel="branch points",
            integer=True,
        ),
        "branch_steps.png",
        "Branch points by step",
        "no record holds the step of its branch points (train/branch_step/<t>, written since "
        "2026-12-02)",
    )
    return written
