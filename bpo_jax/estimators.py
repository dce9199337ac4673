"""Advantage estimators over a forest of segments, as jitted segment-sum kernels.

The forest (see DESIGN.md) is a set of flat arrays. A *node* is a sandbox state with two or
more children (a task's initial state, or a branch point); a *segment* is a run of steps from a
node to the next node or to termination:

- `seg_parent: int32[S]`: the node segment s starts from; -1 marks a padding segment.
- `seg_child: int32[S]`: the node s ends at, or -1 when s ends at a terminal state (a leaf).
- `seg_reward: float32[S]`: the reward collected inside s.
- `num_nodes`: static number of node ids; ids that no segment uses are allowed.

Values are computed bottom-up, `V(s) = seg_reward[s] + mean(V(c) for c with seg_parent[c] ==
seg_child[s])`, by a `lax.while_loop` that runs one iteration per tree level (it stops when the
integer node heights stop changing, so the trip count is the forest's height + 1). Every
quantity is a `jax.ops.segment_sum` (or `segment_max`) over node ids plus gathers; there is no
Python loop over segments or nodes.

Conventions, fixed here for every estimator:
- Standard deviations are *population* std (divide by K, as `jnp.std` and most GRPO
  implementations in JAX do; PyTorch's `Tensor.std` default would be the sample std, K - 1).
- `eps` is added to the std, not under the square root: `A / (std + eps)`.
- Padding segments and padding steps get 0 everywhere.
- A node with fewer than two children is an error. With concrete inputs `tree_advantages`
  raises `ValueError` naming the node (`validate_forest`); under `jax.jit` inputs are tracers and
  cannot be checked, so the advantages of that node's children are NaN (loud, never a silent 0:
  a silent 0 is exactly the "early actions get no gradient" trap of DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

METHODS = ("bpo", "rloo", "grpo")
NORMALIZE = ("none", "sibling_std")
DEFAULT_EPS = 1e-6


# ----------------------------------------------------------------------------- forest structure


class _Structure(NamedTuple):
    """Index arrays shared by every kernel (suffix: _s per segment, _n per node)."""

    valid_s: jax.Array  # bool: not a padding segment
    inner_s: jax.Array  # bool: valid and ends at a node
    parent_s: jax.Array  # int32: seg_parent, padding mapped to 0 (its data is always masked)
    child_s: jax.Array  # int32: seg_child, leaves and padding mapped to 0 (masked likewise)
    num_children_n: jax.Array  # int32: K of every node (0 for unused ids)
    inv_k_n: jax.Array  # float32: 1/K, 0 where K == 0
    num_nodes: int


def _structure(seg_parent_s, seg_child_s, num_nodes: int) -> _Structure:
    valid_s = seg_parent_s >= 0
    inner_s = valid_s & (seg_child_s >= 0)
    parent_s = jnp.where(valid_s, seg_parent_s, 0)
    child_s = jnp.where(inner_s, seg_child_s, 0)
    num_children_n = jax.ops.segment_sum(valid_s.astype(jnp.int32), parent_s, num_nodes)
    inv_k_n = jnp.where(num_children_n > 0, 1.0 / jnp.maximum(num_children_n, 1), 0.0)
    return _Structure(valid_s, inner_s, parent_s, child_s, num_children_n, inv_k_n, num_nodes)


def _sum_over_children(st: _Structure, x_s):
    """Sums a per-segment quantity into its parent node (padding contributes nothing)."""
    return jax.ops.segment_sum(jnp.where(st.valid_s, x_s, 0), st.parent_s, st.num_nodes)


def _bottom_up(st: _Structure, seg_reward_s):
    """Node values (mean of the children's values) and leaf counts, one level per iteration.

    After iteration t the integer height (1 + max height of a child node; 1 when every child is
    a leaf) is exact for nodes of height <= t and so are their values and leaf counts; the loop
    stops at the first iteration that leaves every height unchanged. The cap of num_nodes + 2
    iterations only matters for a cyclic (invalid) forest.
    """

    def body(carry):
        value_n, height_n, leaves_n, _, it = carry
        seg_value_s = seg_reward_s + jnp.where(st.inner_s, value_n[st.child_s], 0.0)
        seg_height_s = jnp.where(st.inner_s, height_n[st.child_s] + 1, 1)
        seg_leaves_s = jnp.where(st.inner_s, leaves_n[st.child_s], 1)
        new_value_n = _sum_over_children(st, seg_value_s) * st.inv_k_n
        new_height_n = jax.ops.segment_max(
            jnp.where(st.valid_s, seg_height_s, 0), st.parent_s, st.num_nodes
        )
        new_height_n = jnp.maximum(new_height_n, 0)  # segment_max of nothing is INT_MIN
        new_leaves_n = _sum_over_children(st, seg_leaves_s)
        changed = jnp.any(new_height_n != height_n)
        return new_value_n, new_height_n, new_leaves_n, changed, it + 1

    n = st.num_nodes
    init = (
        jnp.zeros(n, jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.zeros(n, jnp.int32),
        jnp.array(True),
        jnp.array(0, jnp.int32),
    )
    cond = lambda c: c[3] & (c[4] <= n + 1)
    value_n, _, leaves_n, _, _ = jax.lax.while_loop(cond, body, init)
    return value_n, leaves_n


class _TopDown(NamedTuple):
    weight_n: jax.Array  # probability mass of reaching the node: product of 1/K above it
    root_n: jax.Array  # the root (task) node above the node
    prefix_n: jax.Array  # reward collected on the path from the root to the node


def _top_down(st: _Structure, seg_reward_s) -> _TopDown:
    """Per-node quantities that flow from the root down, one level per iteration."""
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
    return _TopDown(weight_n, root_n, prefix_n)


def _segment_values(st: _Structure, seg_reward_s, value_n):
    value_s = seg_reward_s + jnp.where(st.inner_s, value_n[st.child_s], 0.0)
    return jnp.where(st.valid_s, value_s, 0.0)


def _sibling_advantages(st: _Structure, value_s, grpo, sibling_std, eps):
    """Sibling-baseline advantages; `grpo`/`sibling_std` are bools, possibly traced.

    Flags rather than static strings, so one compiled kernel serves every method.
    """
    k_s = st.num_children_n[st.parent_s].astype(jnp.float32)
    mean_s = _sum_over_children(st, value_s)[st.parent_s] / jnp.maximum(k_s, 1.0)
    centred_s = value_s - mean_s
    var_s = _sum_over_children(st, centred_s**2)[st.parent_s] / jnp.maximum(k_s, 1.0)
    std_s = jnp.sqrt(var_s)
    # V - (sum of the others)/(K-1) == K/(K-1) * (V - mean); this form avoids cancellation.
    loo_s = k_s / jnp.maximum(k_s - 1.0, 1.0) * centred_s
    adv_s = jnp.where(grpo, centred_s, loo_s)
    adv_s = jnp.where(grpo | sibling_std, adv_s / (std_s + eps), adv_s)
    adv_s = jnp.where(k_s >= 2, adv_s, jnp.nan)
    return jnp.where(st.valid_s, adv_s, 0.0)


# ------------------------------------------------------------------------------ public kernels


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _tree_advantages_kernel(
    seg_parent_s, seg_child_s, seg_reward_s, grpo, sibling_std, eps, num_nodes
):
    st = _structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = _bottom_up(st, seg_reward_s)
    value_s = _segment_values(st, seg_reward_s, value_n)
    return value_s, _sibling_advantages(st, value_s, grpo, sibling_std, eps)


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _segment_weights_kernel(seg_parent_s, seg_child_s, num_nodes):
    st = _structure(seg_parent_s, seg_child_s, num_nodes)
    down = _top_down(st, jnp.zeros(seg_parent_s.shape, jnp.float32))
    weight_s = down.weight_n[st.parent_s] * st.inv_k_n[st.parent_s]
    return jnp.where(st.valid_s, weight_s, 0.0)


def _is_concrete(*trees) -> bool:
    """True when no leaf is a tracer (lists of traced scalars count as traced)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(trees))


