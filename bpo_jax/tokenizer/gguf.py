"""The tokenizer a GGUF file's metadata describes, as a Hugging Face `tokenizer.json`.

A GGUF file (`bpo_jax.io.gguf_file`) carries its tokenizer as llama.cpp metadata: the vocabulary
(`tokenizer.ggml.tokens`, each with a `token_type`), the BPE merges, the pre-tokenizer's name
(`tokenizer.ggml.pre`), the BOS/EOS/padding/unknown ids and the chat template
(`tokenizer.chat_template`). `tokenizer_data` rewrites them as the two files a Hugging Face
checkpoint has, so that `HFTokenizer` (the `tokenizers` library) encodes with them and the chat
template renders as for any checkpoint; `write_tokenizer_files` writes them out.

What is read:

* `tokenizer.ggml.model` must be "gpt2": byte-level BPE, whose tokens are spelled in GPT-2's
  byte alphabet (every byte one printable character, a space as "Ġ").
* The pre-tokenizer is chosen by `tokenizer.ggml.pre`, as llama.cpp chooses it (PRE_TOKENIZERS);
  an unknown name is refused rather than guessed, because a wrong split gives other ids for the
  same text with no error. "smollm" isolates every number character (`\\p{N}`) before GPT-2's
  split, as llama.cpp does and as SmolLM2's own `tokenizer.json` does (its `Digits` step).
  transformers' GGUF reader does not know "smollm" and splits with GPT-2's pattern alone; the
  two differ only where a non-ASCII number character joins a neighbour, since the vocabulary
  has no token of two digits or of a space and a digit (tests/test_gguf.py counts this).
* Control tokens (type 3: `<|im_start|>`, `<|endoftext|>`, ...) and unknown tokens (type 2)
  become special added tokens, user-defined ones (type 4) plain added tokens: each is matched
  whole in the text, never split.
* The special tokens are named by their ids (`tokenizer.ggml.bos_token_id`, ...), whatever
  their spelling.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import pre_tokenizers

from bpo_jax.io import gguf_file
from bpo_jax.tokenizer.hf import HFTokenizer

SUPPORTED_MODELS = ("gpt2",)

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
# tokenizer.ggml.pre -> the pre-tokenizer, as llama.cpp splits text for that name.
PRE_TOKENIZERS = {
    # GPT-2's pattern alone.
    "gpt2": {**_BYTE_LEVEL, "use_regex": True},
    # Every number character on its own, then GPT-2's pattern (llama.cpp's SMOLLM pre-type).
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {**_BYTE_LEVEL, "use_regex": True},
        ],
    },
}
# llama.cpp's token types (`gguf.TokenType`).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# tokenizer.ggml.<key>_token_id -> the Hugging Face name of the special token.
_SPECIAL_IDS = {
    "bos": "bos_token",
    "eos": "eos_token",
    "padding": "pad_token",
    "unknown": "unk_token",
}


def _added_token(token_id: int, text: str, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": text,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _known(meta: dict[str, Any], key: str, known, which: str, default: Any = None) -> Any:
    """The metadata value `key` (`default` if absent), which must be one of `known`; else a
    ValueError that names the value and `which` values this reader knows."""
    value = meta.get(key, default)
    if value not in known:
        raise ValueError(f"GGUF {key}={value!r} is not supported; {which}")
    return value


def tokenizer_data(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`tokenizer.json`, `tokenizer_config.json`) contents from a GGUF file's metadata.

    Raises:
      ValueError: for a tokenizer model or pre-tokenizer this reader does not know, a token not
        spelled in the byte alphabet, a repeated token, or a special token id out of range.
    """
    supported = f"supported: {SUPPORTED_MODELS} (byte-level BPE)."
    _known(meta, "tokenizer.ggml.model", SUPPORTED_MODELS, supported)
    known = (
        f"known pre-tokenizers: {sorted(PRE_TOKENIZERS)}. Guessing would split text differently "
        "from the model's training without an error."
    )
    pre = _known(meta, "tokenizer.ggml.pre", PRE_TOKENIZERS, known, default="gpt2")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(set(tokens)) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens repeats a token; ids would be ambiguous.")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED):
            added.append(_added_token(i, text, special=kind != _USER_DEFINED))
        elif not set(text) <= alphabet:
            raise ValueError(
                f"GGUF token {i} ({text!r}) is not spelled in the byte-level alphabet; this "
                "reader expects GPT-2-style byte-level tokens."
            )
    merges = [m.split(" ") for m in meta.get("tokenizer.ggml.merges", [])]
    bad = [m for m in merges if len(m) != 2]
    if bad:
        raise ValueError(f"GGUF merges must be 'left right' pairs, got {bad[:3]}.")
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {**_BYTE_LEVEL, "trim_offsets": False, "use_regex": True},
        "decoder": {**_BYTE_LEVEL, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text: i for i, text in enumerate(tokens)},
            "merges": merges,
        },
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for key, name in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ValueError(
                f"GGUF tokenizer.ggml.{key}_token_id={token_id} is outside the vocabulary of "
                f"{len(tokens)} tokens."
            )
        config[name] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer_json, config


def _model_ids(meta: dict[str, Any]) -> dict[str, int]:
    """The token ids a `config.json` would give (`eos_token_id` ends generations)."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "padding": "pad_token_id"}
    return {
        name: meta[f"tokenizer.ggml.{key}_token_id"]
        for key, name in keys.items()
        if f"tokenizer.ggml.{key}_token_id" in meta
    }


def load_gguf_tokenizer(name_or_path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer (and chat template) of a GGUF file: a known name or a path."""
    path = gguf_file.locate(name_or_path)
    meta = gguf_file.metadata(gguf_file.open_reader(path))
    tokenizer_json, config = tokenizer_data(meta)
    return HFTokenizer.from_data(json.dumps(tokenizer_json), config, path, _model_ids(meta))


def write_tokenizer_files(name_or_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Writes a GGUF file's `tokenizer.json` and `tokenizer_config.json` (with its chat
    template) into `out_dir`, as a Hugging Face checkpoint folder holds them."""
    meta = gguf_file.metadata(gguf_file.open_reader(name_or_path))
    tokenizer_json, config = tokenizer_data(meta)
    os.makedirs(out_dir, exist_ok=True)
    for name, data in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", config)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
