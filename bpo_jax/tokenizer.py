"""One tokenizer interface over SentencePiece models and Hugging Face `tokenizer.json` files.

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
"""

from __future__ import annotations

import abc
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import tokenizers

# SentencePiece ids fixed by `train_sentencepiece`; id 0 is padding so zero-filled buffers are pad.
SP_PAD_ID = 0
SP_UNK_ID = 1
SP_BOS_ID = 2
SP_EOS_ID = 3
# byte_fallback reserves one piece per byte value on top of pad/unk/bos/eos.
_SP_MIN_VOCAB = 256 + 4


class Tokenizer(abc.ABC):
    """Text <-> token ids, independent of the backend library."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """One past the largest token id (a model's embedding table may be padded larger)."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None for models trained without one (Qwen2)."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """The primary end-of-sequence id (what `encode(..., add_eos=True)` appends)."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Padding id; equals `eos_id` for models that define no pad token."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, `eos_id` first."""
        return (self.eos_id,)

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Encodes one string.

        Args:
          text: The text. Special-token strings in it (such as "<act>") map to their ids.
          add_bos: Prepend `bos_id` (no-op when the model has no BOS or the text already starts
            with it).
          add_eos: Append `eos_id` (no-op when the text already ends with it).

        Returns:
          The token ids.
        """

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """Encodes several strings; see `encode`. Backends override this to batch natively."""
        return [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        """Decodes ids to text without stopping at EOS; the caller truncates first.

        Args:
          ids: A 1-D sequence of token ids (list, NumPy or JAX array).
          skip_special: Drop control tokens (BOS/EOS/PAD) from the text.

        Returns:
          The decoded text.
        """

    @abc.abstractmethod
    def token_to_id(self, piece: str) -> int | None:
        """Returns the id of a vocabulary piece, or None when the piece is not in the vocab."""


def _as_id_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    """Turns lists and NumPy/JAX arrays of ids into a list of Python ints."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(
            f"decode expects a 1-D sequence of token ids, got shape {arr.shape}; "
            "decode each row separately."
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}.")
    return arr.astype(np.int64).tolist()


