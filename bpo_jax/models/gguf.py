"""Imports llama.cpp GGUF checkpoints of the Llama architecture into `Transformer`.

A GGUF file (`bpo_jax.io.gguf_file`) stores the hyperparameters as metadata (`llama.block_count`,
`llama.attention.head_count_kv`, `llama.rope.freq_base`, ...) and every tensor under llama.cpp's
names (`blk.3.attn_q.weight`) in ggml's layout: a tensor of shape `ne = [in, out]` is the
row-major `[out, in]` matrix Hugging Face stores, so each maps onto a Hugging Face tensor of the
same bytes, and from there onto our parameters through `hf_import.tensor_map` (the same
transposes and fusions as a safetensors checkpoint).

Three things differ from a safetensors checkpoint:

* Tensors may be quantized in blocks. F32, F16, Q8_0 (32 int8 and one float16 scale per block)
  and Q4_1 (32 4-bit values, a float16 scale and a float16 minimum) are dequantized to float32
  with the `gguf` package's numpy kernels; any other type is refused, naming the tensors.
* llama.cpp's converter permutes the rows of q_proj and k_proj: within each head it interleaves
  the two halves that Hugging Face's rotary embedding rotates against each other (`rotate_half`,
  dims i and i + E/2), because llama.cpp rotates adjacent pairs (2i, 2i + 1). `unpermute_rows`
  undoes it, so the usual half-split RoPE of `Transformer` applies. Skipping it leaves a model
  that loads without complaint and computes wrong attention scores (see tests/test_gguf.py).
* A tied checkpoint has no `output.weight`; the LM head reuses `token_embd.weight`.

Only `general.architecture == "llama"` without RoPE scaling or experts is read; anything else
is refused with the key or tensor that says so.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from bpo_jax.io import gguf_file
from bpo_jax.models.config import ModelConfig
from bpo_jax.models.factory import abstract_model, param_specs
from bpo_jax.models.hf_import import tensor_map
from bpo_jax.models.llama import Transformer

SUPPORTED_ARCHITECTURES = ("llama",)
# ggml tensor types this importer dequantizes (names of `gguf.GGMLQuantizationType`).
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_1")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# llama.cpp tensor names -> Hugging Face names (`{i}` is the layer).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


# ----------------------------------------------------------------------------- config


def _required(meta: dict, key: str):
    if key not in meta:
        raise ValueError(f"The GGUF file has no metadata key {key!r}, which a Llama model needs.")
    value = meta[key]
    if isinstance(value, list):
        raise ValueError(
            f"GGUF metadata {key!r} is per layer ({value[:4]}...); only models whose layers "
            "share one value are supported."
        )
    return value


def check_architecture(meta: dict) -> str:
    """The file's architecture, refused unless this importer reads it.

    Raises:
      ValueError: for another architecture, experts, or RoPE scaling.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; this importer reads "
            f"{SUPPORTED_ARCHITECTURES} (general.architecture)."
        )
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(
            f"GGUF model has {meta[f'{arch}.expert_count']} experts ({arch}.expert_count); "
            "mixture-of-experts models are not supported."
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(
            f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported (no RoPE scaling only)."
        )
    return arch


def config_from_gguf(meta: dict, vocab_size: int, **overrides) -> ModelConfig:
    """The `ModelConfig` of a Llama GGUF file's metadata.

    Args:
      meta: the file's metadata (`gguf_file.metadata`).
      vocab_size: rows of `token_embd.weight`.
      **overrides: `ModelConfig` fields to set; `max_seq_len` caps the file's
        `llama.context_length` (the smaller of the two wins).

    Returns:
      The config, float32 (the dequantized weights) unless overridden.

    Raises:
      ValueError: on an unsupported architecture feature or missing metadata.
    """
    arch = check_architecture(meta)
    hidden = int(_required(meta, f"{arch}.embedding_length"))
    heads = int(_required(meta, f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"GGUF key_length {head_dim}, value_length {value_dim} and rope.dimension_count "
            f"{rope_dim} must be equal (full rotary embeddings, one head width)."
        )
    fields = dict(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_required(meta, f"{arch}.feed_forward_length")),
        num_layers=int(_required(meta, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(_required(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        qkv_bias=False,
        tie_embeddings=True,  # `read_gguf` unties it when the file has output.weight.
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
    )
    if overrides.get("max_seq_len") is not None:
        overrides["max_seq_len"] = min(fields["max_seq_len"], int(overrides["max_seq_len"]))
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**fields)


def hf_config(meta: dict, cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A Hugging Face `config.json` (model_type llama) for the file's model."""
    ids = {
        f"{name}_token_id": meta[f"tokenizer.ggml.{key}_token_id"]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
        **ids,
    }


# ----------------------------------------------------------------------------- tensors


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row permutation of q_proj / k_proj ([heads * E, D] -> the same).

    Within each head, llama.cpp's row r = 2i + j holds Hugging Face's row j * E/2 + i (its
    rotary pairs are adjacent rows; Hugging Face's are E/2 apart).
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A `gguf.ReaderTensor` as float32 in Hugging Face's shape (`ne` reversed)."""
    from gguf.quants import dequantize as ggml_dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is stored as {kind}; supported types: {SUPPORTED_TYPES}."
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(ggml_dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)


def _hf_name(name: str, num_layers: int) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and int(match.group(1)) < num_layers and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def _tensor_names(reader, cfg: ModelConfig) -> dict:
    """Hugging Face name -> the file's tensor, every one checked before any is read.

    Raises:
      ValueError: naming unexpected or missing tensors, shape mismatches, or tensors of an
        unsupported type.
    """
    shapes = {n: s for e in tensor_map(cfg) for n, s in zip(e.hf_names, e.hf_shapes)}
    found, unexpected, wrong_type = {}, [], []
    for t in reader.tensors:
        hf = _hf_name(t.name, cfg.num_layers)
        if hf is None or hf not in shapes:
            unexpected.append(t.name)
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        if shape != shapes[hf]:
            raise ValueError(
                f"GGUF tensor {t.name!r} has shape {shape} ([out, in]), but the metadata implies "
                f"{shapes[hf]}."
            )
        if t.tensor_type.name not in SUPPORTED_TYPES:
            wrong_type.append(f"{t.name} ({t.tensor_type.name})")
        found[hf] = t
    if unexpected:
        raise ValueError(
            f"GGUF tensors {unexpected[:8]} map to no parameter of a {cfg.num_layers}-layer "
            "Llama model without biases or RoPE scaling (rope_freqs.weight is Llama 3.1's "
            "scaling); this importer does not read them."
        )
    if wrong_type:
        raise ValueError(
            f"{len(wrong_type)} GGUF tensor(s) use a quantization type this importer does not "
            f"read: {wrong_type[:8]}; supported: {SUPPORTED_TYPES}."
        )
    missing = [n for n in shapes if n not in found]
    if missing:
        raise ValueError(f"The GGUF file lacks {len(missing)} tensor(s): {missing[:8]}.")
    return found


def read_gguf(
    name_or_path: str | os.PathLike, *, unpermute_qk: bool = True, **overrides
) -> tuple[ModelConfig, dict, Callable[[str], np.ndarray]]:
    """(config, metadata, read) of a GGUF file; `read(hf_name)` dequantizes one tensor.

    Args:
      name_or_path: a known name (`gguf_file.KNOWN_FILES`) or a path.
      unpermute_qk: undo llama.cpp's q/k row permutation (False reads q_proj and k_proj as
        stored: only to show that the permutation matters).
      **overrides: `ModelConfig` fields (see `config_from_gguf`).
    """
    reader = gguf_file.open_reader(name_or_path)
    meta = gguf_file.metadata(reader)
    check_architecture(meta)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("The GGUF file has no token_embd.weight tensor.")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    cfg = config_from_gguf(meta, int(embed.shape[1]), **overrides)
    cfg = cfg.replace(tie_embeddings=not has_output)
    tensors = _tensor_names(reader, cfg)

    def read(hf_name: str) -> np.ndarray:
        w = dequantize(tensors[hf_name])
        if unpermute_qk and hf_name.endswith("self_attn.q_proj.weight"):
            return unpermute_rows(w, cfg.num_heads)
        if unpermute_qk and hf_name.endswith("self_attn.k_proj.weight"):
            return unpermute_rows(w, cfg.num_kv_heads)
        return w

    return cfg, meta, read


def load_gguf(
    name_or_path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules=None,
    dtype=None,
    param_dtype=None,
    max_seq_len: int | None = None,
    unpermute_qk: bool = True,
) -> tuple[ModelConfig, Transformer]:
    """Loads a Llama GGUF checkpoint into a `Transformer`.

    Args:
      name_or_path: a known name (`model.gguf=smollm2_135m_instruct`) or a `.gguf` path.
      mesh: optional device mesh; each parameter is placed with its logical-axis sharding.
      rules: logical-axis rules (default: `sharding.current_rules()`).
      dtype: compute dtype (default float32).
      param_dtype: storage dtype (default float32: the dequantized values exactly).
      max_seq_len: caps the KV-cache length (default: the file's `context_length`).
      unpermute_qk: undo llama.cpp's q/k row permutation (False only to test that it matters).

    Returns:
      (config, model).

    Raises:
      ValueError: for an unsupported architecture or tensor type, or inconsistent tensors (all
        checked before a tensor is dequantized).
    """
    overrides = {"dtype": dtype, "param_dtype": param_dtype, "max_seq_len": max_seq_len}
    cfg, _, read = read_gguf(name_or_path, unpermute_qk=unpermute_qk, **overrides)
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    flat_vars = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = None
    if mesh is not None:
        flat_shardings = dict(nnx.to_flat_state(param_specs(abstract_state, mesh, rules)))
    loaded = {}
    for entry in tensor_map(cfg):
        var = flat_vars[entry.path]
        abstract = var.get_value()
        value = np.ascontiguousarray(
            entry.to_ours(*(read(n) for n in entry.hf_names)), dtype=np.dtype(abstract.dtype)
        )
        if flat_shardings is None:
            array = jax.device_put(value)
        else:
            sharding = flat_shardings[entry.path].get_value()
            array = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
        loaded[entry.path] = var.replace(array)
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(list(loaded.items())))


def export_model_files(
    name_or_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32"
) -> ModelConfig:
    """Writes a GGUF model's `config.json` and `model.safetensors` in Hugging Face's layout.

    The weights are dequantized (and q/k unpermuted) once; `load_hf_checkpoint` and
    transformers' `from_pretrained` then read the folder as any Llama checkpoint. The
    tokenizer's files are `bpo_jax.tokenizer.gguf.write_tokenizer_files`'.

    Args:
      name_or_path: the GGUF file.
      out_dir: the folder (created).
      dtype: float32 | bfloat16 | float16, the stored dtype.

    Returns:
      The model's config.
    """
    from safetensors.numpy import save_file  # Local: only exports write safetensors.

    if dtype not in _NP_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(_NP_DTYPES)}, got {dtype!r}.")
    cfg, meta, read = read_gguf(name_or_path)
    names = [n for e in tensor_map(cfg) for n in e.hf_names]
    tensors = {n: read(n).astype(_NP_DTYPES[dtype]) for n in names}
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(meta, cfg, dtype), f, indent=2)
    return cfg
