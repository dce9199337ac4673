"""Greedy evaluation episodes, and the run's record of them (`evals.json`).

Each evaluation has a name ("initial", "before_rl", "iter_N", "after_rl") and a seed offset
(`EVAL_SEEDS`) folded into the run's key, so a resumed run evaluates with the same keys and
never repeats an evaluation it has recorded.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from bpo_jax.metrics import MetricWriter, progress
from bpo_jax.rollout import play, success_rate

log = logging.getLogger(__name__)

# Seed offsets of the named evaluations (folded into the run's PRNG key). Periodic
# evaluations after RL iteration N use `EVAL_SEEDS["iter"] + N - 1`.
EVAL_SEEDS = {"initial": 10_000, "before_rl": 20_000, "iter": 30_000, "after_rl": 40_000}


def evaluate(pool, policy, tasks, cfg, rng, label: str) -> dict:
    """Greedy episodes, one per task; success rate and friends."""
    if not tasks:
        return {}
    t0 = time.time()
    bar = progress(len(tasks), desc=f"eval ({label})", unit="episode")
    trajs, _ = play(
        pool,
        policy,
        tasks,
        1,
        rng=rng,
        greedy=True,
        history_turns=cfg.agent.history_turns,
        max_prompt_tokens=cfg.agent.max_prompt_tokens,
        progress_bar=bar,
    )
    bar.close()
    invalid = [s.invalid for t in trajs for s in t.steps]
    out = {
        "eval/success": success_rate(trajs),
        "eval/return": float(np.mean([t.total_reward for t in trajs])),
        "eval/episode_len": float(np.mean([len(t.steps) for t in trajs])),
        "eval/invalid_frac": float(np.mean(invalid)) if invalid else 0.0,
        "eval/num_episodes": len(trajs),
        "eval/seconds": time.time() - t0,
    }
    log.info(
        "eval %-10s success %.3f over %d episodes (%.0fs)",
        label,
        out["eval/success"],
        len(trajs),
        out["eval/seconds"],
    )
    return out


class EvalLog:
    """Evaluation results of this run, persisted to `evals.json` as they come."""

    def __init__(self, path: Path, resume: bool, writer: MetricWriter):
        self.path = path
        self.writer = writer
        self.results = json.loads(path.read_text()) if resume and path.exists() else {}

    def __contains__(self, name):
        return name in self.results

    def record(self, name: str, result: dict, step: int):
        self.results[name] = result
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2))
        tmp.replace(self.path)
        self.writer.write(step, {k.replace("eval/", f"eval_{name}/"): v for k, v in result.items()})

    def success(self, name):
        return self.results.get(name, {}).get("eval/success")
