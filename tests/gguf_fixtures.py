"""GGUF models for the tests: the real SmolLM2-135M-Instruct (ours and transformers', each loaded
once per test session), and tiny random Llama files written here in any mix of tensor types.

`write_tiny_gguf` writes what llama.cpp's converter writes for a Hugging Face Llama: the
hyperparameters and a byte-level tokenizer as metadata, q_proj / k_proj rows permuted into
llama.cpp's rotary layout, each tensor stored in the type asked for. It returns the Hugging
Face tensors the file was made from (after the round trip through the quantization, so that a
loader that reads the file right gives them back exactly).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np

SMOLLM = "smollm2_135m_instruct"
TINY = dict(vocab=300, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, context=128)


def smollm_path() -> Path:
    """The real file."""
    from bpo_jax.io import gguf_file

    return gguf_file.locate(SMOLLM)


# Each loaded once per test session, whichever module asks first (tests/conftest.py makes them
# session fixtures).
@functools.cache
def our_smollm():
    """(config, model) of the real GGUF file, float32."""
    from bpo_jax.models.gguf import load_gguf

    return load_gguf(SMOLLM)


@functools.cache
def hf_smollm():
    """transformers' own GGUF loader on the same file (the reference): every weight dequantized
    at load (`GgufConfig(dequantize=True)`) into a plain Llama model, float32, eager attention."""
    import torch
    import transformers

    path = smollm_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=transformers.GgufConfig(gguf_file=path.name, dequantize=True),
    )
    return model.eval()


@functools.cache
def hf_smollm_float64():
    """The reference in float64: the float32 model's weights, every operation in float64."""
    return copy.deepcopy(hf_smollm()).double()


@functools.cache
def our_smollm_tokenizer():
    """Our tokenizer of the real file."""
    from bpo_jax.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(SMOLLM)


@functools.cache
def hf_smollm_tokenizer():
    """transformers' tokenizer of the real file."""
    import transformers

    path = smollm_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (Hugging Face -> GGUF), written from its
    definition: within each head, the rows i and E/2 + i become rows 2i and 2i + 1."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _stored(w: np.ndarray, kind: str):
    """(array to write, raw ggml type or None, the values a reader gets back)."""
    import gguf

    if kind == "F32":
        return w.astype(np.float32), None, w.astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def tiny_tokens(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): three control tokens, the 256 byte-level characters, and
    merges of a few common pairs up to `vocab` tokens."""
    from tokenizers import pre_tokenizers

    controls = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges = controls + alphabet, []
    pairs = [("Ġ", c) for c in "tasdgoc"] + [(a, b) for a in "aeiou" for b in "nrst"]
    for left, right in pairs:
        if len(tokens) >= vocab:
            break
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    tokens += [f"<unused_{i}>" for i in range(vocab - len(tokens))]
    types = [3] * len(controls) + [1] * (len(tokens) - len(controls))
    return tokens, types, merges


def write_tiny_gguf(
    path: Path,
    types: dict[str, str] | None = None,
    *,
    arch: str = "llama",
    tied: bool = True,
    seed: int = 0,
    metadata: dict | None = None,
    strings: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Writes a tiny random Llama GGUF file; returns its Hugging Face tensors (as read back).

    Args:
      path: the file.
      types: ggml type per llama.cpp tensor kind ("token_embd", "attn_q", ..., "output");
        unnamed kinds are F32.
      arch: `general.architecture`.
      tied: without `output.weight` (the LM head is the embedding).
      seed: of the random weights.
      metadata: `GGUFWriter` methods to call, with their value (adding or replacing keys).
      strings: string keys to add by name (`{"llama.rope.scaling.type": "linear"}`).
    """
    import gguf

    types = types or {}
    t = TINY
    e = t["hidden"] // t["heads"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        "add_block_count": t["layers"],
        "add_context_length": t["context"],
        "add_embedding_length": t["hidden"],
        "add_feed_forward_length": t["ffn"],
        "add_head_count": t["heads"],
        "add_head_count_kv": t["kv_heads"],
        "add_rope_freq_base": 10_000.0,
        "add_layer_norm_rms_eps": 1e-5,
        "add_rope_dimension_count": e,
        "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": "smollm",
        "add_bos_token_id": 1,
        "add_eos_token_id": 2,
        "add_chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
        "{% endfor %}",
        **(metadata or {}),
    }
    tokens, token_types, merges = tiny_tokens(t["vocab"])
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for method, value in meta.items():
        getattr(writer, method)(value)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)

    hf = {}

    def add(gguf_name: str, hf_name: str, w: np.ndarray, heads: int | None = None):
        kind = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        stored = llama_cpp_permute(w, heads) if heads else w
        data, raw, back = _stored(stored, types.get(kind, "F32"))
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
        hf[hf_name] = (
            back.reshape(heads, e // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            if heads
            else back
        )

    d, f, v = t["hidden"], t["ffn"], t["vocab"]
    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (v, d)))
    for i in range(t["layers"]):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight", 1 + rng.normal(0, 0.1, d))
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rng.normal(0, 0.1, d))
        add(
            b + "attn_q.weight",
            p + "self_attn.q_proj.weight",
            rng.normal(0, 0.1, (d, d)),
            t["heads"],
        )
        add(
            b + "attn_k.weight",
            p + "self_attn.k_proj.weight",
            rng.normal(0, 0.1, (2 * e, d)),
            t["kv_heads"],
        )
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", rng.normal(0, 0.1, (2 * e, d)))
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", rng.normal(0, 0.1, (d, d)))
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", rng.normal(0, 0.1, (f, d)))
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", rng.normal(0, 0.1, (f, d)))
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", rng.normal(0, 0.1, (d, f)))
    add("output_norm.weight", "model.norm.weight", 1 + rng.normal(0, 0.1, d))
    if not tied:
        add("output.weight", "lm_head.weight", rng.normal(0, 0.5, (v, d)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