def _prepare(seg_parent, seg_child, seg_reward, num_nodes):
    """Checks shapes and dtypes at the edge and returns int32/float32 arrays."""
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
    reward = None
    if seg_reward is not None:
        reward = jnp.asarray(seg_reward, jnp.float32)
        shapes["seg_reward"] = reward.shape
    if parent.ndim != 1 or len(set(shapes.values())) != 1:
        raise ValueError(f"segment arrays must be 1-D of one length [S], got shapes {shapes}")
    return parent, child, reward, num_nodes


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
    parent, child, reward, num_nodes = _prepare(seg_parent, seg_child, seg_reward, num_nodes)
    # Checked on the caller's arrays: NumPy input is validated without a device round trip.
    if validate and _is_concrete(seg_parent, seg_child, seg_reward):
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
    parent, child, _, num_nodes = _prepare(seg_parent, seg_child, None, num_nodes)
    if validate and _is_concrete(seg_parent, seg_child):
        validate_forest(seg_parent, seg_child, num_nodes)
    return _segment_weights_kernel(parent, child, num_nodes)


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


# -------------------------------------------------------------------------- host-side checks


def validate_forest(seg_parent, seg_child, num_nodes: int, *, seg_reward=None) -> None:
    """Checks on the host (NumPy, vectorised) that the arrays describe a forest.

    Raises:
      ValueError: naming the first offending node or segment, if an id is out of range, a node
        has fewer than two children (it must not be a node: merge the segments), a node that a
        segment ends at has no children, a node is entered by more than one segment, segments
        form a cycle, or a reward is not finite.
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


# ----------------------------------------------------------------------------- forest + registry


@struct.dataclass
class Forest:
    """A batch of rollouts as a forest (a pytree; num_nodes is static).

    Attributes:
      seg_parent, seg_child, seg_reward: see the module docstring, shape [S].
      num_nodes: static number of node ids.
      step_segment: int32[T], the segment of each step, -1 for padding. Steps of one segment
        must appear in time order (segments may interleave).
      step_reward: float32[T], optional per-step reward (summing to seg_reward per segment);
        when absent a segment's reward counts as collected at its last step.
      step_obs_id: int32[T], optional id of the observation text a step acts on (GiGPO groups);
        -1 puts a step in no group.
    """

    seg_parent: Any
    seg_child: Any
    seg_reward: Any
    num_nodes: int = struct.field(pytree_node=False)
    step_segment: Any = None
    step_reward: Any = None
    step_obs_id: Any = None

    def validate(self) -> None:
        """Host-side checks of the segment and step arrays (see `validate_forest`)."""
        validate_forest(self.seg_parent, self.seg_child, self.num_nodes, seg_reward=self.seg_reward)
        if self.step_segment is None:
            return
        step_segment = np.asarray(self.step_segment)
        num_segments = np.shape(self.seg_parent)[0]
        bad = np.flatnonzero((step_segment < -1) | (step_segment >= num_segments))
        if bad.size:
            raise ValueError(f"step_segment[{bad[0]}] = {step_segment[bad[0]]} is out of range")
        real = step_segment >= 0
        on_padding = np.flatnonzero(real & (np.asarray(self.seg_parent)[step_segment] < 0))
        if on_padding.size:
            raise ValueError(f"step {on_padding[0]} belongs to a padding segment")
        for name in ("step_reward", "step_obs_id"):
            arr = getattr(self, name)
            if arr is not None and np.shape(arr) != step_segment.shape:
                raise ValueError(f"{name} has shape {np.shape(arr)}, expected {step_segment.shape}")
        if self.step_reward is not None:
            step_reward = np.where(real, np.asarray(self.step_reward, np.float64), 0.0)
            summed = np.bincount(step_segment[real], step_reward[real], minlength=num_segments)
            seg_reward = np.where(np.asarray(self.seg_parent) >= 0, self.seg_reward, 0.0)
            bad = np.flatnonzero(~np.isclose(summed, seg_reward, rtol=1e-5, atol=1e-4))
            if bad.size:
                raise ValueError(
                    f"step rewards of segment {bad[0]} sum to {summed[bad[0]]}, but "
                    f"seg_reward[{bad[0]}] = {seg_reward[bad[0]]}"
                )


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: `fn(forest, **options)` -> advantages per segment or per step."""

    name: str
    fn: Callable[..., jax.Array]
    per_step: bool

    def __call__(self, forest: Forest, **options) -> jax.Array:
        return self.fn(forest, **options)


