"""The traced building blocks of every estimator: a forest's index arrays and level sweeps.

`structure` turns (seg_parent, seg_child) into masks and clamped indices; `bottom_up` sweeps
from the leaves to the roots (node values, subtree sums), `top_down` from the roots down (path
mass, root id, path-prefix sums), each a `lax.while_loop` with one iteration per tree level.
Every quantity is a `jax.ops.segment_sum` (or `segment_max`) over node ids plus gathers.

Suffixes: _s per segment, _n per node.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Structure(NamedTuple):
    """Index arrays shared by every kernel (suffix: _s per segment, _n per node)."""

    valid_s: jax.Array  # bool: not a padding segment
    inner_s: jax.Array  # bool: valid and ends at a node
    parent_s: jax.Array  # int32: seg_parent, padding mapped to 0 (its data is always masked)
    child_s: jax.Array  # int32: seg_child, leaves and padding mapped to 0 (masked likewise)
    num_children_n: jax.Array  # int32: K of every node (0 for unused ids)
    inv_k_n: jax.Array  # float32: 1/K, 0 where K == 0
    num_nodes: int


def structure(seg_parent_s, seg_child_s, num_nodes: int) -> Structure:
    """The masks, clamped indices and child counts of a forest's segment arrays."""
    valid_s = seg_parent_s >= 0
    inner_s = valid_s & (seg_child_s >= 0)
    parent_s = jnp.where(valid_s, seg_parent_s, 0)
    child_s = jnp.where(inner_s, seg_child_s, 0)
    num_children_n = jax.ops.segment_sum(valid_s.astype(jnp.int32), parent_s, num_nodes)
    inv_k_n = jnp.where(num_children_n > 0, 1.0 / jnp.maximum(num_children_n, 1), 0.0)
    return Structure(valid_s, inner_s, parent_s, child_s, num_children_n, inv_k_n, num_nodes)


def sum_over_children(st: Structure, x_s):
    """Sums a per-segment quantity into its parent node (padding contributes nothing)."""
    return jax.ops.segment_sum(jnp.where(st.valid_s, x_s, 0), st.parent_s, st.num_nodes)


