"""Token sampling, one token per row: temperature, top-p (nucleus) truncation, inverse-CDF draws.

Pure functions of arrays, traced inside the sampler's decode loop (`programs.decode`). Semantics,
per row:
  * `logprobs` and `entropies` describe softmax(logits / temperature), the tempered distribution
    *before* nucleus truncation; the token itself is drawn from that distribution restricted to
    the nucleus and renormalised. Greedy (temperature 0) takes the argmax, and `logprobs` /
    `entropies` then describe the untempered softmax(logits).
  * Randomness is per row: row b draws its token at cache position p with the uniform number
    `uniform_at(row_key[b], p)`, so a forked row given its original's key continues exactly like
    the original, and rows given different keys diverge.

Shape suffixes: B batch (rows), V vocabulary, N blocks of the vocabulary, K tokens per block.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def nucleus_mask(probs_bv: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """The smallest set of tokens per row whose probability mass reaches `top_p`.

    Tokens are ranked by probability; a token is kept when the mass of the tokens ranked above it
    is still below `top_p`. So the top token is always kept, and the kept set is the shortest
    prefix of the ranking with mass >= top_p. Ties are broken by token id (stable sort), so
    exactly that many tokens are kept.

    Args:
      probs_bv: [B, V] probabilities (each row sums to 1).
      top_p: scalar in (0, 1].

    Returns:
      [B, V] bool mask of kept tokens.
    """
    order_bv = jnp.argsort(-probs_bv, axis=-1, stable=True)
    sorted_bv = jnp.take_along_axis(probs_bv, order_bv, axis=-1)
    mass_above_bv = jnp.cumsum(sorted_bv, axis=-1) - sorted_bv
    keep_sorted_bv = mass_above_bv < top_p
    keep_sorted_bv = keep_sorted_bv.at[:, 0].set(True)
    rows_b1 = jnp.arange(probs_bv.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted_bv).at[rows_b1, order_bv].set(keep_sorted_bv)


def sample_logits(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    temperature: jax.Array | float,
    top_p: jax.Array | float,
    *,
    greedy: bool,
    nucleus: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, logprobs [B], entropies [B]).

    The draw inverts the row's cumulative distribution at one uniform number per row (instead
    of adding Gumbel noise to all V logits, which costs V random numbers per row and step: 6x
    slower at V = 152k on CPU); see `inverse_cdf`. Float32 rounding of the cumulative sums can
    shift the odds of a token by about 1e-7 absolute; a token of zero probability (outside the
    nucleus) is never drawn.

    Args:
      logits_bv: [B, V] float32 logits.
      keys_b: [B] typed PRNG keys, one per row.
      temperature: scalar > 0 (ignored when greedy).
      top_p: scalar in (0, 1] (ignored unless `nucleus`).
      greedy: take the argmax; logprobs/entropies then describe softmax(logits).
      nucleus: restrict sampling to the top-p nucleus.
    """
    u_b = None if greedy else jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_b)
    return sample_at(logits_bv, u_b, temperature, top_p, greedy=greedy, nucleus=nucleus)


