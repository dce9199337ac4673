"""Token log-probs and entropies (chunked over positions), and the BC and clipped policy-gradient
losses: pure functions of arrays.

Shape suffixes: B sequences, L sequence length, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bpo_jax.learner.batch import Batch
from bpo_jax.models import sharding

LOSS_AGGS = ("token_mean", "seq_mean")  # How token losses become one number (`_aggregate`).


def token_logprobs(model_fn, params, tokens_bl: jax.Array, temperature: float = 1.0):
    """Log-prob and entropy of each token given its prefix; position 0 gets 0.

    With `temperature != 1` these are of the tempered policy softmax(logits / temperature): the
    distribution the rollouts were sampled from, which is then the policy being optimised (so the
    importance ratios stay on-policy).

    A `model_fn` from `make_model_fn` computes them over chunks of `logits_chunk` positions
    (`chunked_token_logprobs`), so that no [B, L, V] float32 tensor exists, in the forward pass
    or the backward one; any other `fn(params, tokens) -> (logits, _)` is scored whole.

    Returns:
      (logprobs [B, L], entropies [B, L]) in float32.
    """
    features = getattr(model_fn, "features", None)
    if features is not None:
        hidden_btd, head_dv = features(params, tokens_bl[:, :-1])
        logp, ent = chunked_token_logprobs(
            hidden_btd, head_dv, tokens_bl[:, 1:], temperature, model_fn.logits_chunk
        )
    else:
        logits, _ = model_fn(params, tokens_bl[:, :-1])
        logp, ent = _logprob_entropy(logits, tokens_bl[:, 1:], temperature)
    pad = jnp.zeros_like(logp[:, :1])
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, ent], axis=1)


def _logprob_entropy(logits_btv, targets_bt, temperature: float):
    """Log-prob of `targets_bt` and entropy of softmax(logits / temperature), in float32."""
    logp_all = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_bt[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, ent


def chunked_token_logprobs(
    hidden_btd: jax.Array,
    head_dv: jax.Array,
    targets_bt: jax.Array,
    temperature: float = 1.0,
    chunk: int = 0,
):
    """Log-probs of `targets_bt` and entropies from final hidden states, C positions at a time.

    The LM head, the log-softmax and the entropy run inside a `lax.scan` over chunks of `chunk`
    positions whose body is rematerialised (`jax.checkpoint`): the forward pass holds one
    chunk's [B, C, V] float32 logits at a time, and the backward pass recomputes each chunk's
    logits from its [B, C, D] hidden states instead of keeping them. At Qwen2.5-7B's 152k
    vocabulary a 1024-token sequence's float32 logits are 0.6 GB; a 128-position chunk's, 78 MB.

    Args:
      hidden_btd: [B, T, D] final-norm hidden states (compute dtype).
      head_dv: [D, V] LM head (compute dtype).
      targets_bt: int32 [B, T] the token each position predicts.
      temperature: the policy's sampling temperature.
      chunk: positions per chunk; 0 (or >= T) scores the whole sequence at once.

    Returns:
      (logprobs [B, T], entropies [B, T]) in float32.
    """
    b, t, d = hidden_btd.shape

    def score(h_bcd, y_bc):
        logits_bcv = jnp.einsum("bcd,dv->bcv", h_bcd, head_dv, preferred_element_type=jnp.float32)
        logits_bcv = sharding.constrain(logits_bcv, ("batch", "length", "vocab"))
        return _logprob_entropy(logits_bcv, y_bc, temperature)

    if chunk <= 0 or chunk >= t:
        return score(hidden_btd, targets_bt)
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    # [B, N C, ...] -> [N, B, C, ...]: the scan runs over chunks; rows keep their sharding.
    h_nbcd = h.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    y_nbc = y.reshape(b, n, chunk).transpose(1, 0, 2)

    @jax.checkpoint
    def body(_, xs):
        return None, score(*xs)

    _, (logp_nbc, ent_nbc) = jax.lax.scan(body, None, (h_nbcd, y_nbc))
    logp = logp_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    ent = ent_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    return logp, ent


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


def loss_denominator(batch: Batch, loss_agg: str) -> jax.Array:
    """The weight sum that `_aggregate` divides a batch's loss by (see `make_train_step`)."""
    mask_bl = batch.loss_mask * (batch.weights[:, None] > 0)
    if loss_agg == "token_mean":
        return jnp.sum(mask_bl * batch.weights[:, None])
    if loss_agg == "seq_mean":
        return jnp.sum(batch.weights * (jnp.sum(mask_bl, axis=1) > 0))
    raise ValueError(f"Unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGGS}.")
