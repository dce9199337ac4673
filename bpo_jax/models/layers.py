"""The decoder's building blocks besides attention: parameters with logical axes, RMSNorm, the
SwiGLU MLP, and the decode-step layout helper `stationary_layout`.

Shape suffixes as in `bpo_jax.models.llama`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from bpo_jax.models import lora
from bpo_jax.models.config import ModelConfig
from bpo_jax.models.sharding import constrain


def param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal", fused=None) -> nnx.Param:
    """A parameter with `logical_axes` metadata.

    Args:
      fused: for a "normal" parameter made of several, (axis, [unfused shapes]): each part is
        drawn as its own matrix, reshaped to `shape` but for `axis`, and the parts are joined
        along `axis`. A seed then gives the same values as the unfused parameters would.
    """
    if init == "normal" and fused is not None:
        axis, part_shapes = fused
        part_shape = tuple(shape[:axis]) + (-1,) + tuple(shape[axis + 1 :])
        draws = [jax.random.normal(rngs.params(), p, jnp.float32) for p in part_shapes]
        value = 0.02 * jnp.concatenate([d.reshape(part_shape) for d in draws], axis=axis)
    elif init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"Unknown initialiser {init!r}.")
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, cfg: ModelConfig, rngs: nnx.Rngs, axis="embed"):
        self.eps = eps
        self.dtype = cfg.dtype
        self.weight = param(rngs, (dim,), (axis,), cfg.param_dtype, init="ones")

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # Like the reference implementations: normalise in float32, cast, then scale.
        return normed.astype(self.dtype) * self.weight[...].astype(self.dtype)


def stationary_layout(x: jax.Array, axis: str, on: bool) -> jax.Array:
    """In a decode step, lays the activation out like the weight it is multiplied with.

    A decode step multiplies a few rows by every weight. Under FSDP the rows are split over
    `fsdp` and the weights' input dimension too; left alone, XLA gathers each weight, and since
    the gathered weights are the same in every step of the decode loop it hoists the gathers
    out of the loop: the whole model then sits gathered on every chip (33 GiB per chip for
    Qwen2.5-7B in float32). Instead the rows are replicated and their last dimension split like
    the weight's contracted one (`axis`): each chip multiplies its slice of the weight and a
    reduction over the small [B, ...] result combines them; no weight moves.
    """
    if not on:
        return x
    return constrain(x, (None,) * (x.ndim - 1) + (axis,))


class MLP(nnx.Module):
    """SwiGLU with the gate and up projections stored as one [D, 2, F] weight (one matmul)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.dtype = cfg.dtype
        gate_up_parts = (1, [(d, f), (d, f)])
        self.gate_up_proj = param(rngs, (d, 2, f), ("embed", None, "mlp"), pd, fused=gate_up_parts)
        self.down_proj = param(rngs, (f, d), ("mlp", "embed"), pd)

    def __call__(self, x_btd, *, stationary=False):
        dt = self.dtype
        x_btd = stationary_layout(x_btd, "embed", stationary)
        gate_up = jnp.einsum("btd,djf->btjf", x_btd, self.gate_up_proj[...].astype(dt))
        if lora.has_adapters(self, ("gate", "up")):
            gate_up = gate_up + lora.stacked_delta(self, ("gate", "up"), x_btd, dt, axis=2)
        hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
        if stationary:
            hidden = stationary_layout(hidden, "mlp", stationary)
        else:
            hidden = constrain(hidden, ("batch", "length", "mlp"))
        out = jnp.einsum("btf,fd->btd", hidden, self.down_proj[...].astype(dt))
        if lora.has_adapters(self, ("down",)):
            out = out + lora.delta(self, "down", hidden, dt)
        return out
