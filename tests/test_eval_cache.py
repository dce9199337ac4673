"""Evaluations shared between runs (`eval.cache_dir`): what the fingerprint depends on, and two
runs from one start that reuse each other's identical evaluations."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

from bpo_jax.config import validate
from bpo_jax.io.eval_cache import EvalCache, fingerprint
from tests.test_experiments import tiny_cpu_config


def _key(params, cfg, rng, greedy=False, tasks=("a", "b"), salt=b""):
    return fingerprint(params, list(tasks), cfg, rng, greedy, salt)


def test_fingerprint_names_everything_that_decides_the_episodes():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros((3,), jnp.bfloat16)}
    cfg = validate(tiny_cpu_config())
    rng = jax.random.key(0)
    base = _key(params, cfg, rng)
    assert base == _key({"w": jnp.arange(6.0).reshape(2, 3), **params}, cfg, rng)  # Same values.
    changed = [
        _key({**params, "w": params["w"].at[1, 2].add(1e-3)}, cfg, rng),  # One parameter.
        _key({**params, "w": params["w"].reshape(3, 2)}, cfg, rng),  # A shape.
        _key(params, cfg, jax.random.key(1)),  # The key of a sampled evaluation.
        _key(params, cfg, rng, greedy=True),
        _key(params, cfg, rng, tasks=("b", "a")),  # The games, in order.
        _key(params, validate(tiny_cpu_config(**{"sampler.temperature": 0.7})), rng),
        _key(params, validate(tiny_cpu_config(**{"env.max_steps": 5})), rng),
        _key(params, validate(tiny_cpu_config(**{"agent.history_turns": 3})), rng),
        _key(params, validate(tiny_cpu_config(**{"mesh.task_shards": 2})), rng),
        _key(params, cfg, rng, salt=b"another tokenizer"),
    ]
    assert len({base, *changed}) == len(changed) + 1
    # Greedy decoding draws nothing: its key does not matter.
    assert _key(params, cfg, rng, greedy=True) == _key(params, cfg, jax.random.key(7), greedy=True)
    # Settings that do not shape an episode do not matter.
    assert base == _key(params, validate(tiny_cpu_config(**{"train.lr": 1e-3})), rng)


def test_cache_round_trip_marks_reused_results(tmp_path):
    cache = EvalCache(str(tmp_path / "c"), salt=b"t")
    assert cache.get("0" * 64) is None
    cache.put("0" * 64, {"eval/success": 0.5, "eval/cached": 0.0})
    assert cache.get("0" * 64) == {"eval/success": 0.5, "eval/cached": 1.0}


def test_runs_from_one_start_reuse_identical_evaluations(tmp_path):
    """A BC run, then two evaluation-only runs (GRPO, RLOO) from its policy, sharing a cache:
    each evaluation of the same episodes is played once. (Which changes make another key:
    `test_fingerprint_names_everything_that_decides_the_episodes`.)"""
    from bpo_jax.train import train_and_evaluate

    cache = str(tmp_path / "cache")
    bc_dir = tmp_path / "bc"
    train_and_evaluate(
        tiny_cpu_config(
            **{"train.iterations": 0, "eval.num_tasks": 1, "eval.sampled": True,
               "eval.initial": False, "eval.cache_dir": cache}
        ),
        bc_dir,
    )  # fmt: skip
    evals = {"bc": json.loads((bc_dir / "evals.json").read_text())}
    for algo in ("grpo", "rloo"):
        cfg = tiny_cpu_config(
            **{"train.algo": algo, "train.iterations": 0, "eval.num_tasks": 1,
               "eval.sampled": True, "eval.cache_dir": cache}
        )  # fmt: skip
        cfg.init_from = str(bc_dir)
        train_and_evaluate(cfg, tmp_path / algo)
        evals[algo] = json.loads((tmp_path / algo / "evals.json").read_text())
    bc, grpo, rloo = evals["bc"], evals["grpo"], evals["rloo"]
    # The BC run played its evaluations (after_rl: the same records, no update in between).
    assert all(r["eval/cached"] == 0.0 for r in bc.values())
    # The same policy, games, seed and evaluation names: every later evaluation is reused.
    drop = ("eval/cached", "eval/update_step", "eval/seconds")
    for run in (grpo, rloo):
        assert set(run) == set(bc)
        for name, result in run.items():
            assert result["eval/cached"] == 1.0, name
            assert {k: v for k, v in result.items() if k not in drop} == {
                k: v for k, v in bc[name].items() if k not in drop
            }
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # Greedy, and sampled.
