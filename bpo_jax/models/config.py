"""Model configurations and named presets for the Llama / Qwen2 / Qwen3 decoder family."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama / Qwen2 family.

    Attributes:
      vocab_size: number of token embeddings (and logits).
      hidden_size: model width D.
      intermediate_size: SwiGLU hidden width F.
      num_layers: number of decoder blocks.
      num_heads: query heads H.
      num_kv_heads: key/value heads K (grouped-query attention; H % K == 0).
      head_dim: per-head width (defaults to hidden_size // num_heads).
      rope_theta: RoPE base.
      rope_scaling: optional Llama-3.1 scaling of the RoPE frequencies.
      rms_norm_eps: epsilon of every RMSNorm.
      qkv_bias: whether q/k/v projections have biases (Qwen2: yes, Llama and Qwen3: no).
      qk_norm: per-head RMSNorm of the queries and keys over the head dim, before RoPE
        (Qwen3's q_norm / k_norm).
      tie_embeddings: whether the LM head reuses the embedding matrix.
      max_seq_len: longest sequence the sampler's KV cache may hold.
      dtype: compute dtype of activations (parameters stay in param_dtype).
      param_dtype: storage dtype of parameters.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_seq_len",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly."
            )
        if self.resolved_head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim must be even for RoPE, got {self.resolved_head_dim}."
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def replace(self, **kwargs) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)


# Fields by family (Qwen2's q/k/v projections have biases; Llama 3.1 scales its RoPE
# frequencies) and by storage (the full-size presets run in bfloat16).
_QWEN2 = {"qkv_bias": True, "rms_norm_eps": 1e-6}
_LLAMA3_1 = {"qkv_bias": False, "rms_norm_eps": 1e-5, "rope_scaling": RopeScaling()}
# Qwen3: per-head q/k RMSNorm instead of q/k/v biases, head_dim 128 at every size (not
# hidden_size / num_heads for 0.6B and 4B); the HF checkpoints' config.json numbers.
_QWEN3 = {
    "qkv_bias": False,
    "qk_norm": True,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_seq_len": 40_960,
}
_BF16 = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"
)  # fmt: skip


def _preset(
    shape: tuple[int, ...], fields: dict[str, Any], overrides: dict[str, Any]
) -> ModelConfig:
    """A preset's config, with the caller's field overrides applied last.

    Args:
      shape: (vocab_size, hidden_size D, intermediate_size F, num_layers, num_heads H,
        num_kv_heads K).
      fields: the preset's other fields.
      overrides: the caller's field overrides.
    """
    cfg = ModelConfig(**dict(zip(_SHAPE_FIELDS, shape, strict=True)), **fields)
    return cfg.replace(**overrides)


def qwen2_5_7b(**overrides) -> ModelConfig:
    """Qwen2.5-7B(-Instruct): 7,615,616,512 parameters."""
    fields = {**_QWEN2, **_BF16, "rope_theta": 1_000_000.0, "max_seq_len": 32_768}
    return _preset((152_064, 3584, 18_944, 28, 28, 4), fields, overrides)


def llama3_1_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B(-Instruct): 8,030,261,248 parameters."""
    fields = {**_LLAMA3_1, **_BF16, "rope_theta": 500_000.0, "max_seq_len": 131_072}
    return _preset((128_256, 4096, 14_336, 32, 32, 8), fields, overrides)


def qwen3_8b(**overrides) -> ModelConfig:
    """Qwen3-8B: 8,190,735,360 parameters (untied embeddings)."""
    return _preset((151_936, 4096, 12_288, 36, 32, 8), {**_QWEN3, **_BF16}, overrides)


def qwen3_4b(**overrides) -> ModelConfig:
    """Qwen3-4B: 4,022,468,096 parameters (tied embeddings)."""
    fields = {**_QWEN3, **_BF16, "tie_embeddings": True}
    return _preset((151_936, 2560, 9728, 36, 32, 8), fields, overrides)


def qwen3_1_7b(**overrides) -> ModelConfig:
    """Qwen3-1.7B: 1,720,574,976 parameters (tied embeddings)."""
    fields = {**_QWEN3, **_BF16, "tie_embeddings": True}
    return _preset((151_936, 2048, 6144, 28, 16, 8), fields, overrides)


def qwen3_0_6b(**overrides) -> ModelConfig:
    """Qwen3-0.6B: 596,049,920 parameters (tied embeddings)."""
    fields = {**_QWEN3, **_BF16, "tie_embeddings": True}
    return _preset((151_936, 1024, 3072, 28, 16, 8), fields, overrides)


def smollm2_135m(**overrides) -> ModelConfig:
    """SmolLM2-135M(-Instruct): 134,515,008 parameters (tied embeddings), the Llama
    architecture; its weights come from a GGUF file (`model.gguf`, bpo_jax/models/gguf.py)."""
    fields = {
        "qkv_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100_000.0,
        "tie_embeddings": True,
        "max_seq_len": 8192,
    }
    return _preset((49_152, 576, 1536, 30, 9, 3), fields, overrides)


def tiny(**overrides) -> ModelConfig:
    """A few-million-parameter Qwen2-style policy that trains on a laptop CPU."""
    fields = {**_QWEN2, "rope_theta": 10_000.0, "tie_embeddings": True, "max_seq_len": 1024}
    return _preset((1024, 128, 384, 4, 4, 2), fields, overrides)


def small(**overrides) -> ModelConfig:
    """The tiny policy's shape, wider and deeper (about 8x its compute per token): for
    behaviour cloning that the tiny policy underfits (docs/start_policy.md)."""
    return tiny(
        hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=4
    ).replace(**overrides)


PRESETS = {
    "tiny": tiny,
    "small": small,
    "smollm2_135m": smollm2_135m,
    "qwen2_5_7b": qwen2_5_7b,
    "llama3_1_8b": llama3_1_8b,
    "qwen3_8b": qwen3_8b,
    "qwen3_4b": qwen3_4b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_0_6b": qwen3_0_6b,
}
# Presets a run may initialise at random (trained from scratch with their own tokenizer); the
# others need a checkpoint.
RANDOM_INIT_PRESETS = ("tiny", "small")


def get_preset(name: str, **overrides) -> ModelConfig:
    """Returns the named preset with field overrides applied."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; known presets: {sorted(PRESETS)}.")
    return PRESETS[name](**overrides)
