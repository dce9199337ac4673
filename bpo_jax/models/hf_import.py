"""Imports Hugging Face Qwen2 / Qwen3 / Llama checkpoints (safetensors) into `Transformer`.

Parameter names follow Hugging Face's, and most tensors need only a transpose and a reshape: HF
stores `nn.Linear` weights as [out, in] with heads flattened into the out dimension, ours are
[in, ...out] with heads as their own axis (so sharding rules can name them). Two parameters are
fused for speed: `qkv_proj` (and `qkv_bias`) holds q_proj, k_proj and v_proj, grouped by KV
head, and `gate_up_proj` holds gate_proj and up_proj (see `tensor_map`).

Loading reads, for each parameter, only the slices this process's devices hold: every
parameter is built with `jax.make_array_from_callback`, whose callback maps the device's slice
of our layout back to the blocks of the checkpoint tensors it comes from (through the
transposes, reshapes and concatenations of `tensor_map`) and reads just those byte ranges
(`safetensors_slices`). On a pod with FSDP, each host reads its share of the checkpoint, not all
of it, and host memory holds at most one parameter's local slices. The checkpoint may be a local
folder or a `gs://` one (read through `etils.epath`).
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
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from bpo_jax.io import files
from bpo_jax.models.config import ModelConfig, RopeScaling
from bpo_jax.models.factory import abstract_model, param_specs
from bpo_jax.models.llama import Transformer
from bpo_jax.models.safetensors_slices import Piece, SafetensorsFile, read_region

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

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
      hf_config: the parsed `config.json` of a `qwen2`, `qwen3` or `llama` checkpoint.
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
    elif model_type == "qwen3":
        if hf_config.get("use_sliding_window"):
            raise ValueError(
                "Qwen3 use_sliding_window=True is not supported (full attention only)."
            )
        if hf_config.get("attention_bias"):
            # Qwen3's attention_bias gives q/k/v and o_proj biases; Transformer has no o bias.
            raise ValueError("Qwen3 attention_bias=True (q/k/v/o biases) is not supported.")
        qkv_bias = False
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
        qk_norm=model_type == "qwen3",
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
    """One parameter of our model and the checkpoint tensor(s) it is made of.

    Most parameters are one checkpoint tensor, transposed and reshaped. The fused ones are
    several: `qkv_proj` (and `qkv_bias`) holds q_proj, k_proj and v_proj, `gate_up_proj` holds
    gate_proj and up_proj. `pieces` and `axis` say the same as `to_ours` in the form the
    loader reads slices by: the parameter is `np.concatenate([view of each piece], axis)`.
    """

    path: tuple[str | int, ...]
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_ours: Callable[..., np.ndarray]  # the tensors of hf_names, in order -> our parameter
    to_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # the inverse
    pieces: tuple[Piece, ...]
    axis: int = 0


def _identity(x):
    return x


def _transpose(x):
    return x.T


def _single(path, hf_name, hf_shape, to_ours, to_hf, piece_shape=None) -> _Entry:
    transposed = to_ours is not _identity
    if piece_shape is None:
        piece_shape = tuple(reversed(hf_shape)) if transposed else hf_shape
    piece = Piece(hf_name, transposed, piece_shape)
    return _Entry(path, (hf_name,), (hf_shape,), to_ours, lambda p: (to_hf(p),), (piece,))


def tensor_map(cfg: ModelConfig) -> list[_Entry]:
    """Every parameter of `cfg`'s architecture, with the checkpoint tensors it is made of.

    Single-tensor rearrangements are numpy views (transpose / split an axis) and copy nothing;
    the fused parameters are assembled with one copy.
    """
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    g = h // k

    # q_proj [H*E, D], k_proj and v_proj [K*E, D] -> qkv_proj [D, K, G + 2, E]: query head
    # h = k * G + g goes to slot g of KV head k, its key to slot G, its value to slot G + 1.
    def qkv_in(q, kk, vv):
        parts = [q.T.reshape(d, k, g, e), kk.T.reshape(d, k, 1, e), vv.T.reshape(d, k, 1, e)]
        return np.concatenate(parts, axis=2)

    def qkv_out(p):
        return (
            p[:, :, :g].reshape(d, h * e).T,
            p[:, :, g].reshape(d, k * e).T,
            p[:, :, g + 1].reshape(d, k * e).T,
        )

    # The biases [H*E], [K*E], [K*E] -> qkv_bias [K, G + 2, E], in the same slots.
    def bias_in(q, kk, vv):
        return np.concatenate([q.reshape(k, g, e), kk.reshape(k, 1, e), vv.reshape(k, 1, e)], 1)

    def bias_out(p):
        return p[:, :g].reshape(h * e), p[:, g].reshape(k * e), p[:, g + 1].reshape(k * e)

    # gate_proj and up_proj [F, D] -> gate_up_proj [D, 2, F].
    def gate_up_in(gate, up):
        return np.stack([gate.T, up.T], axis=1)

    def gate_up_out(p):
        return p[:, 0].T, p[:, 1].T

    def o_in(w):  # [D, H*E] -> [H, E, D]
        return w.T.reshape(h, e, d)

    def o_out(p):
        return p.reshape(h * e, d).T

    same = (_identity, _identity)
    t = (_transpose, _transpose)

    entries = [_single(("embed_tokens",), "model.embed_tokens.weight", (v, d), *same)]
    for i in range(cfg.num_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "self_attn")
        attn = pre + "self_attn."
        entries += [
            _single(
                ("layers", i, "input_layernorm", "weight"),
                pre + "input_layernorm.weight",
                (d,),
                *same,
            ),
            _single(
                ("layers", i, "post_attention_layernorm", "weight"),
                pre + "post_attention_layernorm.weight",
                (d,),
                *same,
            ),
            _Entry(
                at + ("qkv_proj",),
                tuple(attn + n + "_proj.weight" for n in "qkv"),
                ((h * e, d), (k * e, d), (k * e, d)),
                qkv_in,
                qkv_out,
                (
                    Piece(attn + "q_proj.weight", True, (d, k, g, e)),
                    Piece(attn + "k_proj.weight", True, (d, k, 1, e)),
                    Piece(attn + "v_proj.weight", True, (d, k, 1, e)),
                ),
                2,
            ),
            _single(at + ("o_proj",), attn + "o_proj.weight", (d, h * e), o_in, o_out, (h, e, d)),
            _Entry(
                ("layers", i, "mlp", "gate_up_proj"),
                (pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"),
                ((f, d), (f, d)),
                gate_up_in,
                gate_up_out,
                (
                    Piece(pre + "mlp.gate_proj.weight", True, (d, 1, f)),
                    Piece(pre + "mlp.up_proj.weight", True, (d, 1, f)),
                ),
                1,
            ),
            _single(("layers", i, "mlp", "down_proj"), pre + "mlp.down_proj.weight", (d, f), *t),
        ]
        if cfg.qk_norm:
            entries += [
                _single(at + (n, "weight"), attn + n + ".weight", (e,), *same)
                for n in ("q_norm", "k_norm")
            ]
        if cfg.qkv_bias:
            entries.append(
                _Entry(
                    at + ("qkv_bias",),
                    tuple(attn + n + "_proj.bias" for n in "qkv"),
                    ((h * e,), (k * e,), (k * e,)),
                    bias_in,
                    bias_out,
                    (
                        Piece(attn + "q_proj.bias", False, (k, g, e)),
                        Piece(attn + "k_proj.bias", False, (k, 1, e)),
                        Piece(attn + "v_proj.bias", False, (k, 1, e)),
                    ),
                    1,
                )
            )
    entries.append(_single(("norm", "weight"), "model.norm.weight", (d,), *same))
    if not cfg.tie_embeddings:
        entries.append(_single(("lm_head",), "lm_head.weight", (v, d), *t))
    return entries


# ----------------------------------------------------------------------------- loading


def _checkpoint_files(path: epath.Path) -> list[epath.Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards of an index)."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if single.exists():
        return [single]
    raise FileNotFoundError(
        f"No model.safetensors or model.safetensors.index.json in {str(path)!r}; save the model "
        "with save_pretrained(..., safe_serialization=True)."
    )


def _is_ignored(name: str, cfg: ModelConfig) -> bool:
    # Some tied checkpoints still store lm_head.weight (a copy of the embedding); the model reads
    # the embedding, so the copy is skipped.
    return name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_embeddings and name == "lm_head.weight")


def slice_reader(
    entry: _Entry, shape, dtype, handles: dict[str, SafetensorsFile]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback `jax.make_array_from_callback` calls per local device: index -> that slice
    of the parameter, read from the checkpoint (only the blocks it covers) and cast to `dtype`.

    Devices holding the same slice (replicas) share one read.

    Args:
      entry: The parameter's `tensor_map` entry.
      shape: Its shape (ours).
      dtype: Its storage dtype.
      handles: The open file of each of `entry.hf_names`.
    """
    np_dtype = np.dtype(dtype)
    tensors = {name: handles[name].tensors[name] for name in entry.hf_names}

    def read(name, rows, cols):
        return handles[name].read_block(name, rows, cols)

    done: dict[tuple, np.ndarray] = {}

    def local_slice(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key not in done:
            value = read_region(entry.pieces, entry.axis, index, tensors, read)
            done[key] = np.ascontiguousarray(value, dtype=np_dtype)
        return done[key]

    return local_slice


def load_param(
    entry: _Entry, shape, dtype, sharding, handles: dict[str, SafetensorsFile]
) -> jax.Array:
    """One parameter on its devices (`sharding`; None: the default device), this process
    reading only the slices of its own devices (see `slice_reader`)."""
    local_slice = slice_reader(entry, shape, dtype, handles)
    if sharding is None:
        return jax.device_put(local_slice(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(tuple(shape), sharding, local_slice)


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules=None,
    dtype=None,
    param_dtype=None,
    max_seq_len: int | None = None,
) -> tuple[ModelConfig, Transformer]:
    """Loads a Hugging Face Qwen2 / Qwen3 / Llama safetensors checkpoint into a `Transformer`.

    Args:
      path: directory holding `config.json` and `model.safetensors` (or the shards named by
        `model.safetensors.index.json`): a local folder or a bucket URL (`gs://...`).
      mesh: optional device mesh; parameters are then sharded by their logical axes as they are
        loaded, and this process reads only the slices its own devices hold.
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
    path = files.as_path(path)
    hf_config = json.loads((path / "config.json").read_text())
    overrides = {"dtype": dtype, "param_dtype": param_dtype, "max_seq_len": max_seq_len}
    cfg = config_from_hf(hf_config, **{k: v for k, v in overrides.items() if v is not None})

    entries = tensor_map(cfg)
    shapes = {n: shape for e in entries for n, shape in zip(e.hf_names, e.hf_shapes)}
    opened = [SafetensorsFile(file) for file in _checkpoint_files(path)]
    try:
        handles: dict[str, SafetensorsFile] = {}
        for f in opened:
            for name, info in f.tensors.items():
                if _is_ignored(name, cfg):
                    continue
                if name not in shapes:
                    raise ValueError(
                        f"Unexpected tensor {name!r} of shape {info.shape} in {f.path}: no "
                        f"parameter of this {hf_config['model_type']} configuration maps to it."
                    )
                if name in handles:
                    raise ValueError(
                        f"Tensor {name!r} is stored twice: {handles[name].path}, {f.path}."
                    )
                if info.shape != shapes[name]:
                    raise ValueError(
                        f"Tensor {name!r} has shape {info.shape} in {f.path}, but config.json "
                        f"implies {shapes[name]}."
                    )
                handles[name] = f
        missing = [n for n in shapes if n not in handles]
        if missing:
            shown = ", ".join(f"{n!r} (expected shape {shapes[n]})" for n in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"Checkpoint {str(path)!r} lacks {len(missing)} tensor(s): {shown}{more}."
            )

        graphdef, abstract_state = nnx.split(abstract_model(cfg))
        shardings = None if mesh is None else param_specs(abstract_state, mesh, rules)
        flat_vars = dict(nnx.to_flat_state(abstract_state))
        flat_shardings = None if shardings is None else dict(nnx.to_flat_state(shardings))
        if set(flat_vars) != {e.path for e in entries}:
            raise AssertionError(
                "tensor_map is out of sync with Transformer's parameters: "
                f"{sorted(set(flat_vars) ^ {e.path for e in entries})}"
            )
        loaded = {}
        for entry in entries:
            var = flat_vars[entry.path]
            sharding = None if flat_shardings is None else flat_shardings[entry.path].get_value()
            abstract = var.get_value()
            value = load_param(entry, abstract.shape, abstract.dtype, sharding, handles)
            loaded[entry.path] = var.replace(value)
    finally:
        for f in opened:
            f.close()
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
        for name, tensor in zip(entry.hf_names, entry.to_hf(value)):
            out[name] = np.ascontiguousarray(tensor)
    return out
