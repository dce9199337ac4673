"""Losses and the jitted update step: behaviour cloning and the clipped policy gradient.

Everything here is a pure function of arrays. A batch is a set of right-padded token
sequences (prompt + action) with a mask on the action tokens: the only tokens that are trained.

Shape suffixes: B sequences, L sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

LOSS_AGGS = ("token_mean", "seq_mean")  # How token losses become one number (`_aggregate`).


@flax.struct.dataclass
class TrainState:
    """Everything an update changes: parameters, optimizer state and the update counter."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def make_optimizer(
    lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, grad_clip: float = 0.0
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping (`grad_clip=0` disables clipping).

    The chain's structure does not depend on the arguments, so optimizer states of different
    phases (behaviour cloning, RL) restore into one another's checkpoint template.
    """
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return optax.chain(
        optax.clip_by_global_norm(max_norm),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    """A padded batch of sequences (numpy on the host; device arrays inside jit).

    Attributes:
      tokens: int32 [B, L] prompt + action tokens, right-padded.
      loss_mask: float32 [B, L]; 1 where token l is an action token to train (predicted from
        position l - 1).
      advantages: float32 [B, L] per-token advantage (zero for BC).
      old_logprobs: float32 [B, L] log-probs of the tokens under the behaviour policy.
      weights: float32 [B] per-sequence loss weight (default 1 for every real row; 0 for
        padding rows). E.g. 1 / (steps in the sequence's trajectory), so that every trajectory
        weighs the same in the loss however many steps it took.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    weights: np.ndarray


jax.tree_util.register_dataclass(
    Batch,
    data_fields=["tokens", "loss_mask", "advantages", "old_logprobs", "weights"],
    meta_fields=[],
)


def pad_batch(
    sequences: Sequence[Sequence[int]],
    action_starts: Sequence[int],
    *,
    batch_size: int,
    length: int,
    pad_id: int,
    advantages: Sequence[float] | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    weights: Sequence[float] | None = None,
) -> Batch:
    """Packs sequences into a fixed-shape batch (padding rows get weight 0).

    Args:
      sequences: token ids, prompt followed by action (and its stop token).
      action_starts: index in each sequence of its first action token.
      batch_size, length: the static shape; sequences longer than `length` raise.
      pad_id: padding token.
      advantages: one scalar per sequence (broadcast to its action tokens).
      old_logprobs: per action token log-probs (len == len(seq) - action_start).
      weights: per-sequence loss weights (default 1).
    """
    weights_in = weights
    n = len(sequences)
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit in a batch of {batch_size}.")
    tokens = np.full((batch_size, length), pad_id, np.int32)
    mask = np.zeros((batch_size, length), np.float32)
    adv = np.zeros((batch_size, length), np.float32)
    old = np.zeros((batch_size, length), np.float32)
    weights = np.zeros((batch_size,), np.float32)
    for i, (seq, start) in enumerate(zip(sequences, action_starts)):
        if len(seq) > length:
            raise ValueError(
                f"Sequence {i} has {len(seq)} tokens, more than the batch length {length}."
            )
        if not 0 < start <= len(seq):
            raise ValueError(f"Sequence {i}: action start {start} outside (0, {len(seq)}].")
        tokens[i, : len(seq)] = seq
        mask[i, start : len(seq)] = 1.0
        weights[i] = 1.0 if weights_in is None else float(weights_in[i])
        if advantages is not None:
            adv[i, start : len(seq)] = advantages[i]
        if old_logprobs is not None:
            lp = np.asarray(old_logprobs[i], np.float32)
            if len(lp) != len(seq) - start:
                raise ValueError(
                    f"Sequence {i}: {len(lp)} old log-probs for {len(seq) - start} tokens."
                )
            old[i, start : len(seq)] = lp
    return Batch(tokens, mask, adv, old, weights)


def token_logprobs(model_fn, params, tokens_bl: jax.Array, temperature: float = 1.0):
    """Log-prob and entropy of each token given its prefix; position 0 gets 0.

    With `temperature != 1` these are of the tempered policy softmax(logits / temperature): the
    distribution the rollouts were sampled from, which is then the policy being optimised (so the
    importance ratios stay on-policy).

    Returns:
      (logprobs [B, L], entropies [B, L]) in float32.
    """
    logits, _ = model_fn(params, tokens_bl[:, :-1])
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens_bl[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros_like(logp[:, :1])
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, ent], axis=1)


