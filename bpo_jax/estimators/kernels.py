"""The per-segment kernels: values and sibling advantages, path-mass and trajectory weights.

Each public function checks its arguments on the host (`validation`), then calls one jitted
kernel built from `structure`'s level sweeps; `num_nodes` is static, so a kernel compiles once
per (number of segments, number of nodes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bpo_jax.estimators.structure import (
    bottom_up,
    segment_values,
    sibling_advantages,
    structure,
    top_down,
)
from bpo_jax.estimators.validation import is_concrete, prepare, validate_forest

METHODS = ("bpo", "rloo", "grpo")
NORMALIZE = ("none", "sibling_std")
DEFAULT_EPS = 1e-6


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _tree_advantages_kernel(
    seg_parent_s, seg_child_s, seg_reward_s, grpo, sibling_std, eps, num_nodes
):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = bottom_up(st, seg_reward_s)
    value_s = segment_values(st, seg_reward_s, value_n)
    return value_s, sibling_advantages(st, value_s, grpo, sibling_std, eps)


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _segment_weights_kernel(seg_parent_s, seg_child_s, num_nodes):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    down = top_down(st, jnp.zeros(seg_parent_s.shape, jnp.float32))
    weight_s = down.weight_n[st.parent_s] * st.inv_k_n[st.parent_s]
    return jnp.where(st.valid_s, weight_s, 0.0)


def tree_advantages(
    seg_parent,
    seg_child,
    seg_reward,
    num_nodes: int,
    method: str = "bpo",
    normalize: str = "none",
    *,
    eps: float = DEFAULT_EPS,
    validate: bool = True,
):
    """Per-segment values and sibling-baseline advantages of a forest.

    Args:
      seg_parent: int[S], the node each segment starts from; -1 for padding.
      seg_child: int[S], the node each segment ends at; -1 when it ends at a terminal state.
      seg_reward: float[S], the reward collected inside each segment.
      num_nodes: static number of node ids.
      method: 'bpo' or 'rloo': `A(s) = V(s) - (sum of V over s's siblings, s excluded)/(K-1)`;
        'grpo': `A(s) = (V(s) - mean)/(std + eps)` with the mean and population std over all K
        children of seg_parent[s], s included. 'bpo' and 'rloo' are the same formula (RLOO is
        its depth-1 special case); both names exist so configs read like the paper.
      normalize: 'none' or 'sibling_std' (bpo/rloo only: divide by the population std of the
        siblings, s included, plus eps; GRPO-style, slightly biased).
      eps: added to the std.
      validate: when the inputs are concrete (not tracers) check the forest with
        `validate_forest` first. Under jit nothing can be checked; see the module docstring.

    Returns:
      (values, advantages), float32[S] each; 0 for padding segments.

    Raises:
      ValueError: bad method/normalize, bad shapes, or an invalid concrete forest.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if normalize not in NORMALIZE:
        raise ValueError(f"unknown normalize {normalize!r}; choose one of {NORMALIZE}")
    if method == "grpo" and normalize != "none":
        raise ValueError("method='grpo' already divides by the sibling std; use normalize='none'")
    parent, child, reward, num_nodes = prepare(seg_parent, seg_child, seg_reward, num_nodes)
    # Checked on the caller's arrays: NumPy input is validated without a device round trip.
    if validate and is_concrete(seg_parent, seg_child, seg_reward):
        validate_forest(seg_parent, seg_child, num_nodes, seg_reward=seg_reward)
    flags = (jnp.asarray(method == "grpo"), jnp.asarray(normalize == "sibling_std"))
    eps = jnp.asarray(eps, jnp.float32)
    return _tree_advantages_kernel(parent, child, reward, *flags, eps, num_nodes)


def segment_weights(seg_parent, seg_child, num_nodes: int, *, validate: bool = True):
    """Probability mass of the paths through each segment.

    `w(s)` is the product of 1/K over seg_parent[s] and every node above it, i.e. the chance
    that a path sampled uniformly at each branch point runs through s. The weights of any set of
    segments that every root-to-leaf path of a task crosses exactly once (all leaves; all
    segments at one depth of a full tree) sum to 1.

    Returns:
      float32[S], 0 for padding segments.
    """
    parent, child, _, num_nodes = prepare(seg_parent, seg_child, None, num_nodes)
    if validate and is_concrete(seg_parent, seg_child):
        validate_forest(seg_parent, seg_child, num_nodes)
    return _segment_weights_kernel(parent, child, num_nodes)


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _trajectory_kernel(seg_parent_s, seg_child_s, seg_len_s, num_nodes):
    """(trajectory weights float32[S], path lengths int32[S]); see `trajectory_weights`."""
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    len_s = jnp.where(st.valid_s, seg_len_s, 0.0)
    # Summed from the root down, the step counts give each node's path-prefix length.
    down = top_down(st, len_s)
    path_len_s = jnp.where(st.valid_s, down.prefix_n[st.parent_s] + len_s, 0.0)
    mass_s = down.weight_n[st.parent_s] * st.inv_k_n[st.parent_s]
    leaf_s = st.valid_s & ~st.inner_s
    per_leaf_s = jnp.where(leaf_s, mass_s / jnp.maximum(path_len_s, 1.0), 0.0)
    # Summed from the leaves up, w(l) / L(l) gives every node the sum over the leaves below it.
    _, below_n = bottom_up(st, jnp.zeros_like(len_s), per_leaf_s)
    weight_s = jnp.where(st.inner_s, below_n[st.child_s], per_leaf_s)
    return jnp.where(st.valid_s, weight_s, 0.0), path_len_s.astype(jnp.int32)


