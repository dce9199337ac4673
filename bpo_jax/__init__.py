"""bpo_jax: Branching Policy Optimization for language agents in snapshottable sandboxes.

A reader starts at the top-level modules, the run: `main` (the entry point) -> `train` (set-up,
behaviour cloning, RL, evaluation) -> `rl` (one RL iteration: rollouts, advantages, update),
with `config` and `experiment` (the validated settings), `algorithms` (the registry),
`builders`, `evaluation`, `run_state`, `report` (what a finished run shows: RL's effect with
its interval, its compute, `curves.png`) and `cli` (the command lines' one-line errors);
`compile` is the compile-only tool for TPU slices; `gguf_export` writes a GGUF model as a
Hugging Face checkpoint folder.
Below them, one package per role; imports run only downward, as each package's docstring says
(`tests/test_layout.py` checks it):

  study      sweeps, the paper's tables and figures, the variance probe (drives whole runs)
  multihost  how the hosts of a slice play one batch: shares, lockstep, slice-wide sampling
  rollout    the engine: forests of groups and BPO trees, branch rules, the planner
  learner    losses, the jitted update, PPO's critic
  sampler    the jitted KV-cache sampler and the acting policy over it
  estimators advantage estimators as segment-sum kernels
  agent      turn formats (prompt in, action out) and expert demonstrations
  parallel   JAX's multi-host runtime: processes, shares, meshes, collectives
  models     the Llama / Qwen2 policy network, presets, sharding, HF import
  tokenizer  one tokenizer interface over SentencePiece and HF tokenizers
  io         run files (local or gs://), checkpoints, metrics, caches

The environments (`envs/`) import nothing from bpo_jax.

The run's modules may import: agent, estimators, io, learner, models, multihost, parallel,
rollout, sampler, tokenizer.
"""
