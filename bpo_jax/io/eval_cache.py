"""Evaluation results shared between runs that would play exactly the same episodes.

In a sweep every algorithm of a seed starts RL from one policy, so their before-RL evaluations
play identical episodes: the same parameters, the same games, the same keys. On the CPU tables
one evaluation (90 held-out games, greedy and sampled, up to 32 steps) costs about as much as
ten RL iterations, so the sweep shares them (`eval.cache_dir`, set by `bpo_jax.study.sweep`).

A result is stored under a SHA-256 of everything that decides the episodes:
  - the policy's parameters (every leaf's dtype, shape and bytes);
  - the evaluated tasks' ids, in order, and greedy or sampled;
  - for sampled episodes, the PRNG key's data (greedy decoding draws nothing);
  - the config sections that shape an episode: `env`, `agent`, `sampler`, `model`, and the
    number of task shares (`mesh.task_shards`, which splits the key);
  - the run's tokenizer (`salt`: its trained model file's bytes, or the configured path).
A result says whether it was reused (`eval/cached`: 1.0, else 0.0; pooled over splits, the share
of episodes reused); a reused one's `eval/seconds` is the time the original evaluation took.
One process only: fingerprinting reads every parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np

from bpo_jax.io import files

__all__ = ["EvalCache", "fingerprint"]


def fingerprint(params, task_ids, cfg, rng, greedy: bool, salt: bytes = b"") -> str:
    """The SHA-256 (hex) naming one evaluation's episodes (see the module docstring)."""
    h = hashlib.sha256(salt)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    shaping = {
        name: dataclasses.asdict(getattr(cfg, name))
        for name in ("env", "agent", "sampler", "model")
    }
    if shaping["sampler"].get("prefix_reuse", True):
        # The default, left out so that results stored before the option existed still match.
        shaping["sampler"].pop("prefix_reuse", None)
    shaping["task_shards"] = cfg.mesh.task_shards
    h.update(json.dumps(shaping, sort_keys=True, default=str).encode())
    h.update(json.dumps([list(task_ids), bool(greedy)]).encode())
    if not greedy:
        h.update(np.asarray(jax.random.key_data(rng)).tobytes())
    return h.hexdigest()


class EvalCache:
    """A folder of `<fingerprint>.json` evaluation results (local or `gs://`)."""

    def __init__(self, root: str, salt: bytes = b""):
        if jax.process_count() > 1:
            raise ValueError(
                f"config.eval.cache_dir={root!r} works in one process only (fingerprinting reads "
                f"every parameter); this run has {jax.process_count()}: set it to ''."
            )
        self.root = files.as_path(root)
        self.salt = salt
        self.root.mkdir(parents=True, exist_ok=True)

    def key(self, params, task_ids, cfg, rng, greedy: bool) -> str:
        return fingerprint(params, task_ids, cfg, rng, greedy, self.salt)

    def get(self, key: str) -> dict | None:
        path = self.root / f"{key}.json"
        if not path.exists():
            return None
        return {**json.loads(path.read_text()), "eval/cached": 1.0}

    def put(self, key: str, result: dict) -> None:
        files.write_text(self.root / f"{key}.json", json.dumps(result))
