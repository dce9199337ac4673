"""Set-up the tests share: subprocesses (a script that reports one RESULT line, processes run side
by side as the hosts of one job) and the small models most tests train."""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_together(
    commands: Sequence[Sequence[str]], *, timeout: float
) -> tuple[list[subprocess.Popen], list[str]]:
    """Runs the commands side by side in the repository (with `repo_env()`), to the end.

    Returns:
        The processes (each has exited) and their outputs, stdout and stderr merged. On the way
        out (a timeout included) a process still running is killed.
    """
    procs = [
        subprocess.Popen(
            list(command),
            cwd=REPO,
            env=repo_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs


def run_script_result(script: str, *, timeout: float):
    """Runs `python -c script` on the CPU platform; returns the JSON of the one line it prints
    that starts with "RESULT " (the test fails if it exits non-zero or prints no such line or
    several)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    return json.loads(lines[0][len("RESULT ") :])


def word_tokenizer(words: Sequence[str], path: Path, vocab_size: int, *, words_per_line: int):
    """A SentencePiece tokenizer, the agent's special symbols included, trained at `path` on 300
    lines of `words` drawn at random (seed 0), each line ending in its number."""
    import numpy as np

    from bpo_jax.agent import SPECIAL_SYMBOLS
    from bpo_jax.tokenizer import train_sentencepiece

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=words_per_line)) + f" {i}" for i in range(300)]
    return train_sentencepiece(texts, path, vocab_size, user_defined_symbols=SPECIAL_SYMBOLS)


def random_tiny_policy(tok, *, embed_scale: float | None = None, **policy_options):
    """The tiny decoder with random weights (seed 0, `max_seq_len` 256) over `tok`, as a
    `Policy` with `policy_options`; `embed_scale` multiplies the embeddings (larger ones make
    the random policy's entropies vary from context to context)."""
    import jax
    from flax import nnx

    from bpo_jax.models import config as model_config
    from bpo_jax.models.llama import Transformer
    from bpo_jax.sampler.policy import Policy

    cfg = model_config.tiny(vocab_size=tok.vocab_size, max_seq_len=256)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    if embed_scale is not None:
        params = jax.tree.map_with_path(
            lambda p, x: x * (embed_scale if "embed" in jax.tree_util.keystr(p) else 1.0), params
        )
    return Policy(graphdef, params, tok, cfg, **policy_options)


def play_tabular(pool, policy, tasks, spec, *, seed: int, horizon: int, encode=None, **options):
    """`play_forest` of a tabular policy over a pool of tabular envs: episodes of at most
    `horizon` steps, the budget in env steps, the prompt the state id (`encode_state` unless
    `encode` is given), `rng` from `seed`; `options` are play_forest's others."""
    import jax

    from bpo_jax.rollout.branching import CostModel, LengthModel
    from bpo_jax.rollout.engine import play_forest
    from envs.tabular.policy import encode_state

    rng, lengths, costs = jax.random.key(seed), LengthModel(horizon), CostModel("env_steps")
    encode = encode_state if encode is None else encode
    return play_forest(
        pool, policy, encode, tasks, spec, rng=rng, lengths=lengths, costs=costs, **options
    )


def z_max(samples, target) -> float:
    """The largest |mean - target| in standard errors of the mean over `samples` [N, D]; where
    the samples do not vary, their mean must equal the target (within 1e-9)."""
    import numpy as np

    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    target = np.ravel(target)
    constant = se == 0
    np.testing.assert_allclose(mean[constant], target[constant], atol=1e-9)
    return float(np.max(np.abs(mean[~constant] - target[~constant]) / se[~constant]))


# The learner tests' decoder: two layers, 32 wide (compiles in seconds on a CPU).
_MICRO = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


def micro_model(vocab_size: int, **overrides):
    """(cfg, graphdef, params): the `tiny` preset cut to `_MICRO` (max_seq_len 64), with the
    given overrides, and random weights (seed 0)."""
    from flax import nnx

    from bpo_jax.models.config import tiny
    from bpo_jax.models.llama import Transformer

    cfg = tiny(vocab_size=vocab_size, **_MICRO, max_seq_len=64, **overrides)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


# An experiment's cpu variant shrunk to a run of seconds: two iterations of one training task
# with two rollouts, two training and two evaluation tasks, four BC steps, a checkpoint a step.
SMALL_RUN = {
    "env.num_train_tasks": 2,
    "eval.num_tasks": 2,
    "bc.steps": 4,
    "bc.batch_size": 8,
    "train.iterations": 2,
    "train.tasks_per_iter": 1,
    "train.group_size": 2,
    "train.minibatch_size": 8,
    "model.max_seq_len": 256,
    "checkpoint.every": 1,
}


def set_fields(cfg, fields):
    """Sets `fields` ({"section.name": value}) on the ConfigDict `cfg`; returns `cfg`."""
    for key, value in fields.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return cfg


def compile_report(tmp_path: Path, *flags: str):
    """The compile tool (`python -m bpo_jax.compile compile`) on the tiny ALFWorld setting with
    `flags`: (its exit status, the JSON report it wrote)."""
    from bpo_jax import compile as compile_tool

    out = tmp_path / "report.json"
    rc = compile_tool.main(
        ["compile", "--config=experiments/alfworld.py:cpu", *flags, f"--json={out}"]
    )
    return rc, json.loads(out.read_text())
