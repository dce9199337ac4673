"""The variance map's figure and its page's table, from the record `bench_variance_map.py` wrote.

  python bench/variance_map_report.py [--record bench/results/variance_map.json]
      [--figure docs/variance_map.png] [--table]

Every number comes from the record. A point is "in CI" when the prediction lies in the measured
95% CI, "near" when within 10% of the CI's nearer end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SOURCES = {"grid": "2026-12-01 grid", "design": "equal-token designs", "auto": "tree=auto"}


def agreement(row: dict) -> str:
    lo, hi = row["ci95"]
    p = row["predicted"]
    if lo <= p <= hi:
        return "in CI"
    return "near" if lo / 1.1 <= p <= hi * 1.1 else "miss"


def verdict(row: dict) -> str:
    lo, hi = row["ci95"]
    return "**BPO lower**" if hi < 1 else ("BPO higher" if lo > 1 else "no difference")


def tree_text(tree) -> str:
    return "[" + ",".join(f"({d},{k})" for d, k in tree) + "]"


def table(rows: list[dict]) -> str:
    head = (
        "| # | set | MDP (H) | f at d1 | tree | N | tokens | BPO/RLOO (95% CI) | predicted "
        "| agreement |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for i, r in enumerate(rows):
        f = "-" if r["f"] is None else f"{r['f']:.2f}"
        mdp = r["mdp"].split("(")[0] if r["source"] != "grid" else r["mdp"]
        if r["source"] != "grid":
            mdp = r["name"].split(" N=")[0].removeprefix("auto: ")
        lo, hi = r["ci95"]
        lines.append(
            f"| {i} | {r['source']} | {mdp} ({r['horizon']}) | {f} | {tree_text(r['tree'])} | "
            f"{r['rloo_n']} | {r['tokens_ratio']:.3f} | {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) "
            f"{verdict(r)} | {r['predicted']:.2f} | {agreement(r)} |"
        )
    return head + "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(16, 0.27 * len(rows) + 2), gridspec_kw={"width_ratios": [3, 2]}
    )
    y = np.arange(len(rows))
    r = np.array([row["ratio"] for row in rows])
    lo = np.array([row["ci95"][0] for row in rows])
    hi = np.array([row["ci95"][1] for row in rows])
    pred = np.array([row["predicted"] for row in rows])
    colors = [
        "tab:green" if t < 1 else ("tab:red" if b > 1 else "tab:gray") for b, t in zip(lo, hi)
    ]
    markers = {"grid": "o", "design": "s", "auto": "D"}
    for yi, ri, low, top, c in zip(y, r, lo, hi, colors):
        ax.errorbar(ri, yi, xerr=[[ri - low], [top - ri]], fmt="none", ecolor=c, capsize=3)
    for src, m in markers.items():
        idx = [i for i, row in enumerate(rows) if row["source"] == src]
        if idx:
            ax.scatter(r[idx], y[idx], c=[colors[i] for i in idx], marker=m, zorder=3,
                       label=f"measured, {SOURCES[src]} (95% CI)")  # fmt: skip
    ax.scatter(pred, y, marker="x", c="k", zorder=4, label="first-order prediction")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log")
    labels = []
    for row in rows:
        name = row["name"] if row["source"] == "grid" else row["name"].split(" [")[0]
        labels.append(f"{name}  {tree_text(row['tree'])}")
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("BPO / RLOO trace of the gradient covariance (equal measured tokens)")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title("Where BPO wins (< 1) on the tabular MDPs")
    for src, m in markers.items():
        idx = [i for i, row in enumerate(rows) if row["source"] == src]
        for i in idx:
            bx.errorbar(pred[i], r[i], yerr=[[r[i] - lo[i]], [hi[i] - r[i]]], fmt="none",
                        ecolor=colors[i], capsize=2)  # fmt: skip
        if idx:
            bx.scatter(pred[idx], r[idx], c=[colors[i] for i in idx], marker=m, s=20, zorder=3,
                       label=SOURCES[src])  # fmt: skip
    span = [min(pred.min(), lo.min()) * 0.9, max(pred.max(), hi.max()) * 1.1]
    bx.plot(span, span, color="k", lw=0.8, ls=":", label="measured = predicted")
    bx.axhline(1.0, color="k", lw=0.8, ls="--")
    bx.axvline(1.0, color="k", lw=0.8, ls="--")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("first-order prediction (bpo_jax/rollout/design.py; grid: on grown forests)")
    bx.set_ylabel("measured ratio (95% CI)")
    bx.legend(loc="upper left", fontsize=8)
    bx.set_title("Measured against predicted")
    ticks = [0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0]
    for axis in (ax.xaxis, bx.xaxis, bx.yaxis):
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:g}" for t in ticks]))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", default="bench/results/variance_map.json")
    ap.add_argument("--figure", default="docs/variance_map.png")
    ap.add_argument("--table", action="store_true", help="print the page's markdown table")
    args = ap.parse_args()
    rows = json.loads(Path(args.record).read_text())["points"]
    order = list(SOURCES)
    rows = sorted(rows, key=lambda r: order.index(r["source"]))  # Stable: run order within.
    if args.figure:
        figure(rows, Path(args.figure))
    if args.table:
        print(table(rows))
    for src in (*SOURCES, None):
        part = [r for r in rows if src in (None, r["source"])]
        counts = {a: sum(agreement(r) == a for r in part) for a in ("in CI", "near", "miss")}
        print(f"{src or 'all'}: {len(part)} points; prediction {counts}")


if __name__ == "__main__":
    main()