_REGISTRY: dict[str, Estimator] = {}


def register_estimator(name: str, *, per_step: bool = False):
    """Decorator: registers `fn(forest, **options)` under `name` (per_step: returns [T])."""

    def decorate(fn):
        if name in _REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered")
        _REGISTRY[name] = Estimator(name, fn, per_step)
        return fn

    return decorate


def get_estimator(name: str) -> Estimator:
    """Returns the estimator registered under `name`; ValueError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; known: {sorted(_REGISTRY)}") from None


def estimator_names() -> list[str]:
    return sorted(_REGISTRY)


def step_advantages(forest: Forest, name: str, **options) -> jax.Array:
    """Per-step advantages [T] from any registered estimator (segment ones are expanded)."""
    estimator = get_estimator(name)
    adv = estimator(forest, **options)
    if estimator.per_step:
        return adv
    if forest.step_segment is None:
        raise ValueError(f"estimator {name!r} gives per-segment advantages; set step_segment")
    return expand_to_steps(adv, forest.step_segment)


def _sibling_estimator(method: str):
    def estimate(forest: Forest, *, normalize: str = "none", eps: float = DEFAULT_EPS):
        return tree_advantages(
            forest.seg_parent,
            forest.seg_child,
            forest.seg_reward,
            forest.num_nodes,
            method,
            normalize,
            eps=eps,
        )[1]

    estimate.__doc__ = f"'{method}' advantages from `tree_advantages` (per segment)."
    return estimate


for _method in METHODS:
    register_estimator(_method)(_sibling_estimator(_method))


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _treerl_kernel(seg_parent_s, seg_child_s, seg_reward_s, num_nodes):
    st = _structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, leaves_n = _bottom_up(st, seg_reward_s)
    down = _top_down(st, seg_reward_s)
    value_s = _segment_values(st, seg_reward_s, value_n)
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
    parent, child, reward, num_nodes = _prepare(
        forest.seg_parent, forest.seg_child, forest.seg_reward, forest.num_nodes
    )
    if _is_concrete(forest.seg_parent, forest.seg_child, forest.seg_reward):
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
    st = _structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = _bottom_up(st, seg_reward_s)
    value_s = _segment_values(st, seg_reward_s, value_n)
    episode_s = _sibling_advantages(st, value_s, True, False, eps)
    root_s = _top_down(st, seg_reward_s).root_n[st.parent_s]

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
    parent, child, reward, num_nodes = _prepare(
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
    if _is_concrete(forest, step_weight):
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