def sample_at(logits_bv, u_b, temperature, top_p, *, greedy: bool, nucleus: bool):
    """`sample_logits` with each row's uniform number u_b [B] in [0, 1) given (None if greedy).

    One pass of exp over the [B, V] logits serves everything: with z = logits - max and
    w = exp(z), Z = sum(w), the log-probabilities are z - log Z, the entropy is
    log Z - sum(w z) / Z, and the draw inverts the cumulative sum of the unnormalised w.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    scaled_bv = logits_bv if greedy else logits_bv / temperature
    shifted_bv = scaled_bv - jnp.max(scaled_bv, axis=-1, keepdims=True)
    weights_bv = jnp.exp(shifted_bv)
    total_b = jnp.sum(weights_bv, axis=-1)
    log_total_b = jnp.log(total_b)
    # exp(z) = 0 only where z is so negative (or -inf) that w * z is 0 or NaN: counted as 0.
    mean_shift_b = jnp.sum(jnp.where(weights_bv > 0, weights_bv * shifted_bv, 0.0), -1) / total_b
    entropy_b = log_total_b - mean_shift_b
    if greedy:
        tokens_b = jnp.argmax(scaled_bv, axis=-1).astype(jnp.int32)
    else:
        draw_bv = weights_bv
        if nucleus:
            keep_bv = nucleus_mask(weights_bv / total_b[:, None], top_p)
            draw_bv = jnp.where(keep_bv, weights_bv, 0.0)
        tokens_b = inverse_cdf(draw_bv, u_b)
    logprob_b = jnp.take_along_axis(shifted_bv, tokens_b[:, None], axis=-1)[:, 0] - log_total_b
    return tokens_b, logprob_b, entropy_b


def inverse_cdf(weights_bv: jax.Array, u_b: jax.Array) -> jax.Array:
    """Per row, the first token whose cumulative weight exceeds u * (total weight).

    A two-level search instead of a cumulative sum over all V tokens (which XLA's CPU backend
    runs as several slow reduce-window passes): the vocabulary is cut into blocks of about
    sqrt(V) tokens, the block holding the target is found from the blocks' cumulative sums, and
    the token within it from that block's cumulative sum. Both cumulative sums are small
    products with a triangular matrix of ones. Float32 rounding can make cumulative sums
    non-monotone by an ulp, so tokens and blocks of zero weight are excluded explicitly (they
    are never drawn), and a target that rounding puts at or past the total takes the last token
    of positive weight.

    Args:
      weights_bv: [B, V] non-negative float32 weights (unnormalised probabilities), each row
        with some positive weight.
      u_b: [B] uniform numbers in [0, 1).

    Returns:
      [B] int32 token ids.
    """
    b, v = weights_bv.shape
    block = 1 << max(0, math.ceil(math.log2(math.sqrt(v))))
    num_blocks = -(-v // block)
    w_bnk = jnp.pad(weights_bv, ((0, 0), (0, num_blocks * block - v)))
    w_bnk = w_bnk.reshape(b, num_blocks, block)
    block_w_bn = jnp.sum(w_bnk, axis=-1)
    cum_bn = _cumsum_by_matmul(block_w_bn)
    target_b = u_b * cum_bn[:, -1]
    j_b = _first_above(cum_bn, target_b, block_w_bn > 0)
    row_bk = jnp.take_along_axis(w_bnk, j_b[:, None, None], axis=1)[:, 0]
    before_b = jnp.where(
        j_b > 0, jnp.take_along_axis(cum_bn, jnp.maximum(j_b - 1, 0)[:, None], axis=1)[:, 0], 0.0
    )
    i_b = _first_above(_cumsum_by_matmul(row_bk), target_b - before_b, row_bk > 0)
    return (j_b * block + i_b).astype(jnp.int32)


def _cumsum_by_matmul(x_bn: jax.Array) -> jax.Array:
    """Inclusive cumulative sums along the last axis, as one product with triangular ones."""
    idx_n = jnp.arange(x_bn.shape[-1])
    upper_nn = (idx_n[:, None] <= idx_n[None, :]).astype(x_bn.dtype)
    return jnp.dot(x_bn, upper_nn, precision=jax.lax.Precision.HIGHEST)


def _first_above(cum_bn: jax.Array, target_b: jax.Array, allowed_bn: jax.Array) -> jax.Array:
    """First allowed index whose cumulative sum exceeds the target, else the last allowed one."""
    hit_bn = (cum_bn > target_b[:, None]) & allowed_bn
    n = cum_bn.shape[-1]
    last_allowed_b = n - 1 - jnp.argmax(allowed_bn[:, ::-1], axis=-1)
    return jnp.where(jnp.any(hit_bn, axis=-1), jnp.argmax(hit_bn, axis=-1), last_allowed_b)


def row_keys(rng: jax.Array, batch_size: int) -> jax.Array:
    """Per-row typed keys from one key (row b gets fold_in(rng, b)) or from [B] keys as given.

    Accepts typed keys (`jax.random.key`) or raw uint32 keys (`jax.random.PRNGKey`). Traceable.
    """
    rng = typed_key(rng)
    if rng.shape == ():
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(batch_size))
    if rng.shape == (batch_size,):
        return rng
    raise ValueError(
        f"rng must be one key or {batch_size} keys (one per row), got key shape {rng.shape}."
    )


def uniform_at(key: jax.Array, position: jax.Array) -> jax.Array:
    """The uniform number in [0, 1) that a row with `key` draws its token at `position` with."""
    return jax.random.uniform(jax.random.fold_in(key, position), (), jnp.float32)


def typed_key(rng) -> jax.Array:
    """`rng` as a typed key array (raw uint32 keys from `jax.random.PRNGKey` are wrapped)."""
    rng = rng if isinstance(rng, jax.Array) else jnp.asarray(rng)
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    return rng
