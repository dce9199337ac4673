"""Imports Hugging Face Qwen2 / Llama checkpoints (safetensors) into `Transformer`.

Parameter names already match Hugging Face's, so each tensor needs only a transpose and a
reshape: HF stores `nn.Linear` weights as [out, in] with heads flattened into the out dimension,
ours are [in, ...out] with heads as their own axis (so sharding rules can name them).

Loading streams one tensor at a time: it is read from the safetensors file into host memory,
rearranged (as a numpy view), and each device receives only its own slice, already cast, via
`jax.make_array_from_callback`. No parameter is assembled whole on a device, and host memory
holds one tensor at a time (at most the embedding, ~1 GB for a 7B model in bf16).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' "np" reader needs)
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open

from bpo_jax.models.config import ModelConfig, RopeScaling
from bpo_jax.models.factory import abstract_model, param_specs
from bpo_jax.models.llama import Transformer

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Buffers some older checkpoints carry that are recomputed from the config, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config


def _rope_settings(hf: dict) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either config layout.

    transformers < 5 writes `rope_theta` and `rope_scaling` at the top level; transformers >= 5
    writes one `rope_parameters` dict holding both.
    """
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported; only 'llama3' (and none) are. "
            f"Got rope settings {scaling}."
        )
    defaults = RopeScaling()
    return float(theta), RopeScaling(
        factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            scaling.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def config_from_hf(hf_config: dict, **overrides) -> ModelConfig:
    """Translates a Hugging Face `config.json` dict into a `ModelConfig`.

    Args:
      hf_config: the parsed `config.json` of a `qwen2` or `llama` checkpoint.
      **overrides: `ModelConfig` fields to set. `max_seq_len` caps the checkpoint's
        `max_position_embeddings` (the model was not trained beyond it, and the KV cache is
        sized by it), so the result is the smaller of the two.

    Returns:
      The config. `dtype` and `param_dtype` default to the checkpoint's declared dtype
      (`dtype` / `torch_dtype`), else float32.

    Raises:
      ValueError: on an unsupported `model_type` or architecture feature, or an unknown override.
    """
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported Hugging Face model_type {model_type!r}; "
            f"supported: {SUPPORTED_MODEL_TYPES}."
        )
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; the MLP is SwiGLU (silu).")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported: the MLP projections have no biases.")
    if model_type == "qwen2":
        if hf_config.get("use_sliding_window"):
            raise ValueError(
                "Qwen2 use_sliding_window=True is not supported (full attention only)."
            )
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias.
    else:
        if hf_config.get("attention_bias"):
            # Llama's attention_bias also gives o_proj a bias, which Transformer does not have.
            raise ValueError("Llama attention_bias=True (q/k/v/o biases) is not supported.")
        qkv_bias = False

    rope_theta, rope_scaling = _rope_settings(hf_config)
    dtype = _DTYPES.get(str(hf_config.get("dtype") or hf_config.get("torch_dtype")), jnp.float32)
    num_heads = int(hf_config["num_attention_heads"])
    fields = dict(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=int(hf_config["hidden_size"]),
        intermediate_size=int(hf_config["intermediate_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=hf_config.get("head_dim"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        max_seq_len=int(hf_config.get("max_position_embeddings", 2048)),
        dtype=dtype,
        param_dtype=dtype,
    )
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"Unknown ModelConfig overrides {sorted(unknown)}.")
    if overrides.get("max_seq_len") is not None:
        overrides["max_seq_len"] = min(fields["max_seq_len"], int(overrides["max_seq_len"]))
    fields.update(overrides)
    return ModelConfig(**fields)


# ----------------------------------------------------------------------------- name mapping


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor and where it lives in our model."""

    hf_name: str
    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
    return x


def _transpose(x):
    return x.T


def tensor_map(cfg: ModelConfig) -> list[_Entry]:
    """Every checkpoint tensor of `cfg`'s architecture, with its rearrangement to our layout.

    The rearrangements are numpy views (transpose / split an axis), so they copy nothing.
    """
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim

    def proj_in(n):  # [N*E, D] -> [D, N, E]
        return (lambda w: w.T.reshape(d, n, e)), (lambda p: p.reshape(d, n * e).T)

    def bias(n):  # [N*E] -> [N, E]
        return (lambda b: b.reshape(n, e)), (lambda p: p.reshape(n * e))

    o_in = (lambda w: w.T.reshape(h, e, d)), (lambda p: p.reshape(h * e, d).T)  # [D, H*E]
    same = (_identity, _identity)
    t = (_transpose, _transpose)

    entries = [_Entry("model.embed_tokens.weight", ("embed_tokens",), (v, d), *same)]
    for i in range(cfg.num_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "self_attn")
        entries += [
            _Entry(
                pre + "input_layernorm.weight",
                ("layers", i, "input_layernorm", "weight"),
                (d,),
                *same,
            ),
            _Entry(
                pre + "post_attention_layernorm.weight",
                ("layers", i, "post_attention_layernorm", "weight"),
                (d,),
                *same,
            ),
            _Entry(pre + "self_attn.q_proj.weight", at + ("q_proj",), (h * e, d), *proj_in(h)),
            _Entry(pre + "self_attn.k_proj.weight", at + ("k_proj",), (k * e, d), *proj_in(k)),
            _Entry(pre + "self_attn.v_proj.weight", at + ("v_proj",), (k * e, d), *proj_in(k)),
            _Entry(pre + "self_attn.o_proj.weight", at + ("o_proj",), (d, h * e), *o_in),
            _Entry(pre + "mlp.gate_proj.weight", ("layers", i, "mlp", "gate_proj"), (f, d), *t),
            _Entry(pre + "mlp.up_proj.weight", ("layers", i, "mlp", "up_proj"), (f, d), *t),
            _Entry(pre + "mlp.down_proj.weight", ("layers", i, "mlp", "down_proj"), (d, f), *t),
        ]
        if cfg.qkv_bias:
            entries += [
                _Entry(pre + "self_attn.q_proj.bias", at + ("q_bias",), (h * e,), *bias(h)),
                _Entry(pre + "self_attn.k_proj.bias", at + ("k_bias",), (k * e,), *bias(k)),
                _Entry(pre + "self_attn.v_proj.bias", at + ("v_bias",), (k * e,), *bias(k)),
            ]
    entries.append(_Entry("model.norm.weight", ("norm", "weight"), (d,), *same))
    if not cfg.tie_embeddings:
        entries.append(_Entry("lm_head.weight", ("lm_head",), (v, d), *t))
    return entries


# ----------------------------------------------------------------------------- loading


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (one file, or the shards of an index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(
        f"No model.safetensors or model.safetensors.index.json in {path!r}; save the model with "
        "save_pretrained(..., safe_serialization=True)."
    )


def _is_ignored(name: str, cfg: ModelConfig) -> bool:
    # Some tied checkpoints still store lm_head.weight (a copy of the embedding); the model reads
    # the embedding, so the copy is skipped.
    return name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_embeddings and name == "lm_head.weight")


def _place(value: np.ndarray, dtype, sharding) -> jax.Array:
    """Puts a host array on device(s), each device receiving only its slice, cast to `dtype`."""
    np_dtype = np.dtype(dtype)
    if sharding is None:
        return jax.device_put(np.ascontiguousarray(value, dtype=np_dtype))
    return jax.make_array_from_callback(
        value.shape, sharding, lambda idx: np.ascontiguousarray(value[idx], dtype=np_dtype)
    )


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules=None,
    dtype=None,
    param_dtype=None,
    max_seq_len: int | None = None,
) -> tuple[ModelConfig, Transformer]:
    """Loads a Hugging Face Qwen2 / Llama safetensors checkpoint into a `Transformer`.

    Args:
      path: directory holding `config.json` and `model.safetensors` (or the shards named by
        `model.safetensors.index.json`).
      mesh: optional device mesh; parameters are then sharded by their logical axes as they are
        loaded.
      rules: logical-axis rules (default: `sharding.current_rules()`).
      dtype: compute dtype (default: the checkpoint's dtype, else float32).
      param_dtype: storage dtype of the parameters (default: the checkpoint's dtype).
      max_seq_len: caps the KV-cache length (default: `max_position_embeddings`).

    Returns:
      (config, model).

    Raises:
      ValueError: when a tensor is missing, unexpected or of the wrong shape (all checked from the
        file headers before any tensor is read), or the architecture is unsupported.
    """
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as fh:
        hf_config = json.load(fh)
    overrides = {"dtype": dtype, "param_dtype": param_dtype, "max_seq_len": max_seq_len}
    cfg = config_from_hf(hf_config, **{k: v for k, v in overrides.items() if v is not None})

    entries = {e.hf_name: e for e in tensor_map(cfg)}
    files = _checkpoint_files(path)
    located: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                if _is_ignored(name, cfg):
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if name not in entries:
                    raise ValueError(
                        f"Unexpected tensor {name!r} of shape {shape} in {file}: no parameter "
                        f"of this {hf_config['model_type']} configuration maps to it."
                    )
                if name in located:
                    raise ValueError(f"Tensor {name!r} is stored twice: {located[name]}, {file}.")
                if shape != entries[name].hf_shape:
                    raise ValueError(
                        f"Tensor {name!r} has shape {shape} in {file}, but config.json implies "
                        f"{entries[name].hf_shape}."
                    )
                located[name] = file
    missing = [n for n in entries if n not in located]
    if missing:
        shown = ", ".join(f"{n!r} (expected shape {entries[n].hf_shape})" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"Checkpoint {path!r} lacks {len(missing)} tensor(s): {shown}{more}.")

    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    shardings = None if mesh is None else param_specs(abstract_state, mesh, rules)
    flat_vars = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = None if shardings is None else dict(nnx.to_flat_state(shardings))
    if set(flat_vars) != {e.path for e in entries.values()}:
        raise AssertionError(
            "tensor_map is out of sync with Transformer's parameters: "
            f"{sorted(set(flat_vars) ^ {e.path for e in entries.values()})}"
        )

    loaded = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                if name not in located or located[name] != file:
                    continue
                entry = entries[name]
                var = flat_vars[entry.path]
                sharding = (
                    None if flat_shardings is None else flat_shardings[entry.path].get_value()
                )
                value = _place(entry.to_ours(f.get_tensor(name)), var.get_value().dtype, sharding)
                loaded[entry.path] = var.replace(value)
    state = nnx.from_flat_state(list(loaded.items()))
    return cfg, nnx.merge(graphdef, state)


def export_hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face names and layouts (host numpy arrays).

    The inverse of `load_hf_checkpoint`'s mapping; the result can be written with
    `safetensors.numpy.save_file` next to a matching `config.json`.
    """
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = {}
    for entry in tensor_map(model.cfg):
        value = np.asarray(jax.device_get(flat[entry.path].get_value()))
        out[entry.hf_name] = np.ascontiguousarray(entry.to_hf(value))
    return out
