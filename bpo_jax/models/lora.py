"""Low-rank adapters (LoRA) on the decoder's projections, over a frozen base.

`apply_lora(model, LoraConfig(rank, alpha, targets))` gives each decoder layer's targeted
projections (`TARGETS`: q, k, v, o and the MLP's gate, up, down) a pair of `nnx.LoRAParam`s,
`<target>_lora_a` [in, r] and `<target>_lora_b` [r, out], and the projection's output gains
`(x @ A) @ B * alpha / r`. A is drawn uniform in +-1/sqrt(in), B starts at zero: a fresh
adapter leaves the model unchanged. The adapters carry `logical_axes` like every parameter
(the rank axis unsplit, the others as their weight's), so one rules table shards them with the
base; they are stored in their own dtype (float32 by default) while the base stays in the
compute dtype. `split_adapters` separates them from the base (the learner trains only them,
`bpo_jax.learner.step`), and zeroing them turns the model back into its base (the KL
reference, without a second copy of the weights).

Why not `qwix.apply_lora_to_model` (what Tunix uses; qwix 0.1.8 was tried on this model):
  - q, k and v are one fused `qkv_proj` [D, K, G + 2, E] (and gate and up one `gate_up_proj`),
    so qwix's per-einsum adapter is one A shared by q, k and v: `targets` cannot pick q and v
    alone, and the adapter is not HF/PEFT's per-projection one.
  - qwix found no weight for `o_proj`, which is reshaped before its einsum, when the adapters
    were created eagerly (its tracer walk only works under tracing), so o had no adapter; under
    `scan_layers` (traced) it then found it and tried to create one inside the scan:
    "ValueError: Cannot find rngs in the current module. Please set rngs via
    model.set_attributes(qwix_rngs=nnx.Rngs(...))".
  - Its adapters copy the base weight's metadata unchanged: `down_proj_lora_a` [F, r] carried
    `logical_axes=('mlp', 'embed')`, which would shard the rank axis over `fsdp`.
  - Its 4-bit base (QLoRA) swaps each weight for a quantized array the einsum receives
    directly; the model reads its weights with `param[...]` and casts them, which that array
    does not support. QLoRA is therefore not offered here.
The adapters follow qwix's conventions otherwise (`nnx.LoRAParam`, `<weight>_lora_a/_lora_b`,
alpha / rank scaling, B = 0 at start); dropout on the adapters' input is not implemented
(`model.lora.dropout` must be 0).

Shape suffixes as in `bpo_jax.models.llama`; R is the adapters' rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_ATTENTION = ("q", "k", "v", "o")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank-`rank` adapters with output scale `alpha / rank` on `targets`, stored in `dtype`."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    dtype: Any = jnp.float32

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}.")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"LoRA targets must be a non-empty subset of {TARGETS}, got {self.targets}."
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapter_shapes(cfg, target: str, rank: int):
    """((A shape, A logical axes), (B shape, B logical axes)) of `target` for a `ModelConfig`."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    embed_in = ((d, rank), ("embed", None))
    return {
        # B of q lays its heads out as qkv_proj does: [K, G, E], query head h = k * G + g.
        "q": (embed_in, ((rank, k, h // k, e), (None, "kv_heads", None, "head_dim"))),
        "k": (embed_in, ((rank, k, e), (None, "kv_heads", "head_dim"))),
        "v": (embed_in, ((rank, k, e), (None, "kv_heads", "head_dim"))),
        "o": (((h, e, rank), ("heads", "head_dim", None)), ((rank, d), (None, "embed"))),
        "gate": (embed_in, ((rank, f), (None, "mlp"))),
        "up": (embed_in, ((rank, f), (None, "mlp"))),
        "down": (((f, rank), ("mlp", None)), ((rank, d), (None, "embed"))),
    }[target]


def apply_lora(model, lcfg: LoraConfig, *, seed: int = 0, mesh=None, rules=None, abstract=False):
    """Adds `lcfg`'s adapters to every decoder layer of `model` (in place; returns it).

    Args:
      model: a `Transformer` (its base weights are left as they are).
      lcfg: the adapters' rank, scale, targets and dtype.
      seed: the draw of the A matrices (layer i, target t: its own fold of the key).
      mesh, rules: place each adapter sharded by its logical axes (default: unsharded).
      abstract: make `jax.ShapeDtypeStruct`s (with shardings on `mesh`), for compile-only use.
    """
    from bpo_jax.models import sharding  # Local: sharding imports nothing from here.

    # Nothing is computed for abstract adapters: the compile tool's devices cannot run it.
    key = None if abstract else jax.random.key(seed)
    for i, layer in enumerate(model.layers):
        for target in lcfg.targets:
            module = layer.self_attn if target in _ATTENTION else layer.mlp
            (a_shape, a_axes), (b_shape, b_axes) = adapter_shapes(model.cfg, target, lcfg.rank)
            fan_in = a_shape[0] * (a_shape[1] if len(a_shape) == 3 else 1)
            for part, shape, axes in (("a", a_shape, a_axes), ("b", b_shape, b_axes)):
                named = None
                if mesh is not None:
                    spec = sharding.logical_to_spec(axes, shape, mesh, rules)
                    named = jax.sharding.NamedSharding(mesh, spec)
                if abstract:
                    value = jax.ShapeDtypeStruct(shape, lcfg.dtype, sharding=named)
                elif part == "a":
                    k = jax.random.fold_in(key, i * len(TARGETS) + TARGETS.index(target))
                    bound = 1.0 / fan_in**0.5
                    value = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
                    value = value.astype(lcfg.dtype)
                else:
                    value = jnp.zeros(shape, lcfg.dtype)
                if named is not None and not abstract:
                    value = jax.device_put(value, named)
                setattr(module, f"{target}_lora_{part}", nnx.LoRAParam(value, logical_axes=axes))
            module.lora_scale = float(lcfg.scale)
    return model


# ----------------------------------------------------------------------------- forward


def has_adapters(module, targets) -> bool:
    return any(hasattr(module, f"{t}_lora_a") for t in targets)


def _down(module, name: str, x, dt):
    """x [..., in] @ A [in, R], scaled: the adapter's rank-R projection of its input."""
    a = getattr(module, f"{name}_lora_a")[...].astype(dt)
    a_ir = a.reshape(-1, a.shape[-1])
    return jnp.einsum("bti,ir->btr", x, a_ir) * jnp.asarray(module.lora_scale, dt)


def delta(module, name: str, x_bti, dt):
    """The adapter's output (x @ A) @ B * alpha / R, [B, T, out] for a 2-D B [R, out]."""
    b_ro = getattr(module, f"{name}_lora_b")[...].astype(dt)
    return jnp.einsum("btr,ro->bto", _down(module, name, x_bti, dt), b_ro)


def stacked_delta(module, names, x_btd, dt, axis: int):
    """The adapters' outputs of fused projections stacked along `axis` (zeros where a part
    has none): gate and up as [B, T, 2, F] for `gate_up_proj`."""
    parts = [
        delta(module, n, x_btd, dt)
        if hasattr(module, f"{n}_lora_a")
        else jnp.zeros(x_btd.shape[:2] + module.down_proj.shape[:1], dt)
        for n in names
    ]
    return jnp.stack(parts, axis=axis)


def qkv_delta(module, x_btd, dt, g: int):
    """The q, k and v adapters' outputs laid out as the fused projection: [B, T, K, G + 2, E]."""
    b, t, _ = x_btd.shape
    cfg = module.cfg
    k, e = cfg.num_kv_heads, cfg.resolved_head_dim
    parts = []
    for name, width in (("q", g), ("k", 1), ("v", 1)):
        if not hasattr(module, f"{name}_lora_a"):
            parts.append(jnp.zeros((b, t, k, width, e), dt))
            continue
        b_r = getattr(module, f"{name}_lora_b")[...].astype(dt).reshape(-1, k, width, e)
        parts.append(jnp.einsum("btr,rkge->btkge", _down(module, name, x_btd, dt), b_r))
    return jnp.concatenate(parts, axis=3)


# ----------------------------------------------------------------------------- states


def split_adapters(state):
    """(adapters, base) of an `nnx.State` (or a tree of the same structure, e.g. shardings)."""
    return nnx.split_state(state, nnx.LoRAParam, ...)


def has_lora(state) -> bool:
    """Whether an `nnx.State` holds adapters."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return any(isinstance(x, nnx.LoRAParam) for x in leaves)


def merge(base, adapters):
    """The whole state again from `split_adapters`' parts."""
    return nnx.merge_state(base, adapters)
