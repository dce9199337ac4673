"""A Flax NNX decoder of the Llama / Qwen2 family, with a KV cache for sampling.

One module covers both families: RMSNorm, rotary embeddings (with Llama-3.1's frequency
scaling), grouped-query attention, SwiGLU MLP, optional q/k/v biases (Qwen2) and tied or untied
embeddings. Parameter names follow Hugging Face's so that checkpoint import is a transpose and a
reshape per tensor. Every parameter carries `logical_axes` metadata; `bpo_jax.models.sharding`
turns those into mesh shardings.

Shape suffixes: B batch, T new tokens, S cache length, D model width, H query heads,
K key/value heads, G = H / K query heads per KV head, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bpo_jax.models.config import ModelConfig
from bpo_jax.models.sharding import constrain

_NEG_INF = -0.7 * float(np.finfo(np.float32).max)
# Logical axes of head-major queries [B, K, G, T, E] and keys / values [B, K, S|T, E].
_Q_AXES = ("batch", "kv_heads", None, "length", None)
_KV_AXES = ("batch", "kv_heads", "length", None)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"Unknown initialiser {init!r}.")
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


# ----------------------------------------------------------------------------- KV cache


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for a batch of sequences.

    Row b holds `lengths[b]` valid positions; new tokens of row b are written from position
    `lengths[b]` on, so rows of a batch may be at different lengths (multi-turn appends).

    One buffer per layer, not one stacked [L, ...] array: a call of `Transformer` then replaces
    each layer's buffer by its updated version, which XLA does in place (stacking the layers
    back into one array copied the whole cache on every decode step). Within a layer the layout
    is head-major, [B, K, S, E], so that attention contracts each (row, head)'s contiguous
    [S, E] block without XLA first transposing the cache.

    Attributes:
      k: L keys [B, K, S, E], one per layer.
      v: L values [B, K, S, E], one per layer.
      lengths: [B] int32, number of valid positions per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def take(self, rows: jax.Array) -> KVCache:
        """Gathers (and so may duplicate) rows: row i of the result is row `rows[i]` of self."""
        rows = jnp.asarray(rows, jnp.int32)
        return KVCache(
            k=tuple(jnp.take(k, rows, axis=0) for k in self.k),
            v=tuple(jnp.take(v, rows, axis=0) for v in self.v),
            lengths=jnp.take(self.lengths, rows, axis=0),
        )

    @staticmethod
    def concatenate(caches: Sequence[KVCache]) -> KVCache:
        """Stacks the rows of caches of equal capacity and depth into one batch, in order."""
        shapes = {(c.num_layers, c.capacity) for c in caches}
        if len(shapes) != 1:
            raise ValueError(
                "Cannot concatenate caches of different (layers, capacity) "
                f"{sorted(shapes)}; allocate them with the same init_cache(..., capacity=...)."
            )
        layers = range(caches[0].num_layers)
        return KVCache(
            k=tuple(jnp.concatenate([c.k[i] for c in caches]) for i in layers),
            v=tuple(jnp.concatenate([c.v[i] for c in caches]) for i in layers),
            lengths=jnp.concatenate([c.lengths for c in caches]),
        )


def init_cache(
    cfg: ModelConfig, batch_size: int, capacity: int | None = None, dtype=None
) -> KVCache:
    """An empty cache for `batch_size` rows of up to `capacity` (default max_seq_len) positions."""
    capacity = cfg.max_seq_len if capacity is None else capacity
    shape = (batch_size, cfg.num_kv_heads, capacity, cfg.resolved_head_dim)
    dtype = cfg.dtype if dtype is None else dtype
    # Distinct buffers per layer (not one array repeated), so each can be donated and updated.
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


# ----------------------------------------------------------------------------- RoPE


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [E/2] of the rotary embedding, with Llama-3.1 scaling if configured."""
    dim = cfg.resolved_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept, and
    # the band in between interpolated smoothly (Llama 3.1 paper, "rope_type": "llama3").
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_bnte: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates pairs (i, i + E/2) of x by position * frequency (the rotate-half convention).

    Args:
      x_bnte: [B, ..., T, E] head-major queries or keys (any number of head axes).
      positions_bt: [B, T] absolute positions.
      inv_freq: [E/2] inverse frequencies (`rope_frequencies`).
    """
    b, t = positions_bt.shape
    angles_bte = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    angles = angles_bte.reshape((b,) + (1,) * (x_bnte.ndim - 3) + (t, angles_bte.shape[-1]))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_bnte.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bnte.dtype)


# ----------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = eps
        self.dtype = cfg.dtype
        self.weight = _param(rngs, (dim,), ("embed",), cfg.param_dtype, init="ones")

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Like the reference implementations: normalise in float32, cast, then scale.
        return normed.astype(self.dtype) * self.weight[...].astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = cfg.param_dtype
        self.cfg = cfg
        self.q_proj = _param(rngs, (d, h, e), ("embed", "heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (d, k, e), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (h, e, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (h, e), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (k, e), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (k, e), ("kv_heads", "head_dim"), pd, init="zeros")

    def __call__(self, x_btd, positions_bt, k_cache_bkse=None, v_cache_bkse=None):
        """Self-attention of T new tokens, over themselves or over a cache they are written to.

        Everything is head-major ([B, K, G, T, E] queries, [B, K, S, E] keys and values): the
        two attention contractions then batch over (B, K) with each operand's contracted
        dimensions contiguous, which on CPU is several times faster than a [B, S, K, E] layout
        that XLA transposes first. Only the small per-token tensors change layout.

        Args:
          x_btd: [B, T, D] normalised inputs.
          positions_bt: [B, T] absolute positions of the new tokens (also their cache slots).
          k_cache_bkse, v_cache_bkse: optional [B, K, S, E] cache buffers of this layer.

        Returns:
          (output [B, T, D], updated keys, updated values); the cache outputs are None without
          a cache.
        """
        cfg = self.cfg
        dt = cfg.dtype
        b, t, d = x_btd.shape
        kh, e = cfg.num_kv_heads, cfg.resolved_head_dim
        g = cfg.num_heads // kh
        # Query head h = k * G + g serves KV head k, as in the reference implementations.
        q_proj_dkge = self.q_proj[...].astype(dt).reshape(d, kh, g, e)
        q = jnp.einsum("btd,dkge->bkgte", x_btd, q_proj_dkge)
        k = jnp.einsum("btd,dke->bkte", x_btd, self.k_proj[...].astype(dt))
        v = jnp.einsum("btd,dke->bkte", x_btd, self.v_proj[...].astype(dt))
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt).reshape(kh, g, 1, e)
            k = k + self.k_bias[...].astype(dt)[:, None]
            v = v + self.v_bias[...].astype(dt)[:, None]
        # A trace-time constant, not an attribute: NNX would put an array attribute into the
        # model's state (as a bare leaf), where eval_shape turns it into a ShapeDtypeStruct.
        inv_freq = rope_frequencies(cfg)
        q = constrain(apply_rope(q, positions_bt, inv_freq), _Q_AXES)
        k = constrain(apply_rope(k, positions_bt, inv_freq), _KV_AXES)
        v = constrain(v, _KV_AXES)

        if k_cache_bkse is None:
            keys, values = k, v
            key_pos_bs = positions_bt
        else:
            # Slot (b, s) of the cache receives the token at position s. Positions past the
            # cache's end belong to padding tokens; mode="drop" discards them.
            b_idx_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
            keys = k_cache_bkse.at[b_idx_bt, :, positions_bt].set(
                k.transpose(0, 2, 1, 3).astype(k_cache_bkse.dtype), mode="drop"
            )
            values = v_cache_bkse.at[b_idx_bt, :, positions_bt].set(
                v.transpose(0, 2, 1, 3).astype(v_cache_bkse.dtype), mode="drop"
            )
            keys, values = constrain(keys, _KV_AXES), constrain(values, _KV_AXES)
            s = keys.shape[2]
            key_pos_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))

        logits = jnp.einsum(
            "bkgte,bkse->bkgts", q, keys.astype(dt), preferred_element_type=jnp.float32
        ) / math.sqrt(e)
        # Causal by absolute position: a query sees keys at positions <= its own. Entries of the
        # cache beyond a row's length are never at a position <= a valid query's position.
        mask_bts = key_pos_bs[:, None, :] <= positions_bt[:, :, None]
        logits = jnp.where(mask_bts[:, None, None], logits, _NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bkse->bkgte", probs, values.astype(dt))
        o_proj_kged = self.o_proj[...].astype(dt).reshape(kh, g, e, d)
        out = jnp.einsum("bkgte,kged->btd", out, o_proj_kged)
        if k_cache_bkse is None:
            return out, None, None
        return out, keys, values


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.dtype = cfg.dtype
        self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd)

    def __call__(self, x_btd):
        dt = self.dtype
        gate = jnp.einsum("btd,df->btf", x_btd, self.gate_proj[...].astype(dt))
        up = jnp.einsum("btd,df->btf", x_btd, self.up_proj[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return jnp.einsum("btf,fd->btd", hidden, self.down_proj[...].astype(dt))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_btd, positions_bt, k_cache=None, v_cache=None):
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x_btd), positions_bt, k_cache, v_cache
        )
        x_btd = constrain(x_btd + attn, ("batch", "length", "embed"))
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd))
        return constrain(x_btd, ("batch", "length", "embed")), k_cache, v_cache


class Transformer(nnx.Module):
    """Decoder-only language model.

    Call with `tokens_bt` alone for a causal forward pass over right-padded sequences (training,
    scoring), or with a `KVCache` to append `tokens_bt` to each row's cached context (prefill,
    decode, multi-turn appends).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = _param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype
            )

    def __call__(
        self,
        tokens_bt: jax.Array,
        *,
        positions_bt: jax.Array | None = None,
        cache: KVCache | None = None,
        num_new_b: jax.Array | None = None,
        return_hidden: bool = False,
    ):
        """Runs the decoder.

        Args:
          tokens_bt: int32 [B, T] token ids (right-padded where rows differ in length).
          positions_bt: absolute positions; defaults to 0..T-1, or to the rows' cache lengths
            onward when a cache is given (positions must not be passed with a cache).
          cache: optional KV cache of batch B; the T tokens are written after each row's context.
          num_new_b: int32 [B], how many of the T tokens of each row are real (the rest are padding
            and are not counted into the cache's lengths). Defaults to T.
          return_hidden: also return the final hidden states [B, T, D] (for value heads).

        Returns:
          (logits [B, T, V] float32, new cache or None[, hidden [B, T, D]]).
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        if cache is not None:
            if cache.num_layers != cfg.num_layers or cache.batch_size != b:
                raise ValueError(
                    f"The cache holds {cache.num_layers} layers of {cache.batch_size} rows, but "
                    f"the model has {cfg.num_layers} layers and the tokens {b} rows; make it "
                    "with init_cache(cfg, batch_size, ...)."
                )
            if positions_bt is not None:
                raise ValueError("positions_bt is derived from the cache; do not pass both.")
            positions_bt = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        elif positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))

        emb = self.embed_tokens[...]
        x = constrain(
            jnp.take(emb, tokens_bt, axis=0).astype(cfg.dtype), ("batch", "length", "embed")
        )
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x, _, _ = layer(x, positions_bt)
            else:
                x, k_i, v_i = layer(x, positions_bt, cache.k[i], cache.v[i])
                new_k.append(k_i)
                new_v.append(v_i)
        hidden = self.norm(x)
        logits = self.logits(hidden)

        new_cache = None
        if cache is not None:
            num_new_b = jnp.full((b,), t, jnp.int32) if num_new_b is None else num_new_b
            new_cache = KVCache(
                k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new_b.astype(jnp.int32)
            )
        if return_hidden:
            return logits, new_cache, hidden
        return logits, new_cache

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """The LM head: final-norm hidden states [B, T, D] -> float32 logits [B, T, V]."""
        dt = self.cfg.dtype
        head_dv = self.embed_tokens[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        logits_btv = jnp.einsum(
            "btd,dv->btv", hidden_btd, head_dv.astype(dt), preferred_element_type=jnp.float32
        )
        return constrain(logits_btv, ("batch", "length", "vocab"))


def count_params(tree) -> int:
    """Total number of parameter elements in a (possibly abstract) pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
