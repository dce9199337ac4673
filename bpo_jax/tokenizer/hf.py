"""Hugging Face `tokenizer.json` files (with `tokenizer_config.json` for special tokens)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from etils import epath

from bpo_jax.io import files
from bpo_jax.tokenizer.base import Tokenizer, _as_id_list, _with_specials
from bpo_jax.tokenizer.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate

_BOS_GUESSES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_GUESSES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
# The files beside a tokenizer.json that name its special tokens.
_CONFIG_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
)


def _read_json(path: epath.Path) -> dict[str, Any]:
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

    The checkpoint's chat template (`chat_template`, compiled on first use) is rendered with the
    special tokens the two config files name (`special_tokens`), as transformers renders it.

    Encoding always bypasses the post-processor and adds BOS/EOS itself, so `add_bos=True` gives
    exactly one BOS whatever the post-processor would have done.

    Args:
      path: A `tokenizer.json` file, or the directory that holds it.

    Raises:
      ValueError: If the file is missing, a named special token is not in the vocabulary, or no
        EOS can be found.
    """

    def __init__(self, path: str | os.PathLike):
        path = files.as_path(path)
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise ValueError(
                f"no Hugging Face tokenizer at {path}; expected a tokenizer.json file or a "
                "directory containing one."
            )
        folder = json_path.parent
        # From the text, so that the file may be in a bucket as well as on the local disk.
        self._setup(
            json_path.read_text(encoding="utf-8"),
            json_path,
            folder,
            {name: _read_json(folder / name) for name in _CONFIG_FILES},
        )

    @classmethod
    def from_data(
        cls,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any],
        origin: str | os.PathLike,
        model_config: Mapping[str, Any] | None = None,
    ) -> HFTokenizer:
        """A tokenizer from the contents of the files rather than the files (a GGUF's).

        Args:
          tokenizer_json: The text of a `tokenizer.json`.
          tokenizer_config: What `tokenizer_config.json` would hold (special tokens, template).
          origin: Where the data came from (`path`, and messages).
          model_config: What `config.json` would hold (token ids), if anything.
        """
        self = cls.__new__(cls)
        configs = {name: {} for name in _CONFIG_FILES}
        configs["tokenizer_config.json"] = dict(tokenizer_config)
        configs["config.json"] = dict(model_config or {})
        self._setup(tokenizer_json, files.as_path(origin), None, configs)
        return self

    def _setup(
        self,
        tokenizer_json: str,
        origin: epath.Path,
        folder: epath.Path | None,
        configs: dict[str, dict[str, Any]],
    ) -> None:
        """Reads the tokenizer and its special tokens (see the class docstring).

        Args:
          tokenizer_json: The `tokenizer.json` text.
          origin: The file it came from (messages).
          folder: The folder of the config files (a `chat_template.jinja` there wins), or None.
          configs: Each of `_CONFIG_FILES` to its contents ({} when absent).
        """
        self.path = origin
        self._folder = folder
        self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

        tok_config = configs["tokenizer_config.json"]
        special_map = configs["special_tokens_map.json"]
        self._tok_config = tok_config
        # What a chat template sees as `bos_token`, `eos_token`, ...: the config's strings, the
        # tokenizer config first (transformers reads it over special_tokens_map.json).
        self._special_tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            for config in (tok_config, special_map):
                if name in config:
                    text = _token_text(config[name])
                    if text is not None:
                        self._special_tokens[name] = text
                    break
        self._chat_template: ChatTemplate | None = None
        model_config = configs["config.json"]
        gen_config = configs["generation_config.json"]

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
                        where = folder / name if folder is not None else f"{origin} ({name})"
                        raise ValueError(
                            f"{where} names {key}_token={text!r}, which is not in the "
                            f"vocabulary of {origin}; fix the config or the tokenizer file."
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
                f"cannot find an EOS token for {origin}: add a tokenizer_config.json beside it "
                'with "eos_token", or a config.json with "eos_token_id".'
            )
        self._eos = eos
        self._stop_ids = tuple(dict.fromkeys((eos, *config_eos, *gen_eos)))

        _, pad = named("pad")
        if pad is None:
            ids = _as_id_tuple(model_config.get("pad_token_id"))
            pad = ids[0] if ids else eos
        self._pad = pad

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (`bos_token`, `eos_token`, ...) to their strings; unset ones left
        out (what `transformers`' `special_tokens_map` gives a chat template)."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template`), or None when it has none (a base model)."""
        if self._chat_template is None:
            if self._folder is None:
                self._chat_template = ChatTemplate.from_config(
                    self._tok_config, self._special_tokens, f"{self.path} (chat_template)"
                )
            else:
                self._chat_template = ChatTemplate.from_folder(
                    self._folder, self._tok_config, self._special_tokens
                )
        return self._chat_template

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
