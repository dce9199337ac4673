"""What a run reads and writes: run files (local or `gs://`), checkpoints, metrics, caches.

The bottom layer: plain storage, no model, no environment.

May import: nothing from bpo_jax.

Modules: `files` (one path type, atomic writes), `checkpoint` (Orbax checkpoints of the whole
run), `metrics` (JSON lines, TensorBoard, progress bars), `eval_cache` (evaluations shared
between runs that would play the same episodes), `gguf_file` (llama.cpp's one-file checkpoints:
found by path or by name in an installed package, opened, their metadata read).
"""
