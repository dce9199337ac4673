"""The policy network: the Llama / Qwen2 family as a Flax NNX model, its presets and sharding.

Pure model code: parameters, the forward pass, the KV cache and the import of HF and GGUF
checkpoints.

May import: io.

Modules: `config` (`ModelConfig` and the named presets), `llama` (the model and its cache),
`rope`, `kv_cache`, `axes` and `sharding` (logical axis names and the rules that map them onto a
mesh), `factory` (building a sharded model), `hf_import` and `safetensors_slices` (HF checkpoints,
read slice by slice), `gguf` (llama.cpp GGUF checkpoints, dequantized).
"""