def _safe_div(num, den):
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _aggregate(x_bl, mask_bl, weights_b, loss_agg: str):
    """Weighted mean of x over the masked tokens.

    token_mean: every token weighs its sequence's weight. seq_mean: each sequence's token mean
    weighs its sequence's weight (so long and short actions count alike).
    """
    if loss_agg == "token_mean":
        w_bl = mask_bl * weights_b[:, None]
        return _safe_div(jnp.sum(x_bl * w_bl), jnp.sum(w_bl))
    if loss_agg == "seq_mean":
        n_b = jnp.sum(mask_bl, axis=1)
        per_seq = _safe_div(jnp.sum(x_bl * mask_bl, axis=1), n_b)
        w_b = weights_b * (n_b > 0)
        return _safe_div(jnp.sum(per_seq * w_b), jnp.sum(w_b))
    raise ValueError(f"Unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGGS}.")


def bc_loss(model_fn, params, batch: Batch):
    """Negative log-likelihood of the action tokens (behaviour cloning)."""
    logp, ent = token_logprobs(model_fn, params, batch.tokens)
    mask = batch.loss_mask * (batch.weights[:, None] > 0)
    loss = -_aggregate(logp, mask, batch.weights, "token_mean")
    acc_den = jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {"nll": loss, "entropy": jnp.sum(ent * mask) / acc_den}


def pg_loss(
    model_fn,
    params,
    batch: Batch,
    *,
    clip_eps: float,
    loss_agg: str,
    kl_coef: float = 0.0,
    ref_logprobs: jax.Array | None = None,
    temperature: float = 1.0,
):
    """Token-level clipped policy-gradient loss (PPO/GRPO surrogate).

    Per action token: `-min(r A, clip(r, 1 - eps, 1 + eps) A)` with `r = exp(logp - old_logp)`,
    aggregated by `loss_agg`. With `kl_coef > 0` adds `kl_coef * KL(pi || ref)` using the
    non-negative k3 estimator `exp(ref - logp) - (ref - logp) - 1`.
    """
    logp, ent = token_logprobs(model_fn, params, batch.tokens, temperature)
    mask = batch.loss_mask * (batch.weights[:, None] > 0)
    log_ratio = jnp.where(mask > 0, logp - batch.old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    loss = -_aggregate(surrogate, mask, batch.weights, loss_agg)
    den = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {
        "pg_loss": loss,
        "entropy": jnp.sum(ent * mask) / den,
        "clip_frac": jnp.sum((jnp.abs(ratio - 1.0) > clip_eps) * mask) / den,
        "approx_kl_old": jnp.sum((ratio - 1.0 - log_ratio) * mask) / den,
    }
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference log-probs.")
        d = jnp.where(mask > 0, ref_logprobs - logp, 0.0)
        kl = _aggregate(jnp.exp(d) - d - 1.0, mask, batch.weights, loss_agg)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl
    metrics["loss"] = loss
    return loss, metrics


def make_model_fn(graphdef):
    """Wraps an NNX graphdef into `fn(params, tokens) -> (logits, None)`."""

    def model_fn(params, tokens_bl):
        model = nnx.merge(graphdef, params)
        return model(tokens_bl)

    return model_fn


def make_train_step(graphdef, optimizer: optax.GradientTransformation, loss_fn):
    """Builds the jitted update: `(state, batch, *extra) -> (state, metrics)`.

    The state's buffers are donated: the update happens in place on the device. The global
    gradient norm (before clipping) is reported every step.
    """
    model_fn = make_model_fn(graphdef)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def train_step(state: TrainState, batch: Batch, *extra):
        def objective(params):
            return loss_fn(model_fn, params, batch, *extra)

        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(
            metrics, loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params)
        )
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    return train_step


