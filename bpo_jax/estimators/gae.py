"""PPO's turn-level GAE: a jitted reverse scan, and the registered estimator `gae`.

The estimator needs the critic's value of every step (`values`, an option): fitting the critic
is a stage of the RL iteration of its own (`bpo_jax.rl.fit_critic`), before the estimator runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.estimators.kernels import DEFAULT_EPS
from bpo_jax.estimators.registry import Forest, register_estimator


@jax.jit
def gae(step_segment, rewards, values, gamma, lam):
    """Turn-level GAE over trajectories laid out as segments of consecutive steps.

    Args:
      step_segment: int32 [T], the trajectory of each step (steps of one trajectory consecutive
        and in time order); -1 marks padding.
      rewards, values: float32 [T], per-step reward and V(state the step acted on).
      gamma, lam: discount and GAE lambda.

    Returns:
      (advantages [T], returns [T] = advantages + values); 0 on padding. The last step of a
      trajectory bootstraps from 0: an episode ends when the task is done or its step limit is
      reached, and the limit is part of the task.
    """
    seg = jnp.asarray(step_segment)
    next_seg = jnp.concatenate([seg[1:], jnp.full((1,), -1, seg.dtype)])
    continues = (seg == next_seg) & (seg >= 0)
    next_values = jnp.concatenate([values[1:], jnp.zeros((1,), values.dtype)])
    deltas = rewards + gamma * jnp.where(continues, next_values, 0.0) - values

    def back(carry, x):
        delta, cont = x
        adv = delta + gamma * lam * jnp.where(cont, carry, 0.0)
        return adv, adv

    _, adv = jax.lax.scan(back, jnp.float32(0.0), (deltas, continues), reverse=True)
    adv = jnp.where(seg >= 0, adv, 0.0)
    return adv, jnp.where(seg >= 0, adv + values, 0.0)


@jax.jit
def _normalised_gae(step_segment, rewards, values, gamma, lam, eps):
    adv, _ = gae(step_segment, rewards, values, gamma, lam)
    real = step_segment >= 0
    n = jnp.maximum(jnp.sum(real), 1)
    mean = jnp.sum(jnp.where(real, adv, 0.0)) / n
    std = jnp.sqrt(jnp.sum(jnp.where(real, (adv - mean) ** 2, 0.0)) / n)
    return jnp.where(real, (adv - mean) / (std + eps), 0.0)


@register_estimator("gae", per_step=True)
def gae_advantages(
    forest: Forest, *, values, gamma: float, lam: float, eps: float = DEFAULT_EPS
) -> jax.Array:
    """PPO's advantages: turn-level GAE, normalised over the batch's real steps.

    Args:
      forest: a depth-1 forest (every segment one whole trajectory), with `step_segment` and
        `step_reward`.
      values: float32 [T], the critic's V(prompt) of every step (0 on padding steps).
      gamma, lam: discount and GAE lambda.
      eps: added to the batch std.

    Returns:
      float32 [T], 0 on padding steps.
    """
    if forest.step_segment is None or forest.step_reward is None:
        raise ValueError("gae needs forest.step_segment and forest.step_reward")
    if not isinstance(forest.seg_child, jax.core.Tracer):
        inner = int((np.asarray(forest.seg_child) >= 0).sum())
        if inner:
            raise ValueError(
                "gae runs on independent trajectories (a depth-1 forest); this forest has "
                f"{inner} segment(s) that end at a branch point"
            )
    step_segment = jnp.asarray(forest.step_segment, jnp.int32)
    values = jnp.asarray(values, jnp.float32)
    if values.shape != step_segment.shape:
        raise ValueError(f"values has shape {values.shape}, expected {step_segment.shape}")
    return _normalised_gae(
        step_segment,
        jnp.asarray(forest.step_reward, jnp.float32),
        values,
        jnp.float32(gamma),
        jnp.float32(lam),
        jnp.float32(eps),
    )
