"""BPO's tree with other baselines: the other backbones (`bpo_traj`), or a mix (`bpo_shrink`).

Both keep BPO's forest, values and step weights and change only what each segment's value is
compared with, so that a comparison with `bpo` isolates the baseline from the topology:
- `bpo_traj`: a trajectory-level baseline. A segment s below the root is compared, as a return
  from the task's start, with the mean value of the task's other backbones (the root's other
  children): `A(s) = P(s) + V(s) - mean over b != b0(s) of V(b)`, P(s) the reward on the path
  from the root to s's parent node and b0(s) the backbone s descends from. A backbone itself is
  compared with the other backbones, exactly as `bpo` and `rloo` do.
- `bpo_shrink`: `A(s) = V(s) - [lam * (sibling leave-one-out mean) + (1 - lam) * (mean over
  b != b0(s) of V(b) - P(s))]`, i.e. `lam * A_bpo(s) + (1 - lam) * A_traj(s)`; lam = 1 is `bpo`,
  lam = 0 is `bpo_traj`.

Unbiased for every lam fixed before the batch is drawn: given the history at s's parent node,
the siblings are independent of the actions in s, the other backbones are independent of
everything below b0(s), and P(s) is a function of that history, so the baseline has zero mean
against the score of every step of s (DESIGN.md, "Why it is unbiased"). A lam computed from the
same batch's returns would break this; take it from earlier batches (`shrink_lambda`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.estimators.registry import Forest, register_estimator
from bpo_jax.estimators.structure import (
    backbones,
    bottom_up,
    segment_values,
    sibling_advantages,
    structure,
    sum_over_children,
    top_down,
)
from bpo_jax.estimators.validation import is_concrete, prepare, validate_forest

DEFAULT_SHRINK = 0.5  # lam until a run measures f (`shrink_lambda`).


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def _shrink_kernel(seg_parent_s, seg_child_s, seg_reward_s, shrink, num_nodes):
    st = structure(seg_parent_s, seg_child_s, num_nodes)
    value_n, _ = bottom_up(st, seg_reward_s)
    value_s = segment_values(st, seg_reward_s, value_n)
    sibling_s = sibling_advantages(st, value_s, False, False, 0.0)
    down = top_down(st, seg_reward_s)
    is_root_n, backbone_n = backbones(st)
    at_root_s = is_root_n[st.parent_s]
    seg_id_s = jnp.arange(seg_parent_s.shape[0])
    backbone_s = jnp.where(at_root_s, seg_id_s, jnp.maximum(backbone_n, 0)[st.parent_s])
    root_s = down.root_n[st.parent_s]
    k0_s = st.num_children_n[root_s].astype(jnp.float32)
    total_s = sum_over_children(st, value_s)[root_s]
    others_s = (total_s - value_s[backbone_s]) / (k0_s - 1.0)  # NaN/inf below K0 = 2: loud
    trajectory_s = down.prefix_n[st.parent_s] + value_s - others_s
    # At the root both baselines are the root group's leave-one-out mean: use one formula.
    trajectory_s = jnp.where(at_root_s, sibling_s, trajectory_s)
    adv_s = shrink * sibling_s + (1.0 - shrink) * trajectory_s
    return jnp.where(st.valid_s, adv_s, 0.0)


def shrunk_advantages(forest: Forest, shrink) -> jax.Array:
    """`lam * A_bpo + (1 - lam) * A_traj` per segment (see the module docstring).

    Args:
      forest: the forest (segment arrays).
      shrink: lam, a float or a traced scalar (any real value stays unbiased; [0, 1] mixes).

    Returns:
      float32[S], 0 for padding segments; NaN below a node with fewer than two children.
    """
    parent, child, reward, num_nodes = prepare(
        forest.seg_parent, forest.seg_child, forest.seg_reward, forest.num_nodes
    )
    if is_concrete(forest):
        validate_forest(
            forest.seg_parent, forest.seg_child, num_nodes, seg_reward=forest.seg_reward
        )
    return _shrink_kernel(parent, child, reward, jnp.asarray(shrink, jnp.float32), num_nodes)


@register_estimator("bpo_traj")
def bpo_traj(forest: Forest) -> jax.Array:
    """BPO's tree with a trajectory-level baseline: the task's other backbones (per segment)."""
    return shrunk_advantages(forest, 0.0)


@register_estimator("bpo_shrink")
def bpo_shrink(forest: Forest, *, shrink: float = DEFAULT_SHRINK) -> jax.Array:
    """`shrink * bpo + (1 - shrink) * bpo_traj` advantages (per segment); see `shrink_lambda`."""
    return shrunk_advantages(forest, shrink)


def shrink_lambda(f, v, m, w=None):
    """The lam that minimises the per-decision E[A^2] of `bpo_shrink`.

    Derivation. At a branch point with history h write Y for the step's return (`P + V`), b_s
    for `P +` its siblings' leave-one-out mean (m siblings) and b_t for the other backbones'
    mean value. Given h, Y, b_s and b_t are independent; Y and b_s have mean Q(h) = E[R | h]
    and variances v(h) and v(h)/m; b_t has mean J = E[R] and variance `Var(b_t)`. With
    `A = (Y - Q) - lam (b_s - Q) - (1 - lam)(b_t - Q)` and the expectation over h,
        E[A^2] = W + lam^2 W / m + (1 - lam)^2 (B + Var(b_t)),
    with `B = E[(Q(h) - J)^2]` and `W = E[v(h)]`. Setting the derivative in lam to zero,
        lam* = (B + Var(b_t)) / (B + Var(b_t) + W / m).
    In units of sigma^2 = Var(R): f = B / sigma^2, v = Var(b_t) / sigma^2 and w = W / sigma^2,
    `lam* = (f + v) / (f + v + w / m)`, and w = 1 - f for on-policy branch points whose
    children do not branch again. lam* = 1 (pure siblings) only when f = 1 or m is infinite;
    it falls towards 0 as f -> 0 and the trajectory baseline gets sharp (v -> 0).

    Args:
      f: the explained share of the return variance, from earlier batches (`branch_stats`).
      v: the trajectory baseline's variance over Var(R) (`var_baseline / var_return`).
      m: the number of siblings in the leave-one-out mean (K - 1).
      w: the within part over Var(R); default 1 - f.

    Returns:
      lam* clipped to [0, 1] (estimates of f and v may fall outside [0, 1] and [0, inf)),
      an array of the broadcast shape of the inputs (a float for scalars).
    """
    f = np.clip(np.asarray(f, np.float64), 0.0, 1.0)
    v = np.maximum(np.asarray(v, np.float64), 0.0)
    w = np.maximum(1.0 - f if w is None else np.asarray(w, np.float64), 0.0)
    num = f + v
    den = num + w / np.asarray(m, np.float64)
    lam = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return np.clip(lam, 0.0, 1.0)[()]


def lambda_from_parts(parts) -> float:
    """`shrink_lambda` from recorded `decomposition.task_depth_parts` (earlier batches).

    Pools every row given (concatenate several iterations' columns first):
    f = sum between / sum var_return, v = sum var_baseline / sum var_return,
    w = sum within / sum var_return, m = the mean baseline size of the branch points.

    Raises:
      ValueError: no branch points, or no return variance to scale by.
    """
    total = {k: float(np.sum(parts[k])) for k in ("between", "within", "var_return")}
    total |= {k: float(np.sum(parts[k])) for k in ("var_baseline", "m", "branch_points")}
    if total["branch_points"] <= 0 or total["var_return"] <= 0:
        raise ValueError(
            f"no branch points with return variance to measure f from ({total['branch_points']}"
            f" branch points, var_return {total['var_return']}); keep the default shrink"
        )
    scale = total["var_return"]
    return float(
        shrink_lambda(
            total["between"] / scale,
            total["var_baseline"] / scale,
            total["m"] / total["branch_points"],
            w=total["within"] / scale,
        )
    )
