"""Estimators beyond the sibling baseline: TreeRL's global + local term, GiGPO's step groups.

Both are registered in the estimator registry on import (`registry.register_estimator`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bpo_jax.estimators.kernels import DEFAULT_EPS
from bpo_jax.estimators.registry import Forest, register_estimator
from bpo_jax.estimators.structure import (
    bottom_up,
    segment_values,
    sibling_advantages,
    structure,
    top_down,
)
from bpo_jax.estimators.validation import is_concrete, prepare, validate_forest


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _treerl_kernel(seg_parent_s, seg_child_s, seg_reward_s, num_nodes):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, leaves_n = bottom_up(st, seg_reward_s)
    down = top_down(st, seg_reward_s)
    value_s = segment_values(st, seg_reward_s, value_n)
    root_value_s = value_n[down.root_n[st.parent_s]]
    global_s = down.prefix_n[st.parent_s] + value_s - root_value_s
    local_s = value_s - value_n[st.parent_s]
    leaves_s = jnp.where(st.inner_s, leaves_n[st.child_s], 1).astype(jnp.float32)
    adv_s = (global_s + local_s) / jnp.sqrt(jnp.maximum(leaves_s, 1.0))
    adv_s = jnp.where(st.num_children_n[st.parent_s] >= 2, adv_s, jnp.nan)
    return jnp.where(st.valid_s, adv_s, 0.0)


@register_estimator("treerl")
def treerl(forest: Forest) -> jax.Array:
    """TreeRL-style global + local advantage per segment.

    `A(s) = [(P(s) + V(s) - V(root)) + (V(s) - V(p))] / sqrt(L(s))` with V(s) the segment value
    of `tree_advantages`, V(node) the mean of its children's values (V(root) is the task's mean
    return), p = seg_parent[s], L(s) the number of leaves under s (1 for a leaf) and P(s) the
    reward collected on the path from the root to p. P makes both sides of the global term
    returns from the task's start; with terminal-only rewards (TreeRL's setting) it is 0 and the
    formula is TreeRL's `(V(s) - V(root)) + (V(s) - V(parent))`. Unlike TreeRL, V(node) weights
    children equally (path probability), not leaves equally; the two agree on balanced trees.
    """
    parent, child, reward, num_nodes = prepare(
        forest.seg_parent, forest.seg_child, forest.seg_reward, forest.num_nodes
    )
    if is_concrete(forest.seg_parent, forest.seg_child, forest.seg_reward):
        validate_forest(
            forest.seg_parent, forest.seg_child, num_nodes, seg_reward=forest.seg_reward
        )
    return _treerl_kernel(parent, child, reward, num_nodes)


def _suffix_sum_in_runs(x_t, seg_t, longest):
    """Suffix sums within runs of equal seg_t, by recursive doubling: add the partial sum d
    places ahead when it lies in the same run, d = 1, 2, 4, ... until d reaches the longest run.
    """
    num_steps = seg_t.shape[0]
    ids = jnp.arange(num_steps)

    def body(carry):
        suffix, d = carry
        ahead = jnp.minimum(ids + d, num_steps - 1)
        same_run = (ids + d < num_steps) & (seg_t[ahead] == seg_t)
        return suffix + jnp.where(same_run, suffix[ahead], 0.0), d * 2

    return jax.lax.while_loop(lambda c: c[1] < longest, body, (x_t, 1))[0]


def _segmented_suffix_sum(x_t, seg_t, num_segments: int):
    """For each step, the sum of x over the steps at or after it (array order) in its segment.

    When every segment's steps are one contiguous run (the usual layout) the runs are summed in
    place; otherwise a stable sort by segment makes them contiguous first (sorting is the slow
    part on CPU, so it is skipped when it is not needed).
    """
    real_t = seg_t >= 0
    run_length = jax.ops.segment_sum(real_t.astype(jnp.int32), jnp.maximum(seg_t, 0), num_segments)
    longest = jnp.max(run_length)
    run_start_t = real_t & jnp.concatenate([jnp.array([True]), seg_t[1:] != seg_t[:-1]])
    contiguous = jnp.sum(run_start_t) == jnp.sum(run_length > 0)

    def sorted_first():
        order = jnp.argsort(seg_t, stable=True)
        suffix = _suffix_sum_in_runs(x_t[order], seg_t[order], longest)
        return jnp.zeros_like(x_t).at[order].set(suffix)

    return jax.lax.cond(contiguous, lambda: _suffix_sum_in_runs(x_t, seg_t, longest), sorted_first)


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _gigpo_kernel(
    seg_parent_s,
    seg_child_s,
    seg_reward_s,
    step_segment_t,
    step_reward_t,
    step_obs_t,
    step_weight,
    eps,
    num_nodes,
):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = bottom_up(st, seg_reward_s)
    value_s = segment_values(st, seg_reward_s, value_n)
    episode_s = sibling_advantages(st, value_s, True, False, eps)
    root_s = top_down(st, seg_reward_s).root_n[st.parent_s]

    real_t = step_segment_t >= 0
    seg_t = jnp.maximum(step_segment_t, 0)
    if step_reward_t is None:
        rtg_t = value_s[seg_t]
    else:
        continuation_s = jnp.where(st.inner_s, value_n[st.child_s], 0.0)
        reward_t = jnp.where(real_t, step_reward_t, 0.0)
        rtg_t = (
            _segmented_suffix_sum(reward_t, step_segment_t, seg_parent_s.shape[0])
            + continuation_s[seg_t]
        )

    # Dense ids for the (task, observation) groups: sort by the pair, number the runs.
    grouped_t = real_t & (step_obs_t >= 0)
    task_t = jnp.where(grouped_t, root_s[seg_t], -1)
    obs_t = jnp.where(grouped_t, step_obs_t, -1)
    order = jnp.lexsort((obs_t, task_t))
    task_sorted, obs_sorted = task_t[order], obs_t[order]
    new_run = (task_sorted[1:] != task_sorted[:-1]) | (obs_sorted[1:] != obs_sorted[:-1])
    run_sorted = jnp.cumsum(jnp.concatenate([jnp.array([0]), new_run.astype(jnp.int32)]))
    group_t = jnp.zeros_like(run_sorted).at[order].set(run_sorted)
    num_steps = step_segment_t.shape[0]
    count_g = jax.ops.segment_sum(grouped_t.astype(jnp.float32), group_t, num_steps)
    total_g = jax.ops.segment_sum(jnp.where(grouped_t, rtg_t, 0.0), group_t, num_steps)
    mean_t = total_g[group_t] / jnp.maximum(count_g[group_t], 1.0)
    step_adv_t = jnp.where(grouped_t & (count_g[group_t] >= 2), rtg_t - mean_t, 0.0)
    return jnp.where(real_t, episode_s[seg_t] + step_weight * step_adv_t, 0.0)


@register_estimator("gigpo", per_step=True)
def gigpo(forest: Forest, *, step_weight: float = 1.0, eps: float = DEFAULT_EPS) -> jax.Array:
    """GiGPO-style advantage per step: episode-level GRPO plus a step-level group term.

    Episode term: the 'grpo' advantage of the step's segment (on a depth-1 forest, the GRPO
    advantage of the whole trajectory). Step term: the step's return-to-go (undiscounted: the
    rewards of its segment from this step on, plus the value of the node the segment ends at)
    minus the mean return-to-go of the steps of the same task (same root) with the same
    step_obs_id; a group of one, or obs id -1, gives 0. No std division in the step term.
    Result: `episode + step_weight * step`, float32[T], 0 for padding steps.
    """
    if forest.step_segment is None or forest.step_obs_id is None:
        raise ValueError("gigpo needs forest.step_segment and forest.step_obs_id")
    parent, child, reward, num_nodes = prepare(
        forest.seg_parent, forest.seg_child, forest.seg_reward, forest.num_nodes
    )
    step_segment = jnp.asarray(forest.step_segment, jnp.int32)
    step_obs = jnp.asarray(forest.step_obs_id, jnp.int32)
    step_reward = forest.step_reward
    if step_reward is not None:
        step_reward = jnp.asarray(step_reward, jnp.float32)
    if step_segment.ndim != 1 or step_obs.shape != step_segment.shape:
        raise ValueError(
            f"step arrays must be 1-D of one length [T], got step_segment {step_segment.shape}, "
            f"step_obs_id {step_obs.shape}"
        )
    step_weight = jnp.asarray(step_weight, jnp.float32)
    if is_concrete(forest, step_weight):
        forest.validate()
    return _gigpo_kernel(
        parent,
        child,
        reward,
        step_segment,
        step_reward,
        step_obs,
        step_weight,
        jnp.asarray(eps, jnp.float32),
        num_nodes,
    )
