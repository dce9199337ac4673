"""Exports a GGUF model as a Hugging Face checkpoint folder, for `model.hf_checkpoint`.

    python -m bpo_jax.gguf_export smollm2_135m_instruct /path/to/folder [--dtype=bfloat16]

writes `config.json` and `model.safetensors` (the weights dequantized, q/k un-permuted:
`bpo_jax.models.gguf`) and `tokenizer.json` and `tokenizer_config.json` with the chat template
(`bpo_jax.tokenizer.gguf`). The folder then runs as any checkpoint
(`--config.model.hf_checkpoint=/path/to/folder`), and transformers reads it with
`from_pretrained(folder)`.
"""

from __future__ import annotations

import argparse
import os

from bpo_jax.models.config import ModelConfig
from bpo_jax.models.gguf import export_model_files
from bpo_jax.tokenizer.gguf import write_tokenizer_files


def export_hf(
    name_or_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32"
) -> ModelConfig:
    """Writes the four files of a Hugging Face checkpoint for a GGUF model; returns its config.

    Args:
      name_or_path: a `.gguf` path or a known name (`bpo_jax.io.gguf_file.KNOWN_FILES`).
      out_dir: the folder (created).
      dtype: float32 | bfloat16 | float16, the stored dtype of the weights.
    """
    cfg = export_model_files(name_or_path, out_dir, dtype)
    write_tokenizer_files(name_or_path, out_dir)
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bpo_jax.gguf_export", description=__doc__)
    parser.add_argument("gguf", help="a .gguf path or a known name (smollm2_135m_instruct)")
    parser.add_argument("out_dir", help="the folder to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    cfg = export_hf(args.gguf, args.out_dir, args.dtype)
    print(f"wrote {args.out_dir}: {cfg}")


if __name__ == "__main__":
    main()