def trajectory_weights(seg_parent, seg_child, seg_len, num_nodes: int, *, validate: bool = True):
    """Loss weight per segment under which a tree estimates the per-trajectory objective.

    `t(s) = sum over the leaf segments l at or below s of w(l) / L(l)`, with w(l) the path mass
    of l (`segment_weights`) and L(l) the number of steps on the root-to-leaf path ending with
    l (`path_lengths`; a path of 0 steps counts as 1). Every step of s gets t(s): summed over
    a task's tree, each root-to-leaf path then counts with its probability, averaged over its
    length. On an independent group of N trajectories this is (1/N) / (trajectory length), the
    per-trajectory mean that GRPO and RLOO estimate.

    What it estimates (tests/test_variable_length_mdp.py, exact targets through the engine):
    - Every episode of the same length H: `dJ / H` for groups and trees alike (unbiased up to
      the constant 1 / H).
    - Lengths that vary with the actions: NOT `dJ`, nor `dJ` over any constant. A group with
      leave-one-out advantages estimates `dE[R / L] - J dE[1 / L]`, the gradient of
      `E[(R - J) / L]` with J held at its current value (`envs.tabular.exact.
      length_normalized_grad`): the 1 / L factor rewards short episodes and the baseline no
      longer cancels. A tree estimates yet another update, which depends on K and on where it
      branches (`exact.expected_tree_gradient`): a step above a branch point gets weight
      `mean over its leaves of 1 / L` and advantage `mean over its leaves of R` minus the
      baseline, and the cross terms between different leaves give
      `E[X Y] = E[X_c Y_c] / K + (K - 1) / K E[X_c] E[Y_c]` at each node. So with variable
      lengths BPO and RLOO under this weighting do not estimate the same objective (the
      difference is many standard errors wide on the `variable_length` MDP).
    - `segment_weights` (the `path_mass` step weighting) is unbiased for dJ in every case,
      budgets that cut trees at random included; divide it by a constant (e.g. the expected
      episode length) for a per-step scale.

    Args:
      seg_parent, seg_child: the forest (see the package docstring).
      seg_len: int[S], the number of steps in each segment (anything for padding).
      num_nodes: static number of node ids.
      validate: check the concrete forest and step counts first (`validate_forest`).

    Returns:
      float32[S], 0 for padding segments.
    """
    return _checked_trajectory_kernel(seg_parent, seg_child, seg_len, num_nodes, validate)[0]


def path_lengths(seg_parent, seg_child, seg_len, num_nodes: int, *, validate: bool = True):
    """Steps on the path from each segment's task root to the segment's end.

    For a leaf segment this is the length of its root-to-leaf episode. Arguments as
    `trajectory_weights`; exact while a path has fewer than 2^24 steps.

    Returns:
      int32[S], 0 for padding segments.
    """
    return _checked_trajectory_kernel(seg_parent, seg_child, seg_len, num_nodes, validate)[1]


def _checked_trajectory_kernel(seg_parent, seg_child, seg_len, num_nodes, validate):
    """`_trajectory_kernel` on the prepared forest, validated first if asked and concrete."""
    parent, child, seg_len_s, num_nodes = prepare(
        seg_parent, seg_child, seg_len, num_nodes, "seg_len"
    )
    if validate and is_concrete(seg_parent, seg_child, seg_len):
        validate_forest(seg_parent, seg_child, num_nodes, seg_len=seg_len)
    return _trajectory_kernel(parent, child, seg_len_s, num_nodes)


@jax.jit
def _gather_or_zero(values, index):
    index = jnp.asarray(index, jnp.int32)
    return jnp.where(index >= 0, values[jnp.maximum(index, 0)], jnp.zeros((), values.dtype))


def expand_to_steps(seg_values, step_segment):
    """Gives every step its segment's value: out[t] = seg_values[step_segment[t]], 0 where -1.

    `step_segment` may have any shape (e.g. [T] or [B, T]); the result has its shape.
    """
    return _gather_or_zero(jnp.asarray(seg_values), step_segment)


def expand_to_tokens(step_values, token_step):
    """Gives every token its step's value: out[i] = step_values[token_step[i]], 0 where -1."""
    return _gather_or_zero(jnp.asarray(step_values), token_step)
