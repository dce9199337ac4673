"""SentencePiece models: loading, and training one on the environment's own text."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from bpo_jax.io import files
from bpo_jax.tokenizer.base import (
    _SP_MIN_VOCAB,
    SP_BOS_ID,
    SP_EOS_ID,
    SP_PAD_ID,
    SP_UNK_ID,
    Tokenizer,
    _as_id_list,
    _with_specials,
)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file.

    Args:
      model_path: Path to the `.model` file.

    Raises:
      ValueError: If the file is missing or the model has no EOS piece.
    """

    def __init__(self, model_path: str | os.PathLike):
        self.path = files.as_path(model_path)
        if not self.path.is_file():
            raise ValueError(
                f"SentencePiece model {self.path} does not exist; pass the path of a .model file "
                "(train one with train_sentencepiece)."
            )
        # From bytes, so that the file may be in a bucket as well as on the local disk.
        self._sp = spm.SentencePieceProcessor(model_proto=self.path.read_bytes())
        if self._sp.eos_id() < 0:
            raise ValueError(
                f"SentencePiece model {self.path} defines no EOS piece (eos_id=-1); generation "
                "could never stop. Retrain it with an eos_id."
            )
        self._unk_piece = self._sp.id_to_piece(self._sp.unk_id())

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        bos = self._sp.bos_id()
        return bos if bos >= 0 else None

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self.eos_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # SentencePiece never parses control symbols out of text, so a BOS can only come from us.
        return _with_specials(self._sp.encode(text), self.bos_id, self.eos_id, add_bos, add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        return [
            _with_specials(ids, self.bos_id, self.eos_id, add_bos, add_eos)
            for ids in self._sp.encode(list(texts))
        ]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        id_list = _as_id_list(ids)
        size = self.vocab_size
        bad = [i for i in id_list if not 0 <= i < size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {size}); truncate or mask "
                "padded-vocab ids before decoding."
            )
        if skip_special:
            # SentencePiece renders control pieces (pad/bos/eos) as empty strings.
            return self._sp.decode(id_list)
        # Control pieces would vanish in `decode`, so spell them out between decoded runs.
        parts: list[str] = []
        run: list[int] = []
        for i in id_list:
            if self._sp.is_control(i):
                if run:
                    parts.append(self._sp.decode(run))
                    run = []
                parts.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            parts.append(self._sp.decode(run))
        return "".join(parts)

    def token_to_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        # Unknown pieces map to the unk id rather than failing.
        if i == self._sp.unk_id() and piece != self._unk_piece:
            return None
        return i


def _nonempty_texts(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"train_sentencepiece texts must be str, item {i} is {type(text)}.")
        if text:
            yield text


def train_sentencepiece(
    texts: Iterable[str],
    out_prefix: str | os.PathLike,
    vocab_size: int,
    user_defined_symbols: Sequence[str] = (),
    *,
    model_type: str = "bpe",
    seed: int = 0,
    split_digits: bool = True,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model on in-memory text and writes `<out_prefix>.model`.

    Ids are fixed: pad=0, unk=1, bos=2, eos=3, then `user_defined_symbols` (each always one
    token, so turn markers like "<act>" never split), then byte pieces and learned pieces.
    Normalization is off and whitespace is kept verbatim (no dummy prefix, no collapsing), so
    `decode(encode(t)) == t` for any text, and encoding segments separately then concatenating
    gives the same text as the concatenated string; unseen characters fall back to UTF-8 bytes.

    Training is single-threaded with a fixed seed, so the same texts give the same model bytes.

    Args:
      texts: Training text, one sentence or document per item (may contain newlines).
      out_prefix: Output path without the `.model` suffix (a trailing `.model` is accepted).
        Parent directories are created.
      vocab_size: Target vocabulary size. It is a ceiling, not exact: small corpora produce fewer
        pieces instead of failing. It must leave room for the 260 reserved pieces and the
        symbols.
      user_defined_symbols: Strings that always encode to a single token.
      model_type: "bpe" or "unigram".
      seed: Seed for SentencePiece's sampling (matters for "unigram").
      split_digits: Every digit is a piece of its own ("drawer 12" is " drawer", " ", "1",
        "2"); False lets frequent numbers and their leading space be learned pieces (" 12").

    Returns:
      The trained tokenizer, loaded from the written file.

    Raises:
      ValueError: If `vocab_size` is too small, `model_type` is unknown, or `texts` is empty.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}.")
    symbols = list(user_defined_symbols)
    if len(set(symbols)) != len(symbols) or any(not s for s in symbols):
        raise ValueError(f"user_defined_symbols must be distinct non-empty strings: {symbols}.")
    min_vocab = _SP_MIN_VOCAB + len(symbols)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: byte fallback and the special ids need "
            f"{_SP_MIN_VOCAB} pieces plus {len(symbols)} user symbols; use at least {min_vocab} "
            "(a few hundred more leaves room for learned pieces)."
        )
    out = files.as_path(out_prefix)
    model_path = out if out.suffix == ".model" else out.with_name(out.name + ".model")
    model_path.parent.mkdir(parents=True, exist_ok=True)

    it = _nonempty_texts(texts)
    try:
        first = next(it)
    except StopIteration:
        raise ValueError("train_sentencepiece got no non-empty texts to train on.") from None

    def sentences() -> Iterator[str]:
        yield first
        yield from it

    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        pad_id=SP_PAD_ID,
        unk_id=SP_UNK_ID,
        bos_id=SP_BOS_ID,
        eos_id=SP_EOS_ID,
        user_defined_symbols=symbols,
        byte_fallback=True,
        # Exact round-trips: no NFKC, keep runs of spaces, and no implicit leading space (which
        # would turn each separately encoded segment into " segment").
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=split_digits,
        # Observations can be long; the default 4192 bytes would silently drop them.
        max_sentence_length=1 << 16,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    files.write_bytes(model_path, buf.getvalue())
    return SentencePieceTokenizer(model_path)


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# --------------------------------------------------------------------------------------------

# Fallbacks when no config file names the special tokens, in order of preference.