def _with_specials(
    ids: list[int], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> list[int]:
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    if add_eos and eos is not None and (not ids or ids[-1] != eos):
        ids = [*ids, eos]
    return ids


# --------------------------------------------------------------------------------------------
# SentencePiece
# --------------------------------------------------------------------------------------------


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file.

    Args:
      model_path: Path to the `.model` file.

    Raises:
      ValueError: If the file is missing or the model has no EOS piece.
    """

    def __init__(self, model_path: str | Path):
        self.path = Path(model_path).expanduser().absolute()
        if not self.path.is_file():
            raise ValueError(
                f"SentencePiece model {self.path} does not exist; pass the path of a .model file "
                "(train one with train_sentencepiece)."
            )
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
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
    out_prefix: str | Path,
    vocab_size: int,
    user_defined_symbols: Sequence[str] = (),
    *,
    model_type: str = "bpe",
    seed: int = 0,
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
    out = Path(out_prefix).expanduser().absolute()
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
        split_digits=True,
        # Observations can be long; the default 4192 bytes would silently drop them.
        max_sentence_length=1 << 16,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    model_path.write_bytes(buf.getvalue())
    return SentencePieceTokenizer(model_path)


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# --------------------------------------------------------------------------------------------

# Fallbacks when no config file names the special tokens, in order of preference.
_BOS_GUESSES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_GUESSES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object, got {type(data).__name__}.")
    return data


def _token_text(value: Any) -> str | None:
    """Reads a special token written as a string or as an AddedToken dict {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}; expected a string or dict.")


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ValueError(f"expected a token id or a list of ids, got {value!r}.")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, with special tokens read from the files beside it.

    BOS/EOS/PAD are looked up, first hit wins, in `tokenizer_config.json`, then
    `special_tokens_map.json`, then the ids in `config.json` (and `generation_config.json` for
    extra stop ids). An explicit `"bos_token": null` means the model has no BOS (Qwen2), even
    when `config.json` lists a `bos_token_id`. Without any of these files, BOS is taken from what
    the post-processor prepends, and BOS/EOS from well-known token names.

    Encoding always bypasses the post-processor and adds BOS/EOS itself, so `add_bos=True` gives
    exactly one BOS whatever the post-processor would have done.

    Args:
      path: A `tokenizer.json` file, or the directory that holds it.

    Raises:
      ValueError: If the file is missing, a named special token is not in the vocabulary, or no
        EOS can be found.
    """

    def __init__(self, path: str | Path):
        path = Path(path).expanduser().absolute()
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise ValueError(
                f"no Hugging Face tokenizer at {path}; expected a tokenizer.json file or a "
                "directory containing one."
            )
        self.path = json_path
        self._tok = tokenizers.Tokenizer.from_file(str(json_path))
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

        folder = json_path.parent
        tok_config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        model_config = _read_json(folder / "config.json")
        gen_config = _read_json(folder / "generation_config.json")

        def named(key: str) -> tuple[bool, int | None]:
            """(found, id) for `<key>_token` in the tokenizer config files."""
            for name, config in (
                ("tokenizer_config.json", tok_config),
                ("special_tokens_map.json", special_map),
            ):
                if key + "_token" in config:
                    text = _token_text(config[key + "_token"])
                    if text is None:
                        return True, None
                    tid = self._tok.token_to_id(text)
                    if tid is None:
                        raise ValueError(
                            f"{folder / name} names {key}_token={text!r}, which is not in the "
                            f"vocabulary of {json_path}; fix the config or the tokenizer file."
                        )
                    return True, tid
            return False, None

        def guess(candidates: Sequence[str]) -> int | None:
            for text in candidates:
                tid = self._tok.token_to_id(text)
                if tid is not None:
                    return tid
            return None

        found, bos = named("bos")
        if not found:
            ids = _as_id_tuple(model_config.get("bos_token_id"))
            bos = ids[0] if ids else self._post_processor_bos()
            if bos is None:
                bos = guess(_BOS_GUESSES)
        self._bos = bos

        config_eos = _as_id_tuple(model_config.get("eos_token_id"))
        gen_eos = _as_id_tuple(gen_config.get("eos_token_id"))
        _, eos = named("eos")
        if eos is None:
            eos = (config_eos or gen_eos or (None,))[0]
        if eos is None:
            eos = guess(_EOS_GUESSES)
        if eos is None:
            raise ValueError(
                f"cannot find an EOS token for {json_path}: add a tokenizer_config.json beside it "
                'with "eos_token", or a config.json with "eos_token_id".'
            )
        self._eos = eos
        self._stop_ids = tuple(dict.fromkeys((eos, *config_eos, *gen_eos)))

        _, pad = named("pad")
        if pad is None:
            ids = _as_id_tuple(model_config.get("pad_token_id"))
            pad = ids[0] if ids else eos
        self._pad = pad

    def _post_processor_bos(self) -> int | None:
        """The special token the post-processor puts first, if any (Llama-3 without configs)."""
        enc = self._tok.encode("", add_special_tokens=True)
        if enc.ids and enc.special_tokens_mask[0]:
            return enc.ids[0]
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return _with_specials(ids, self._bos, self._eos, add_bos, add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [_with_specials(e.ids, self._bos, self._eos, add_bos, add_eos) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        return self._tok.decode(_as_id_list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Opens the tokenizer at `path`, choosing the backend from what is there.

    Args:
      path: A SentencePiece `.model` file; a `tokenizer.json` file; or a directory holding a
        `tokenizer.json` (preferred) or a `tokenizer.model`.

    Returns:
      The tokenizer.

    Raises:
      ValueError: If `path` is none of the above.
    """
    p = Path(path).expanduser().absolute()
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
        f"tokenizer path {p} {what}; expected a SentencePiece .model file, a tokenizer.json, or "
        "a directory containing tokenizer.json or tokenizer.model."
    )