def make_logprob_fn(graphdef, temperature: float = 1.0):
    """Jitted `(params, tokens) -> (logprobs, entropies)` for scoring rollouts."""
    model_fn = make_model_fn(graphdef)
    return jax.jit(lambda params, tokens: token_logprobs(model_fn, params, tokens, temperature))


# ------------------------------------------------------------------ host side of the update


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class Example:
    """One training sequence: a step's prompt followed by the tokens the policy generated."""

    tokens: list[int]
    action_start: int
    advantage: float
    weight: float = 1.0  # Loss weight (see `RolloutForest.step_weights`).


def minibatches(items: Sequence, size: int, rng: np.random.Generator):
    order = rng.permutation(len(items))
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i : i + size]]


class RLUpdater:
    """Holds the jitted update and scoring functions for the clipped policy gradient."""

    def __init__(self, graphdef, cfg, pad_id: int, write: Callable[[int, dict], None]):
        t = cfg.train
        self.cfg = cfg
        self.pad_id = pad_id
        self.write = write
        self.optimizer = make_optimizer(t.lr, t.weight_decay, t.b1, t.b2, t.grad_clip)
        # The policy optimised is the tempered one the rollouts sample from.
        temp = cfg.sampler.temperature

        def loss(fn, params, batch, ref_logprobs=None):
            return pg_loss(
                fn,
                params,
                batch,
                clip_eps=t.clip_eps,
                loss_agg=t.loss_agg,
                temperature=temp,
                kl_coef=t.kl_coef,
                ref_logprobs=ref_logprobs,
            )

        self.step_fn = make_train_step(graphdef, self.optimizer, loss)
        self.logprob_fn = make_logprob_fn(graphdef, temp)

    def update(
        self,
        state: TrainState,
        examples: list[Example],
        seed: Sequence[int],
        ref_params=None,
    ):
        """Runs `train.epochs` passes of minibatch updates; returns (state, per-update metrics).

        `ref_params` (the frozen reference policy) is needed when `train.kl_coef > 0`.
        """
        if self.cfg.train.kl_coef > 0 and ref_params is None:
            raise ValueError("config.train.kl_coef > 0 needs the reference policy's parameters.")
        t = self.cfg.train
        rng = np.random.default_rng(list(seed))
        # Behaviour log-probs for every example, from the parameters the rollouts used, before
        # any update: with several minibatches or epochs the ratios are then true PPO ratios.
        batches = []
        for chunk in minibatches(examples, t.minibatch_size, rng):
            length = round_up(max(len(e.tokens) for e in chunk), self.cfg.sampler.length_bucket)
            batch = pad_batch(
                [e.tokens for e in chunk],
                [e.action_start for e in chunk],
                batch_size=t.minibatch_size,
                length=length,
                pad_id=self.pad_id,
                advantages=[e.advantage for e in chunk],
                weights=[e.weight for e in chunk],
            )
            old_lp, _ = self.logprob_fn(state.params, batch.tokens)
            extra = ()
            if t.kl_coef > 0:
                extra = (self.logprob_fn(ref_params, batch.tokens)[0],)
            batches.append(
                (
                    dataclasses.replace(batch, old_logprobs=np.asarray(old_lp) * batch.loss_mask),
                    extra,
                )
            )
        history = []
        for epoch in range(t.epochs):
            order = rng.permutation(len(batches)) if epoch else range(len(batches))
            for i in order:
                batch, extra = batches[i]
                state, metrics = self.step_fn(state, batch, *extra)
                metrics = {k: float(v) for k, v in metrics.items()}
                history.append(metrics)
                self.write(
                    int(state.step),
                    {"update/grad_norm": metrics["grad_norm"], "update/loss": metrics["loss"]},
                )
        return state, history
