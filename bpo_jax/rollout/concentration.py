"""How concentrated a batch's branch points are: the failure mode of entropy-triggered branching.

An entropy rule can collapse (AEPO's "high-entropy rollout collapse"): the paths that reach
high-entropy states branch, their children are in the same states and branch again, and the
branch points keep landing on one path while the task's other backbones get none. Measured per
task with at least two branch points (one branch point is trivially concentrated):
- backbone share: the largest share of the task's branch points in one backbone's subtree;
- path share: the largest share on one root-to-leaf path (branch points nested on one line);
each averaged over those tasks. Independent uniform placement, each of the n branch points on
one of the K0 backbones drawn uniformly, gives a backbone share of E[max count] / n
(`uniform_backbone_share`, exact): between 1/K0 and 1. A per-backbone branch budget caps the
backbone share at budget / n whatever the rule. The path share has no such closed form (where
a child may branch depends on the tree grown so far); the `uniform` rule played on the same
tasks is its reference (`bench/branch_concentration.py`).
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import scipy.stats

PREFIX = "train/branch_concentration/"


def task_concentration(forest) -> list[dict]:
    """Per task of a `RolloutForest` with at least two branch points: its task index, n (branch
    points), k0 (backbones), backbone_share and path_share (module docstring)."""
    roots = len(forest.task_ids)
    node_backbone: dict[int, int] = {}
    longest = collections.Counter()  # task -> most branch points on one root-to-leaf path
    for leaf in forest.leaves:
        nodes = [c for s in leaf.segments if (c := forest.segments[s].child) >= roots]
        for node in nodes:
            node_backbone[node] = leaf.segments[0]
        longest[leaf.task] = max(longest[leaf.task], len(nodes))
    k0 = collections.Counter(seg.task for seg in forest.segments if seg.parent < roots)
    per_backbone = collections.Counter(node_backbone.values())
    points = collections.Counter(forest.node_task[node] for node in node_backbone)
    backbone_max = collections.Counter()
    for backbone, count in per_backbone.items():
        task = forest.segments[backbone].task
        backbone_max[task] = max(backbone_max[task], count)
    return [
        {
            "task": task,
            "n": n,
            "k0": k0[task],
            "backbone_share": backbone_max[task] / n,
            "path_share": longest[task] / n,
        }
        for task, n in sorted(points.items())
        if n >= 2
    ]


@functools.lru_cache(maxsize=4096)
def uniform_backbone_share(n: int, k: int) -> float:
    """E[max count] / n when n branch points each fall on one of k backbones uniformly.

    Exact: P(max <= m) as the chance that k binomial draws in turn (backbone i takes
    Bin(rest, 1 / (k - i)) of the points left) all stay at or below m, and
    E[max] = sum over m < n of P(max > m).
    """
    if n < 1 or k < 1:
        raise ValueError(f"needs n >= 1 branch points and k >= 1 backbones, got n={n}, k={k}")
    left = np.arange(n + 1)
    # pmf[i][take, r]: backbone i takes `take` of the r points left.
    pmf = [scipy.stats.binom.pmf(left[:, None], left[None, :], 1.0 / (k - i)) for i in range(k)]
    expected = 0.0
    for m in range(n):
        rest = np.zeros(n + 1)  # rest[r]: P(r points left and every count so far <= m)
        rest[n] = 1.0
        for i in range(k):
            new = np.zeros(n + 1)
            for take in range(m + 1):
                new[: n + 1 - take] += (rest * pmf[i][take])[take:]
            rest = new
        expected += 1.0 - rest[0]
    return expected / n


def concentration_metrics(forest) -> dict[str, float]:
    """The batch's means over its tasks with two or more branch points (none: no metric):
    `<PREFIX>tasks`, `backbone`, `path` and `backbone_uniform` (the same tasks' shares under
    independent uniform placement on their backbones)."""
    rows = task_concentration(forest)
    if not rows:
        return {}
    return {
        f"{PREFIX}tasks": len(rows),
        f"{PREFIX}backbone": float(np.mean([r["backbone_share"] for r in rows])),
        f"{PREFIX}path": float(np.mean([r["path_share"] for r in rows])),
        f"{PREFIX}backbone_uniform": float(
            np.mean([uniform_backbone_share(r["n"], r["k0"]) for r in rows])
        ),
    }
