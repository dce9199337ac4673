"""One tokenizer interface over SentencePiece models and Hugging Face `tokenizer.json` files.

May import: io.

Everything downstream (rollouts, loss masks, evaluation) talks to `Tokenizer` and never to a
backend library, so a run can switch between a SentencePiece model trained on the environment's
own text (`train_sentencepiece`, handy for tiny models and tests) and a pretrained checkpoint's
tokenizer (`HFTokenizer`) by changing one path given to `load_tokenizer`.

Conventions shared by both backends:

* `encode` never adds special tokens unless asked, and adds at most one BOS/EOS. Agent prompts are
  built by concatenating separately encoded segments, so a stray BOS in the middle would be a
  silent bug.
* When a model has no BOS (Qwen2), `bos_id` is None and `add_bos=True` is a no-op: generic code
  can ask for a BOS without knowing which model family it runs.
* `decode` never stops at EOS; callers cut sequences at the stop ids themselves (`stop_ids`
  lists every id that ends a generation, since instruct models often have several).

Modules: `base` (the interface), `sp` (SentencePiece), `hf` (Hugging Face files), `gguf` (the
tokenizer in a GGUF file's metadata, as Hugging Face files), `chat_template` (a checkpoint's
chat template, rendered as transformers renders it).
"""

from __future__ import annotations

import os

from bpo_jax.io import files, gguf_file
from bpo_jax.tokenizer.base import SP_BOS_ID, SP_EOS_ID, SP_PAD_ID, SP_UNK_ID, Tokenizer
from bpo_jax.tokenizer.gguf import load_gguf_tokenizer
from bpo_jax.tokenizer.hf import HFTokenizer
from bpo_jax.tokenizer.sp import SentencePieceTokenizer, train_sentencepiece

__all__ = [
    "HFTokenizer",
    "SP_BOS_ID",
    "SP_EOS_ID",
    "SP_PAD_ID",
    "SP_UNK_ID",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_gguf_tokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Opens the tokenizer at `path`, choosing the backend from what is there.

    Args:
      path: A SentencePiece `.model` file; a `tokenizer.json` file; a directory holding a
        `tokenizer.json` (preferred) or a `tokenizer.model`; or a GGUF model (a `.gguf` file,
        or a name in `bpo_jax.io.gguf_file.KNOWN_FILES`), whose metadata holds its tokenizer.

    Returns:
      The tokenizer.

    Raises:
      ValueError: If `path` is none of the above.
    """
    if os.fspath(path) in gguf_file.KNOWN_FILES or os.fspath(path).endswith(".gguf"):
        return load_gguf_tokenizer(path)
    p = files.as_path(path)
    if p.is_file() and p.suffix == ".model":
        return SentencePieceTokenizer(p)
    if p.is_file() and p.suffix == ".json":
        return HFTokenizer(p)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p)
        if (p / "tokenizer.model").is_file():
            return SentencePieceTokenizer(p / "tokenizer.model")
    what = "does not exist" if not p.exists() else "is not a recognised tokenizer"
    raise ValueError(
        f"tokenizer path {p} {what}; expected a SentencePiece .model file, a tokenizer.json, a "
        "directory containing tokenizer.json or tokenizer.model, or a GGUF model (.gguf file "
        f"or one of {sorted(gguf_file.KNOWN_FILES)})."
    )