def bottom_up(st: Structure, seg_reward_s, leaf_s=None):
    """Node values (mean of the children's values) and subtree sums, one level per iteration.

    Returns (value_n, below_n): value_n[n] = mean over n's child segments c of
    seg_reward_s[c] + value_n[seg_child[c]]; below_n[n] = the sum of `leaf_s` over the leaf
    segments below n (`leaf_s` None: 1 per leaf, so below_n counts leaves, int32).

    After iteration t the integer height (1 + max height of a child node; 1 when every child is
    a leaf) is exact for nodes of height <= t and so are their values and subtree sums; the loop
    stops at the first iteration that leaves every height unchanged. The cap of num_nodes + 2
    iterations only matters for a cyclic (invalid) forest.
    """
    below_dtype = jnp.int32 if leaf_s is None else leaf_s.dtype
    leaf_s = 1 if leaf_s is None else leaf_s

    def body(carry):
        value_n, height_n, below_n, _, it = carry
        seg_value_s = seg_reward_s + jnp.where(st.inner_s, value_n[st.child_s], 0.0)
        seg_height_s = jnp.where(st.inner_s, height_n[st.child_s] + 1, 1)
        seg_below_s = jnp.where(st.inner_s, below_n[st.child_s], leaf_s)
        new_value_n = sum_over_children(st, seg_value_s) * st.inv_k_n
        new_height_n = jax.ops.segment_max(
            jnp.where(st.valid_s, seg_height_s, 0), st.parent_s, st.num_nodes
        )
        new_height_n = jnp.maximum(new_height_n, 0)  # segment_max of nothing is INT_MIN
        new_below_n = sum_over_children(st, seg_below_s)
        changed = jnp.any(new_height_n != height_n)
        return new_value_n, new_height_n, new_below_n, changed, it + 1

    n = st.num_nodes
    init = (
        jnp.zeros(n, jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.zeros(n, below_dtype),
        jnp.array(True),
        jnp.array(0, jnp.int32),
    )
    cond = lambda c: c[3] & (c[4] <= n + 1)
    value_n, _, below_n, _, _ = jax.lax.while_loop(cond, body, init)
    return value_n, below_n


class TopDown(NamedTuple):
    weight_n: jax.Array  # probability mass of reaching the node: product of 1/K above it
    root_n: jax.Array  # the root (task) node above the node
    prefix_n: jax.Array  # sum of seg_reward_s over the segments from the root to the node


def top_down(st: Structure, seg_reward_s) -> TopDown:
    """Per-node quantities that flow from the root down, one level per iteration.

    `seg_reward_s` is summed along each path (`prefix_n`): the rewards for TreeRL, step counts
    for the trajectory weights.
    """
    n = st.num_nodes
    in_count_n = jax.ops.segment_sum(st.inner_s.astype(jnp.int32), st.child_s, n)
    is_root_n = in_count_n == 0
    # A valid forest has one incoming segment per non-root node, so sums/maxes over the
    # incoming segments are gathers of that one segment.
    up_n = jax.ops.segment_max(jnp.where(st.inner_s, st.parent_s, 0), st.child_s, n)
    up_n = jnp.where(is_root_n, 0, up_n)
    in_reward_n = jax.ops.segment_sum(jnp.where(st.inner_s, seg_reward_s, 0.0), st.child_s, n)
    ids_n = jnp.arange(n, dtype=jnp.int32)

    def body(carry):
        weight_n, depth_n, root_n, prefix_n, _, it = carry
        new_weight_n = jnp.where(is_root_n, 1.0, weight_n[up_n] * st.inv_k_n[up_n])
        new_depth_n = jnp.where(is_root_n, 0, depth_n[up_n] + 1)
        new_root_n = jnp.where(is_root_n, ids_n, root_n[up_n])
        new_prefix_n = jnp.where(is_root_n, 0.0, prefix_n[up_n] + in_reward_n)
        changed = jnp.any(new_depth_n != depth_n)
        return new_weight_n, new_depth_n, new_root_n, new_prefix_n, changed, it + 1

    init = (
        jnp.ones(n, jnp.float32),
        jnp.zeros(n, jnp.int32),
        ids_n,
        jnp.zeros(n, jnp.float32),
        jnp.array(True),
        jnp.array(0, jnp.int32),
    )
    cond = lambda c: c[4] & (c[5] <= n + 1)
    weight_n, _, root_n, prefix_n, _, _ = jax.lax.while_loop(cond, body, init)
    return TopDown(weight_n, root_n, prefix_n)


def backbones(st: Structure):
    """(is_root_n, backbone_n): which node ids no segment enters (the task roots, and unused
    ids), and for every other node the root-child segment (the backbone) it descends from
    (-1 for roots)."""
    in_count_n = jax.ops.segment_sum(st.inner_s.astype(jnp.int32), st.child_s, st.num_nodes)
    is_root_n = in_count_n == 0
    seg_id_s = jnp.arange(st.valid_s.shape[0], dtype=jnp.float32)
    # Exactly one segment of a root-to-node path starts at the root: sum its id + 1 down.
    marker_s = jnp.where(st.valid_s & is_root_n[st.parent_s], seg_id_s + 1.0, 0.0)
    return is_root_n, top_down(st, marker_s).prefix_n.astype(jnp.int32) - 1


def segment_values(st: Structure, seg_reward_s, value_n):
    """V(s) = seg_reward[s] + the value of the node s ends at (0 at a leaf and for padding)."""
    value_s = seg_reward_s + jnp.where(st.inner_s, value_n[st.child_s], 0.0)
    return jnp.where(st.valid_s, value_s, 0.0)


def sibling_advantages(st: Structure, value_s, grpo, sibling_std, eps):
    """Sibling-baseline advantages; `grpo`/`sibling_std` are bools, possibly traced.

    Flags rather than static strings, so one compiled kernel serves every method.
    """
    k_s = st.num_children_n[st.parent_s].astype(jnp.float32)
    mean_s = sum_over_children(st, value_s)[st.parent_s] / jnp.maximum(k_s, 1.0)
    centred_s = value_s - mean_s
    var_s = sum_over_children(st, centred_s**2)[st.parent_s] / jnp.maximum(k_s, 1.0)
    std_s = jnp.sqrt(var_s)
    # V - (sum of the others)/(K-1) == K/(K-1) * (V - mean); this form avoids cancellation.
    loo_s = k_s / jnp.maximum(k_s - 1.0, 1.0) * centred_s
    adv_s = jnp.where(grpo, centred_s, loo_s)
    adv_s = jnp.where(grpo | sibling_std, adv_s / (std_s + eps), adv_s)
    adv_s = jnp.where(k_s >= 2, adv_s, jnp.nan)
    return jnp.where(st.valid_s, adv_s, 0.0)
