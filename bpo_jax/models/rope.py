"""Rotary position embeddings, with Llama-3.1's frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.models.config import ModelConfig


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


def apply_rope(
    x_bte: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> jax.Array:
    """Rotates pairs (i, i + E/2) of x by position * frequency (the rotate-half convention).

    Args:
      x_bte: [B, T, ..., E] queries or keys (any number of head axes between T and E).
      positions_bt: [B, T] absolute positions.
      inv_freq: [E/2] inverse frequencies (`rope_frequencies`).
      scale: multiplies the result (in float32, before casting back to x's dtype).
    """
    b, t = positions_bt.shape
    angles_bte = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    angles = angles_bte.reshape((b, t) + (1,) * (x_bte.ndim - 3) + (angles_bte.shape[-1],))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_bte.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if scale != 1.0:
        out = out * scale
    return out.astype(x_bte.dtype)
