"""PPO's critic: a value head on the policy's features, and turn-level GAE as a jitted scan.

PPO here is the turn-level variant used for language agents. A state is the prompt a step acts
on; V(prompt) is a small MLP head on the policy's final hidden state at the prompt's last token.
The head is fitted by its own Adam on stop-gradient features, so the value loss never moves the
policy: PPO's policy updates stay comparable with those of the critic-free baselines, and the
only difference between the algorithms is the baseline. Advantages are GAE over the turns of
each trajectory (`gae`), normalised over the batch as PPO does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bpo_jax.estimators import DEFAULT_EPS, Forest, register_estimator


def init_value_head(key, dim: int, hidden: int = 256) -> dict:
    """Parameters of a one-hidden-layer MLP, D -> hidden -> 1."""
    k1, _ = jax.random.split(key)
    return {
        "w1_dh": jax.random.normal(k1, (dim, hidden), jnp.float32) / np.sqrt(dim),
        "b1_h": jnp.zeros((hidden,), jnp.float32),
        "w2_h": jnp.zeros((hidden,), jnp.float32),  # Starts at V = 0 everywhere.
        "b2": jnp.zeros((), jnp.float32),
    }


def value_fn(head: dict, feats_bd: jax.Array) -> jax.Array:
    h_bh = jax.nn.gelu(feats_bd @ head["w1_dh"] + head["b1_h"])
    return h_bh @ head["w2_h"] + head["b2"]


_values = jax.jit(value_fn)


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


class Critic:
    """The value head, its optimiser state, and the policy features it reads.

    Attributes:
      state: {"head": params, "opt_state": Adam state}, a pytree saved with checkpoints.
    """

    def __init__(self, graphdef, dim: int, lr: float, epochs: int, seed: int, pad_id: int):
        self.graphdef = graphdef
        self.pad_id = pad_id
        self.epochs = epochs
        self.optimizer = optax.adam(lr)
        head = init_value_head(jax.random.key(seed), dim)
        self.state = {"head": head, "opt_state": self.optimizer.init(head)}
        self._features = jax.jit(self._features_impl)
        self._step = jax.jit(self._step_impl)

    def _features_impl(self, params, tokens_bt, last_b):
        model = nnx.merge(self.graphdef, params)
        _, _, hidden_btd = model(tokens_bt, return_hidden=True)
        feats = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)[:, 0]
        return jax.lax.stop_gradient(feats.astype(jnp.float32))

    def _step_impl(self, state, feats_bd, targets_b, mask_b):
        def loss(head):
            err = (value_fn(head, feats_bd) - targets_b) * mask_b
            return jnp.sum(err * err) / jnp.maximum(jnp.sum(mask_b), 1.0)

        value, grads = jax.value_and_grad(loss)(state["head"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["head"])
        return {"head": optax.apply_updates(state["head"], updates), "opt_state": opt_state}, value

    def features(self, params, prompts: list[list[int]], batch: int = 32, bucket: int = 64):
        """[N, D] stop-gradient features of each prompt (its last token's final hidden state)."""
        out = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            length = max(bucket, -(-max(len(p) for p in chunk) // bucket) * bucket)
            tokens = np.full((batch, length), self.pad_id, np.int32)
            last = np.zeros((batch,), np.int32)
            for b, p in enumerate(chunk):
                tokens[b, : len(p)] = p
                last[b] = len(p) - 1
            feats = self._features(params, jnp.asarray(tokens), jnp.asarray(last))
            out.append(np.asarray(feats)[: len(chunk)])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

    def values(self, feats_nd: np.ndarray) -> np.ndarray:
        return np.asarray(_values(self.state["head"], jnp.asarray(feats_nd)))

    def fit(self, feats_nd: np.ndarray, targets_n: np.ndarray, seed: int, batch: int = 256):
        """Regresses V on the targets for `epochs` passes; returns the mean loss of the last."""
        rng = np.random.default_rng(seed)
        n = len(targets_n)
        losses = []
        for _ in range(self.epochs):
            losses = []
            order = rng.permutation(n)
            for i in range(0, n, batch):
                idx = order[i : i + batch]
                f = np.zeros((batch, feats_nd.shape[1]), np.float32)
                y = np.zeros((batch,), np.float32)
                m = np.zeros((batch,), np.float32)
                f[: len(idx)], y[: len(idx)], m[: len(idx)] = feats_nd[idx], targets_n[idx], 1.0
                self.state, loss = self._step(self.state, f, y, m)
                losses.append(float(loss))
        return float(np.mean(losses)) if losses else 0.0
