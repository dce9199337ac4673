"""Host-side checks at the estimators' edge: argument shapes, and that arrays form a forest.

Under `jax.jit` the inputs are tracers and cannot be checked; the kernels then give NaN where a
node has fewer than two children (see the package docstring). With concrete inputs every public
entry point checks first and raises a `ValueError` naming the offending node or segment.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(*trees) -> bool:
    """True when no leaf is a tracer (lists of traced scalars count as traced)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(trees))


def prepare(seg_parent, seg_child, seg_values, num_nodes, name: str = "seg_reward"):
    """Checks shapes and dtypes at the edge and returns int32/float32 arrays.

    `seg_values` (named `name` in errors; may be None) is a per-segment float array such as
    the rewards.
    """
    try:
        num_nodes = operator.index(num_nodes)
    except TypeError:
        raise TypeError(
            f"num_nodes must be a static Python int, got {type(num_nodes).__name__}; pass it "
            "as a static argument when jitting"
        ) from None
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    parent = jnp.asarray(seg_parent, jnp.int32)
    child = jnp.asarray(seg_child, jnp.int32)
    shapes = {"seg_parent": parent.shape, "seg_child": child.shape}
    values = None
    if seg_values is not None:
        values = jnp.asarray(seg_values, jnp.float32)
        shapes[name] = values.shape
    if parent.ndim != 1 or len(set(shapes.values())) != 1:
        raise ValueError(f"segment arrays must be 1-D of one length [S], got shapes {shapes}")
    return parent, child, values, num_nodes


def validate_forest(
    seg_parent, seg_child, num_nodes: int, *, seg_reward=None, seg_len=None
) -> None:
    """Checks on the host (NumPy, vectorised) that the arrays describe a forest.

    Raises:
      ValueError: naming the first offending node or segment, if an id is out of range, a node
        has fewer than two children (it must not be a node: merge the segments), a node that a
        segment ends at has no children, a node is entered by more than one segment, segments
        form a cycle, a reward is not finite, or a step count (`seg_len`) is not a whole
        number >= 0.
    """
    parent = np.asarray(seg_parent).astype(np.int64)
    child = np.asarray(seg_child).astype(np.int64)
    for name, ids in (("seg_parent", parent), ("seg_child", child)):
        bad = np.flatnonzero((ids < -1) | (ids >= num_nodes))
        if bad.size:
            raise ValueError(
                f"{name}[{bad[0]}] = {ids[bad[0]]} is outside [-1, num_nodes={num_nodes})"
            )
    valid = parent >= 0
    inner = valid & (child >= 0)
    num_children = np.bincount(parent[valid], minlength=num_nodes)
    in_count = np.bincount(child[inner], minlength=num_nodes)
    too_few = np.flatnonzero(((num_children > 0) | (in_count > 0)) & (num_children < 2))
    if too_few.size:
        node = too_few[0]
        raise ValueError(
            f"node {node} has {num_children[node]} child segment(s); every node needs K >= 2 "
            "(a state with one continuation is not a branch point: merge the segment into its "
            "parent, or keep a root group of K >= 2 for the task)"
        )
    multi = np.flatnonzero(in_count > 1)
    if multi.size:
        node = multi[0]
        raise ValueError(
            f"node {node} is entered by {in_count[node]} segments; a tree node has one"
        )
    # Pointer doubling: after 2^k >= num_nodes jumps every node of a tree has reached past its
    # root; a node that has not lies on or below a cycle.
    up = np.full(num_nodes, -1, np.int64)
    up[child[inner]] = parent[inner]
    for _ in range(max(1, math.ceil(math.log2(num_nodes))) + 1):
        up = np.where(up >= 0, up[np.maximum(up, 0)], -1)
    cyclic = np.flatnonzero(up >= 0)
    if cyclic.size:
        raise ValueError(f"node {cyclic[0]} lies on or below a cycle of segments")
    if seg_reward is not None:
        reward = np.asarray(seg_reward)
        bad = np.flatnonzero(valid & ~np.isfinite(reward))
        if bad.size:
            raise ValueError(f"seg_reward[{bad[0]}] = {reward[bad[0]]} is not finite")
    if seg_len is not None:
        length = np.asarray(seg_len, np.float64)
        whole = np.isfinite(length) & (length >= 0) & (length == np.floor(length))
        bad = np.flatnonzero(valid & ~whole)
        if bad.size:
            raise ValueError(
                f"seg_len[{bad[0]}] = {length[bad[0]]} is not a number of steps (a whole "
                "number >= 0)"
            )
