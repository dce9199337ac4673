"""How much of the return variance a branch point's history explains, measured on a forest.

The paper's variance claim (DESIGN.md, "When the variance claim holds") is about one quantity,
`f = Var(E[R | h]) / Var(R)`, the share of the return variance that the history h at a branch
point explains. This module estimates its parts from the recorded trees, per branch point, with
no model: the sibling returns below each branch point and the task's backbones (the root's
children) are the only inputs.

Notation, per task (one root r with K0 >= 2 backbones b) and per branch point n below it (K >= 2
children c, history h, D the law of h over the branch points the rule chose):
- `Y_c = P(n) + V(c)`: the reward on the path from the root to n plus the child's segment value
  (`tree_advantages`' V). Given h the Y_c are independent with mean `Q(h) = E[R | h]` and
  variance `v(h)` (`Var(R | h)` when the children run to the end unbranched; less when they
  branch again, since V(c) then averages a subtree).
- `J = E[R]`; `sigma^2 = Var(R)`, the variance of one episode's return.
- Between part `B = E_D[(Q(h) - J)^2]`, within part `W = E_D[v(h)]`. When D is the on-policy law
  of the history at one step (every running path branches there, no early ends), B is exactly
  `Var(E[R | h])`, and without nested branching `B + W = sigma^2` (law of total variance).

Estimators (each unbiased; the derivation):
- Within: `s2_n = sum_c (Y_c - Ybar_n)^2 / (K - 1)`, the sample variance of the K children;
  `E[s2_n | h] = v(h)`.
- Between: `Ybar_n` has `E[Ybar_n | h] = Q(h)` and `Var(Ybar_n | h) = v(h) / K`. J is estimated
  by `O_n`, the mean of the values V(b) of the `M = K0 - 1` backbones other than n's own; they
  are different root children, so `O_n` is independent of n's subtree, `E[O_n] = J` and
  `Var(O_n) = tau^2 / M` with `tau^2 = Var(V(b))`. Expanding, the cross terms have mean zero
  (`Ybar_n - Q(h)` has mean 0 given h; `O_n - J` is independent of it and of h):
      E[(Ybar_n - O_n)^2] = E_D[(Q(h) - J)^2] + E_D[v(h)] / K + tau^2 / M,
  so `Bhat_n = (Ybar_n - O_n)^2 - s2_n / K - t2_n / M` is unbiased for B, with `t2_n` the sample
  variance of the M other backbones' values (unbiased for tau^2). Not the variance of all K0:
  whether n exists depends on its own backbone's history, so its own value is a selected
  sample (on MDPs with early ends the difference is several standard errors). The terms are
  correlated; unbiasedness only needs each one's mean, so that does not matter.
- Var(R): `sigma2hat_n`, the sample variance of the M other backbones' episode returns, each
  backbone followed down through the first child (lowest segment id) of every node below it.
  That choice ignores every outcome, so each is one on-policy episode.
- With K0 = 2 (M = 1) one other backbone has no sample variance; the variance of both stands
  in for t2_n and sigma2hat_n, unbiased only when the branch rule does not select on the
  backbone (e.g. every backbone branches at the same step and none ends before it). Use
  K0 >= 3 to measure f under an entropy rule.
- f of a set of branch points: `sum Bhat / sum sigma2hat` (a ratio of unbiased sums: consistent,
  not unbiased in small samples; bootstrap it over tasks, `bpo_jax.study.table2a`).

The per-decision claim, measured on the same trees (Table 2a). For a child c of n and a baseline
of size `m = min(K - 1, M)`:
- sibling baseline (the estimator's leave-one-out mean; for m < K - 1 the mean over all size-m
  subsets of the siblings): `mean_c A^2 = (1 + 1/m) s2_n`, an identity of the sample (for
  m = K - 1, `mean_c (K/(K-1))^2 (Y_c - Ybar)^2`); its mean is `(1 + 1/m) W`.
- trajectory baseline: the mean of m episode returns of the other backbones (independent
  episodes from the root, independent of c's action), averaged over all size-m subsets of
  them: `mean_c A^2 = (Ybar_n - Obar_n)^2 + (K-1)/K s2_n + (1/m - 1/M) sigma2hat_n`, with
  `Obar_n` the mean of the M other backbones' episode returns; its mean is
  `W + B + sigma^2 / m`.
- So the reduction is `B + (sigma^2 - W) / m` in general ("identity" below), and the paper's
  `(1 + 1/m) B` exactly when `B + W = sigma^2` (on-policy branch points, no nested branching).
  A rule that branches where the conditional variance is large (an entropy threshold can) makes
  W exceed `sigma^2 - B`, and the reduction is smaller than the paper's formula.

Caveat: a per-task budget shared by the backbones couples their trees (one backbone's length
changes where another may branch); O_n is then not exactly independent of n. A second-order
effect, absent from the tabular tests.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.estimators.registry import Forest
from bpo_jax.estimators.structure import (
    backbones,
    bottom_up,
    segment_values,
    structure,
    sum_over_children,
    top_down,
)
from bpo_jax.estimators.validation import is_concrete, prepare, validate_forest

STRATA = ("step", "level")

# The per-(task, depth) sums of `task_depth_parts`, in this order; every one adds up over
# branch points, tasks and iterations.
PART_SUMS = (
    "between",
    "within",
    "var_return",
    "var_baseline",
    "sibling_sq",
    "trajectory_sq",
    "predicted",
    "predicted_identity",
    "m",
)


class BranchStats(NamedTuple):
    """Per node of a forest (suffix-free arrays of length num_nodes); see the module docstring.

    Every float is 0 and every int -1 (num_children: 0) where `branch` is False.

    Attributes:
      branch: a branch point: a node below a root, K >= 2 children, its root K0 >= 2.
      task: the root node above it.
      level: branch points on the path from the root, itself included (1 = first level).
      step: agent steps on the path from the root to it (-1 when step counts are unknown).
      num_children: K.
      m: the baseline size, `min(K - 1, K0 - 1)`.
      between: `Bhat_n`, unbiased for `E_D[(E[R | h] - E[R])^2]`.
      within: `s2_n`, unbiased for `E_D[Var(Y_c | h)]`.
      var_return: `sigma2hat_n`, unbiased for Var(R) (the other backbones' episode returns).
      var_baseline: `t2_n / M`, unbiased for the variance of the other backbones' mean value,
        the trajectory-level baseline of `bpo_traj` and `bpo_shrink`.
      sibling_sq: mean over the children of A^2 with the sibling baseline of size m.
      trajectory_sq: the same with the trajectory baseline of m episodes.
    """

    branch: jax.Array
    task: jax.Array
    level: jax.Array
    step: jax.Array
    num_children: jax.Array
    m: jax.Array
    between: jax.Array
    within: jax.Array
    var_return: jax.Array
    var_baseline: jax.Array
    sibling_sq: jax.Array
    trajectory_sq: jax.Array


def _first_child_returns(st, seg_reward_s):
    """Per segment: its reward plus the rewards down the first child of every node below."""
    num_segments = st.valid_s.shape[0]
    seg_id_s = jnp.arange(num_segments, dtype=jnp.int32)
    first_n = jax.ops.segment_min(
        jnp.where(st.valid_s, seg_id_s, num_segments), st.parent_s, st.num_nodes
    )
    has_children_n = st.num_children_n > 0
    first_n = jnp.where(has_children_n, jnp.minimum(first_n, num_segments - 1), 0)

    def segment_return(ep_n):
        return seg_reward_s + jnp.where(st.inner_s, ep_n[st.child_s], 0.0)

    def body(carry):
        ep_n, _, it = carry
        new_n = jnp.where(has_children_n, segment_return(ep_n)[first_n], 0.0)
        return new_n, jnp.any(new_n != ep_n), it + 1

    # F(ep) is a fixed map; once an iteration changes nothing, no later one would.
    init = (jnp.zeros(st.num_nodes, jnp.float32), jnp.array(True), jnp.array(0, jnp.int32))
    cond = lambda c: c[1] & (c[2] <= st.num_nodes + 1)
    ep_n, _, _ = jax.lax.while_loop(cond, body, init)
    return jnp.where(st.valid_s, segment_return(ep_n), 0.0)


def _without_own(mean_all, ss_all, own, count):
    """(mean, sample variance) of a task's backbone quantity without one backbone's own.

    From the mean and the sum of squared deviations over all `count` backbones. With two
    backbones (one other) there is no variance to estimate from the other alone: the sample
    variance of both stands in (see `BranchStats`).
    """
    others = jnp.maximum(count - 1.0, 1.0)
    mean = (count * mean_all - own) / others
    ss = jnp.maximum(ss_all - (own - mean_all) ** 2 * count / others, 0.0)
    var = jnp.where(others >= 2.0, ss / jnp.maximum(others - 1.0, 1.0), ss_all)
    return mean, var


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _branch_stats_kernel(seg_parent_s, seg_child_s, seg_reward_s, seg_len_s, num_nodes):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = bottom_up(st, seg_reward_s)
    value_s = segment_values(st, seg_reward_s, value_n)
    down = top_down(st, seg_reward_s)
    is_root_n, backbone_n = backbones(st)
    backbone_n = jnp.maximum(backbone_n, 0)
    level_n = top_down(st, st.inner_s.astype(jnp.float32)).prefix_n
    step_n = top_down(st, jnp.where(st.valid_s, seg_len_s, 0.0)).prefix_n
    episode_s = _first_child_returns(st, seg_reward_s)

    k_n = st.num_children_n.astype(jnp.float32)
    value_ss_n = sum_over_children(st, (value_s - value_n[st.parent_s]) ** 2)
    s2_n = value_ss_n / jnp.maximum(k_n - 1.0, 1.0)
    ep_mean_n = sum_over_children(st, episode_s) / jnp.maximum(k_n, 1.0)
    ep_ss_n = sum_over_children(st, (episode_s - ep_mean_n[st.parent_s]) ** 2)

    root_n = down.root_n
    k0_n = k_n[root_n]
    others_n = jnp.maximum(k0_n - 1.0, 1.0)  # M
    m_n = jnp.maximum(jnp.minimum(k_n - 1.0, k0_n - 1.0), 1.0)
    y_bar_n = down.prefix_n + value_n
    own = lambda x_s: x_s[backbone_n]
    # The other backbones' values (the between part) and episode returns (the trajectory
    # baseline, Var(R)): their mean and sample variance, from the task's sums without n's own.
    value_o, value_s2_o = _without_own(value_n[root_n], value_ss_n[root_n], own(value_s), k0_n)
    ep_o, ep_s2_o = _without_own(ep_mean_n[root_n], ep_ss_n[root_n], own(episode_s), k0_n)
    between_n = (y_bar_n - value_o) ** 2 - s2_n / jnp.maximum(k_n, 1.0) - value_s2_o / others_n
    sibling_sq_n = (1.0 + 1.0 / m_n) * s2_n
    trajectory_sq_n = (
        (y_bar_n - ep_o) ** 2
        + (k_n - 1.0) / jnp.maximum(k_n, 1.0) * s2_n
        + jnp.where(others_n >= 2.0, (1.0 / m_n - 1.0 / others_n) * ep_s2_o, 0.0)
    )

    branch = ~is_root_n & (k_n >= 2.0) & (k0_n >= 2.0)
    known_steps = jnp.all(seg_len_s >= 0)
    fl = lambda x: jnp.where(branch, x, 0.0)
    it = lambda x: jnp.where(branch, x, -1).astype(jnp.int32)
    return BranchStats(
        branch=branch,
        task=it(root_n),
        level=it(level_n),
        step=it(jnp.where(known_steps, step_n, -1)),
        num_children=jnp.where(branch, st.num_children_n, 0),
        m=it(m_n),
        between=fl(between_n),
        within=fl(s2_n),
        var_return=fl(ep_s2_o),
        var_baseline=fl(value_s2_o / others_n),
        sibling_sq=fl(sibling_sq_n),
        trajectory_sq=fl(trajectory_sq_n),
    )


def branch_stats(forest: Forest, seg_len=None, *, validate: bool = True) -> BranchStats:
    """Per branch point: the parts of f and the per-decision advantage second moments.

    Args:
      forest: the forest (only the segment arrays are read, plus `step_segment` when `seg_len`
        is None).
      seg_len: int[S], steps per segment (for the `step` stratum); None: counted from
        `forest.step_segment`, or unknown (`step` = -1) when that is None too.
      validate: check a concrete forest first (`validate_forest`).

    Returns:
      `BranchStats`, arrays of length num_nodes.
    """
    parent, child, reward, num_nodes = prepare(
        forest.seg_parent, forest.seg_child, forest.seg_reward, forest.num_nodes
    )
    num_segments = parent.shape[0]
    if seg_len is None and forest.step_segment is not None:
        step_segment = jnp.asarray(forest.step_segment, jnp.int32)
        seg_len = jax.ops.segment_sum(
            (step_segment >= 0).astype(jnp.int32), jnp.maximum(step_segment, 0), num_segments
        )
    if seg_len is None:
        seg_len = jnp.full((num_segments,), -1.0, jnp.float32)
    seg_len = jnp.asarray(seg_len, jnp.float32)
    if seg_len.shape != (num_segments,):
        raise ValueError(f"seg_len must have shape ({num_segments},), got {seg_len.shape}")
    if validate and is_concrete(forest):
        validate_forest(
            forest.seg_parent, forest.seg_child, num_nodes, seg_reward=forest.seg_reward
        )
    return _branch_stats_kernel(parent, child, reward, seg_len, num_nodes)


def task_depth_parts(stats: BranchStats, by: str = "step") -> dict[str, np.ndarray]:
    """The branch points' parts summed per (task, depth): what a run records per iteration.

    Args:
      stats: `branch_stats` of one forest.
      by: the depth of a branch point: "step" (agent steps from the root; the exact MDP
        targets are per step) or "level" (nested branch points, 1 = first).

    Returns:
      Columns of equal length, one row per (task, depth) that has branch points: "task" (the
      root node id), "depth", "branch_points", and the sums of `PART_SUMS` over those branch
      points (so "var_return" is about Var(R) times branch_points). Sums add up over
      tasks and iterations: f = between / var_return, the measured reduction =
      (trajectory_sq - sibling_sq) / branch_points, and so on.

    Raises:
      ValueError: unknown `by`, or by="step" without step counts.
    """
    if by not in STRATA:
        raise ValueError(f"by must be one of {STRATA}, got {by!r}")
    branch = np.asarray(stats.branch, bool)
    depth = np.asarray(stats.step if by == "step" else stats.level)[branch]
    if by == "step" and np.any(depth < 0):
        raise ValueError("by='step' needs the segments' step counts (seg_len or step_segment)")
    task = np.asarray(stats.task)[branch]
    keys, row = np.unique(np.stack([task, depth], axis=1), axis=0, return_inverse=True)
    row = row.ravel()
    out = {"task": keys[:, 0], "depth": keys[:, 1]}
    out["branch_points"] = np.bincount(row, minlength=len(keys))
    sibling = np.asarray(stats.sibling_sq, np.float64)[branch]
    m = np.asarray(stats.m, np.float64)[branch]
    between = np.asarray(stats.between, np.float64)[branch]
    var_return = np.asarray(stats.var_return, np.float64)[branch]
    within = np.asarray(stats.within, np.float64)[branch]
    per_node = {
        "between": between,
        "within": within,
        "var_return": var_return,
        "var_baseline": np.asarray(stats.var_baseline, np.float64)[branch],
        "sibling_sq": sibling,
        "trajectory_sq": np.asarray(stats.trajectory_sq, np.float64)[branch],
        "predicted": (1.0 + 1.0 / np.maximum(m, 1.0)) * between,
        "predicted_identity": between + (var_return - within) / np.maximum(m, 1.0),
        "m": m,
    }
    for name in PART_SUMS:
        out[name] = np.bincount(row, per_node[name], minlength=len(keys))
    return out
