"""PPO's critic: a value head on the policy's features (GAE is `bpo_jax.estimators.gae`).

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

from bpo_jax.parallel import distributed


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
        """[N, D] stop-gradient features of each prompt (its last token's final hidden state).

        Every process passes the same prompts (the merged forest). With the parameters on a
        mesh, each chunk is a global batch over it (`distributed.global_batch`: each process
        contributes the rows its devices hold, as the policy's update does) and the features
        come back whole on every process (`distributed.fetch`), also when the mesh spans
        several hosts.
        """
        mesh = distributed.mesh_of(params)
        out = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            length = max(bucket, -(-max(len(p) for p in chunk) // bucket) * bucket)
            tokens = np.full((batch, length), self.pad_id, np.int32)
            last = np.zeros((batch,), np.int32)
            for b, p in enumerate(chunk):
                tokens[b, : len(p)] = p
                last[b] = len(p) - 1
            if mesh is None:
                inputs = (jnp.asarray(tokens), jnp.asarray(last))
            else:
                inputs = distributed.global_batch((tokens, last), mesh)
            feats = self._features(params, *inputs)
            out.append(distributed.fetch(feats)[: len(chunk)])
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
