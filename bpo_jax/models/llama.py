"""A Flax NNX decoder of the Llama / Qwen2 / Qwen3 family, with a KV cache for sampling.

One module covers the three families: RMSNorm, rotary embeddings (with Llama-3.1's frequency
scaling), grouped-query attention, SwiGLU MLP, optional q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3) and tied or untied embeddings. Parameter names follow Hugging Face's, except
for two fused weights that save a matmul each (one skinny kernel call per token when decoding):
`qkv_proj` holds the q, k and v projections, `gate_up_proj` the gate and up projections
(`hf_import` splits and joins them).
Every parameter carries `logical_axes` metadata; `bpo_jax.models.sharding` turns those into mesh
shardings.

The KV cache is `bpo_jax.models.kv_cache`, rotary embeddings `bpo_jax.models.rope` (both
re-exported here).

Shape suffixes: B batch, T new tokens, S cache length, D model width, H query heads,
K key/value heads, G = H / K query heads per KV head, E head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bpo_jax.models import lora
from bpo_jax.models.config import ModelConfig
from bpo_jax.models.kv_cache import _KEY_AXES, _Q_AXES, _VALUE_AXES, KVCache, cache_axes, init_cache  # noqa: F401  (re-exported)
from bpo_jax.models.layers import MLP, RMSNorm, param
from bpo_jax.models.layers import stationary_layout as _stationary
from bpo_jax.models.rope import apply_rope, rope_frequencies
from bpo_jax.models.sharding import constrain

_NEG_INF = -0.7 * float(np.finfo(np.float32).max)
# Causal attention without a cache runs over query blocks (see `_causal_blocks`). 64 was the
# fastest of 32 / 64 / 128 for a tiny() train step at T = 255 on CPU.
_MIN_QUERY_BLOCK = 64
_MAX_QUERY_BLOCKS = 8
# Without a cache, keys are padded (and masked) to a multiple of this many positions. The CPU
# matmul kernels round differently for a ragged tail of key columns, so without the padding
# the block-causal and the fully masked paths disagreed by up to 2e-5 in the logits of a
# sharpened tiny() model; with it they agree exactly.
_KEY_ALIGN = 64

# Rematerialisation of each decoder layer in a training forward pass (`Transformer(remat=)`),
# by the name of its `jax.checkpoint_policies` policy: what the backward pass keeps of a layer
# rather than recomputes. "none" keeps everything (no `jax.checkpoint`); "full" keeps only the
# layer's input (`nothing_saveable`): a 7B layer stack then holds one [B, T, D] residual per
# layer, and recomputes a layer's forward pass in its backward one.
REMAT_POLICIES = {
    "none": None,
    "full": "nothing_saveable",
    "dots_saveable": "dots_saveable",
    "dots_with_no_batch_dims_saveable": "dots_with_no_batch_dims_saveable",
}


# ----------------------------------------------------------------------------- modules


class Attention(nnx.Module):
    """Grouped-query self-attention with one fused q/k/v projection.

    The projection is stored as [D, K, G + 2, E]: for each KV head k, slots 0..G-1 are its G
    query heads (query head h = k * G + g, the reference implementations' order), slot G its
    key and slot G + 1 its value. One matmul then produces all three (a decode step runs one
    skinny [B, D] x [D, (H + 2K) E] product instead of three), and sharding the KV-head axis
    over `tensor` keeps each device's queries, keys and values together, so splitting them
    needs no communication.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = cfg.param_dtype
        self.cfg = cfg
        qkv_axes = ("embed", "kv_heads", None, "head_dim")
        qkv_parts = (2, [(d, h, e), (d, k, e), (d, k, e)])
        self.qkv_proj = param(rngs, (d, k, h // k + 2, e), qkv_axes, pd, fused=qkv_parts)
        self.o_proj = param(rngs, (h, e, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.qkv_bias = param(rngs, (k, h // k + 2, e), qkv_axes[1:], pd, init="zeros")
        if cfg.qk_norm:  # Qwen3: each query and key head RMS-normalised over E, before RoPE.
            self.q_norm = RMSNorm(e, cfg.rms_norm_eps, cfg, rngs, axis="head_dim")
            self.k_norm = RMSNorm(e, cfg.rms_norm_eps, cfg, rngs, axis="head_dim")

    def __call__(
        self,
        x_btd,
        positions_bt,
        k_cache_bkes=None,
        v_cache_bkse=None,
        *,
        in_order=False,
        stationary=False,
        offset_bound=None,
    ):
        """Self-attention of T new tokens, over themselves or over a cache they are written to.

        Head-major layouts: queries [B, K, G, T, E], keys [B, K, E, S], values [B, K, S, E]. Both
        attention contractions are then per-(row, KV head) matrix products whose operands are
        already in the (rows, contracted) x (contracted, columns) order the CPU matmul kernels
        take, so XLA neither transposes nor repacks the cache; only the small per-token tensors
        change layout. Keys are stored transposed for that reason: in the tiny() decode loop
        the q @ keys product took 210 us per layer instead of 340 us with [B, K, S, E] keys.

        Args:
          x_btd: [B, T, D] normalised inputs.
          positions_bt: [B, T] absolute positions of the new tokens (also their cache slots).
          k_cache_bkes: optional [B, K, E, S] key cache of this layer.
          v_cache_bkse: optional [B, K, S, E] value cache of this layer.
          in_order: without a cache, promises that positions_bt is 0..T-1 in every row, so that
            query block [i, j) attends to keys [0, j) only (`_causal_blocks`).
          stationary: keep the weights where they are stored (`_stationary`): for decode steps.
          offset_bound: with a cache, a static bound on every row's cached length before these
            tokens: query block [i, j) then attends to the first offset_bound + j cache slots
            only (the others are after every query in it), not to the whole cache.

        Returns:
          (output [B, T, D], updated keys, updated values); the cache outputs are None without
          a cache.
        """
        cfg = self.cfg
        dt = cfg.dtype
        b, t, _ = x_btd.shape
        kh, e = cfg.num_kv_heads, cfg.resolved_head_dim
        g = cfg.num_heads // kh
        x_btd = _stationary(x_btd, "embed", stationary)
        qkv = jnp.einsum("btd,dkje->btkje", x_btd, self.qkv_proj[...].astype(dt))
        if lora.has_adapters(self, "qkv"):
            qkv = qkv + lora.qkv_delta(self, x_btd, dt, g)
        if stationary:
            qkv = constrain(qkv, ("batch", "length", "kv_heads", None, None))
        if cfg.qkv_bias:
            qkv = qkv + self.qkv_bias[...].astype(dt)
        # A trace-time constant, not an attribute: NNX would put an array attribute into the
        # model's state (as a bare leaf), where eval_shape turns it into a ShapeDtypeStruct.
        inv_freq = rope_frequencies(cfg)
        # The 1 / sqrt(E) of the logits goes on the queries: E / S times fewer elements than
        # the [.., T, S] logits, one full pass over which it saves (two with gradients).
        q_btkge, k_btke = qkv[:, :, :, :g], qkv[:, :, :, g]
        if cfg.qk_norm:
            q_btkge, k_btke = self.q_norm(q_btkge), self.k_norm(k_btke)
        q = apply_rope(q_btkge, positions_bt, inv_freq, scale=1 / math.sqrt(e))
        q = constrain(q.transpose(0, 2, 3, 1, 4), _Q_AXES)  # [B, K, G, T, E]
        k_btke = apply_rope(k_btke, positions_bt, inv_freq)
        v_btke = qkv[:, :, :, g + 1]

        if k_cache_bkes is None:
            keys = k_btke.transpose(0, 2, 3, 1)
            values = v_btke.transpose(0, 2, 1, 3)
            key_pos_bs = positions_bt
            pad = -t % _KEY_ALIGN
            if pad:
                keys = jnp.pad(keys, ((0, 0), (0, 0), (0, 0), (0, pad)))
                values = jnp.pad(values, ((0, 0), (0, 0), (0, pad), (0, 0)))
                never = jnp.full((b, pad), jnp.iinfo(jnp.int32).max, jnp.int32)
                key_pos_bs = jnp.concatenate([key_pos_bs, never], axis=1)
            keys, values = constrain(keys, _KEY_AXES), constrain(values, _VALUE_AXES)
        else:
            # Slot s of row b receives the token at position s. Positions past the cache's end
            # belong to padding tokens; mode="drop" discards them. (With the two slices between
            # the index arrays, the indexed dimensions come first: updates are [B, T, K, E].)
            b_idx_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
            keys = k_cache_bkes.at[b_idx_bt, :, :, positions_bt].set(
                k_btke.astype(k_cache_bkes.dtype), mode="drop"
            )
            values = v_cache_bkse.at[b_idx_bt, :, positions_bt].set(
                v_btke.astype(v_cache_bkse.dtype), mode="drop"
            )
            keys, values = constrain(keys, _KEY_AXES), constrain(values, _VALUE_AXES)
            s = values.shape[2]
            key_pos_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))

        # Causal by absolute position: a query sees keys at positions <= its own. Entries of the
        # cache beyond a row's length are never at a position <= a valid query's position.
        mask_bts = key_pos_bs[:, None, :] <= positions_bt[:, :, None]
        keys, values = keys.astype(dt), values.astype(dt)
        # A static bound on the context cached before the new tokens (0: none), where known.
        offset = (0 if in_order else None) if k_cache_bkes is None else offset_bound
        if offset is not None:
            # Keys after a query block are all masked: skip them rather than compute and mask
            # them. With 4 blocks that is 3/8 of the [T, T] work, 10-15% of a tiny() BC step
            # (16 x 256 tokens) on CPU. In a prefill after cached context the block's keys are
            # the context (up to `offset_bound`) and the new tokens up to the block's end.
            out = jnp.concatenate(
                [
                    _attend(q[:, :, :, i:j], keys[..., :s], values[:, :, :s], mask_bts[:, i:j, :s])
                    for i, j in _causal_blocks(t)
                    for s in [min(-(-(offset + j) // _KEY_ALIGN) * _KEY_ALIGN, keys.shape[-1])]
                ],
                axis=3,
            )
        else:
            out = _attend(q, keys, values, mask_bts)
        # [B, K, G, T, E] -> [B, T, H * E] (h = k * G + g): one plain [B T, H E] x [H E, D]
        # matmul, with the weight read as stored.
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g * e)
        out = _stationary(out, "heads", stationary)
        o_proj = self.o_proj[...].astype(dt).reshape(kh * g * e, -1)
        out_btd = jnp.einsum("btf,fd->btd", out, o_proj)
        if lora.has_adapters(self, ("o",)):
            out_btd = out_btd + lora.delta(self, "o", out, dt)
        out = out_btd
        if k_cache_bkes is None:
            return out, None, None
        return out, keys, values


def _attend(q_bkgte, keys_bkes, values_bkse, mask_bts) -> jax.Array:
    """Masked softmax attention [B, K, G, T, E] of (pre-scaled) queries over keys and values.

    The softmax is normalised after the value product: dividing the [.., E] outputs rather
    than the [.., S] probabilities is S / E times less work and one pass less over them.
    """
    logits = jnp.einsum("bkgte,bkes->bkgts", q_bkgte, keys_bkes, preferred_element_type=jnp.float32)
    # A select, not an added bias: XLA computes the mask inside the select from the positions,
    # where an added [B, T, S] bias would be materialised (5 MB for a 16 x 256 prefill) and
    # read by every layer; that made the prefill 40% slower on CPU.
    logits = jnp.where(mask_bts[:, None, None], logits, _NEG_INF)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bkgts,bkse->bkgte",
        weights.astype(q_bkgte.dtype),
        values_bkse,
        preferred_element_type=jnp.float32,
    )
    return (out / total).astype(q_bkgte.dtype)


def _causal_blocks(t: int) -> list[tuple[int, int]]:
    """Splits T queries into at most _MAX_QUERY_BLOCKS blocks [i, j) of >= _MIN_QUERY_BLOCK.

    Smaller blocks skip more of the masked upper triangle but run more, smaller kernels; the
    cap keeps the traced program small for long sequences.
    """
    block = max(_MIN_QUERY_BLOCK, -(-t // _MAX_QUERY_BLOCKS))
    return [(i, min(i + block, t)) for i in range(0, t, block)]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(
        self,
        x_btd,
        positions_bt,
        k_cache=None,
        v_cache=None,
        *,
        in_order=False,
        stationary=False,
        offset_bound=None,
    ):
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x_btd),
            positions_bt,
            k_cache,
            v_cache,
            in_order=in_order,
            stationary=stationary,
            offset_bound=offset_bound,
        )
        x_btd = constrain(x_btd + attn, ("batch", "length", "embed"))
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd), stationary=stationary)
        return constrain(x_btd, ("batch", "length", "embed")), k_cache, v_cache


class Transformer(nnx.Module):
    """Decoder-only language model.

    Call with `tokens_bt` alone for a causal forward pass over right-padded sequences (training,
    scoring), or with a `KVCache` to append `tokens_bt` to each row's cached context (prefill,
    decode, multi-turn appends).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = param(
            rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(
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
        remat: str = "none",
        scan_layers: bool = False,
        offset_bound: int | None = None,
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
          remat: without a cache, the layers' rematerialisation policy (`REMAT_POLICIES`).
          scan_layers: without a cache, run the layers as one `lax.scan` over their stacked
            parameters (`_scan_layers`): XLA compiles one layer instead of all of them.
          offset_bound: with a cache, a static int >= every row's cache length before this
            call (a prefill's caller knows it): attention then skips the cache slots after each
            query block (`Attention`). None attends over the whole cache.

        Returns:
          (logits [B, T, V] float32, new cache or None[, hidden [B, T, D]]).
        """
        cfg = self.cfg
        b, t = tokens_bt.shape
        in_order = cache is None and positions_bt is None
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
        if remat not in REMAT_POLICIES:
            raise ValueError(f"Unknown remat policy {remat!r}; known: {sorted(REMAT_POLICIES)}.")
        policy = REMAT_POLICIES[remat]
        # One new token per row: a decode step, which reads every weight for a few rows.
        stationary = cache is not None and t == 1
        if cache is None and policy is not None:

            def forward(layer, x_btd, pos_bt):
                return layer(x_btd, pos_bt, in_order=in_order)[0]

            forward = nnx.remat(forward, policy=getattr(jax.checkpoint_policies, policy))
        new_k, new_v = [], []
        if cache is None and scan_layers:
            x = _scan_layers(self.layers, x, positions_bt, in_order=in_order, policy=policy)
        else:
            for i, layer in enumerate(self.layers):
                if cache is None and policy is not None:
                    x = forward(layer, x, positions_bt)
                elif cache is None:
                    x, _, _ = layer(x, positions_bt, in_order=in_order)
                else:
                    x, k_i, v_i = layer(
                        x,
                        positions_bt,
                        cache.k[i],
                        cache.v[i],
                        stationary=stationary,
                        offset_bound=offset_bound,
                    )
                    new_k.append(k_i)
                    new_v.append(v_i)
        hidden = self.norm(x)
        logits = self.logits(hidden, stationary=stationary)

        new_cache = None
        if cache is not None:
            num_new_b = jnp.full((b,), t, jnp.int32) if num_new_b is None else num_new_b
            new_cache = KVCache(
                k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + num_new_b.astype(jnp.int32)
            )
        if return_hidden:
            return logits, new_cache, hidden
        return logits, new_cache

    def head_weight(self) -> jax.Array:
        """The LM head's [D, V] weight in the compute dtype (the embedding's transpose if tied)."""
        head_dv = self.embed_tokens[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head_dv.astype(self.cfg.dtype)

    def logits(self, hidden_btd: jax.Array, *, stationary: bool = False) -> jax.Array:
        """The LM head: final-norm hidden states [B, T, D] -> float32 logits [B, T, V]."""
        hidden_btd = _stationary(hidden_btd, "embed", stationary)
        logits_btv = jnp.einsum(
            "btd,dv->btv", hidden_btd, self.head_weight(), preferred_element_type=jnp.float32
        )
        return constrain(logits_btv, ("batch", "length", "vocab"))


def _scan_layers(layers, x_btd, positions_bt, *, in_order: bool, policy: str | None):
    """The decoder layers as one `lax.scan` over their parameters stacked along a new axis.

    The parameters stay stored per layer (checkpoints and the sampler see no difference); the
    stacking is a copy inside the program (one more copy of the layers' parameters, sharded as
    they are), and its transpose hands each layer its own gradient.
    """
    graphdef = nnx.graphdef(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])

    def body(x, state):
        layer = nnx.merge(graphdef, state)
        return layer(x, positions_bt, in_order=in_order)[0], None

    if policy is not None:
        body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, policy))
    x_btd, _ = jax.lax.scan(body, x_btd, stacked)
    return x_btd


def count_params(tree) -> int:
    """Total number of parameter elements in a (possibly abstract) pytree."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
