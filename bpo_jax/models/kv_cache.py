"""The decoder's KV cache: one head-major key and value buffer per layer, and its shardings.

Shape suffixes as in `bpo_jax.models.llama`.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from bpo_jax.models.config import ModelConfig
from bpo_jax.models.sharding import named_sharding

# Logical axes of the head-major queries [B, K, G, T, E], keys [B, K, E, S] and values
# [B, K, S, E] of attention (and of the cache).
_Q_AXES = ("batch", "kv_heads", None, "length", None)
_KEY_AXES = ("batch", "kv_heads", None, "length")
_VALUE_AXES = ("batch", "kv_heads", "length", None)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for a batch of sequences.

    Row b holds `lengths[b]` valid positions; new tokens of row b are written from position
    `lengths[b]` on, so rows of a batch may be at different lengths (multi-turn appends).

    One buffer per layer, not one stacked [L, ...] array: a call of `Transformer` then replaces
    each layer's buffer by its updated version, which XLA does in place (stacking the layers
    back into one array copied the whole cache on every decode step). Within a layer the layout
    is head-major, keys transposed ([B, K, E, S]) and values not ([B, K, S, E]): each is then
    the right-hand operand of its attention product exactly as the CPU matmul kernels read it
    (see `Attention`), so XLA never transposes or repacks the cache.

    Attributes:
      k: L keys [B, K, E, S], one per layer.
      v: L values [B, K, S, E], one per layer.
      lengths: [B] int32, number of valid positions per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

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
        if not caches:
            raise ValueError("KVCache.concatenate needs at least one cache.")
        shapes = {(c.num_layers, c.capacity) for c in caches}
        if len(shapes) != 1:
            raise ValueError(
                "Cannot concatenate caches of different capacities or layer counts "
                f"{sorted(shapes)} (layers, capacity); allocate them with the same "
                "init_cache(cfg, ..., capacity=...)."
            )
        layers = range(caches[0].num_layers)
        return KVCache(
            k=tuple(jnp.concatenate([c.k[i] for c in caches]) for i in layers),
            v=tuple(jnp.concatenate([c.v[i] for c in caches]) for i in layers),
            lengths=jnp.concatenate([c.lengths for c in caches]),
        )


def cache_axes() -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axes of one layer's (keys [B, K, E, S], values [B, K, S, E]) cache buffers."""
    return _KEY_AXES, _VALUE_AXES


def init_cache(
    cfg: ModelConfig,
    batch_size: int,
    capacity: int | None = None,
    dtype=None,
    *,
    mesh: Mesh | None = None,
) -> KVCache:
    """An empty cache for `batch_size` rows of up to `capacity` (default max_seq_len) positions.

    With a `mesh`, rows are split over the mesh axes of the logical "batch" axis (those that
    divide `batch_size`) and KV heads over those of "kv_heads", as the model's activations are;
    `Sampler` then decodes each data-parallel replica's rows on their own.
    """
    capacity = cfg.max_seq_len if capacity is None else capacity
    k_shape = (batch_size, cfg.num_kv_heads, cfg.resolved_head_dim, capacity)
    v_shape = (batch_size, cfg.num_kv_heads, capacity, cfg.resolved_head_dim)
    dtype = cfg.dtype if dtype is None else dtype

    def zeros(shape, axes, dtype):
        where = None if mesh is None else named_sharding(mesh, axes, shape)
        return jnp.zeros(shape, dtype, device=where)

    # Distinct buffers per layer (not one array repeated), so each can be donated and updated.
    return KVCache(
        k=tuple(zeros(k_shape, _KEY_AXES, dtype) for _ in range(cfg.num_layers)),
        v=tuple(zeros(v_shape, _VALUE_AXES, dtype) for _ in range(cfg.num_layers)),
        lengths=zeros((batch_size,), ("batch",), jnp.int32),
    )
