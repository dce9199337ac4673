"""Evaluation episodes, and the run's record of them (`evals.json`).

Each evaluation has a name ("initial", "before_rl", "iter_N", "after_rl") and a seed offset
(`EVAL_SEEDS`) folded into the run's key, so a resumed run evaluates with the same keys and
never repeats an evaluation it has recorded. It plays one greedy episode per task of every
evaluation split (`env.eval_split`, comma-separated), and with `eval.sampled` one sampled
episode per task too. Records, in `evals.json` and the metrics:
  NAME/SPLIT           greedy episodes of one split, with per-episode wins (`eval/episodes`);
  NAME/SPLIT/sampled   sampled episodes of one split;
  NAME                 greedy episodes of every split pooled (the summary's figure).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from etils import epath

from bpo_jax.builders import make_agent
from bpo_jax.io import files
from bpo_jax.io.eval_cache import EvalCache
from bpo_jax.io.metrics import MetricWriter, progress
from bpo_jax.multihost.shares import play_in_shares
from bpo_jax.parallel import distributed
from bpo_jax.rollout.engine import play

log = logging.getLogger(__name__)

# Seed offsets of the named evaluations (folded into the run's PRNG key). Periodic
# evaluations after RL iteration N use `EVAL_SEEDS["iter"] + N - 1`.
EVAL_SEEDS = {"initial": 10_000, "before_rl": 20_000, "iter": 30_000, "after_rl": 40_000}


def evaluate(
    pool, policy, tasks, cfg, rng, label: str, greedy: bool = True, cache: EvalCache | None = None
) -> dict:
    """One episode per task (greedy, or sampled at the policy's temperature); success etc.

    The tasks are played in `mesh.task_shards` shares, each host its own
    (`bpo_jax.multihost.shares`);
    every host returns the result over all of them. With a `cache`, an evaluation of exactly
    these episodes made before (by any run sharing the cache) is reused (`bpo_jax.io.eval_cache`).
    """
    if not tasks:
        return {}
    key = None
    if cache is not None:
        key = cache.key(policy.params, [t.task_id for t in tasks], cfg, rng, greedy)
        hit = cache.get(key)
        if hit is not None:
            log.info("eval %-10s success %.3f (reused %s)", label, hit["eval/success"], key[:12])
            return hit
    t0 = time.time()
    num = distributed.num_shares(cfg.mesh.task_shards)
    slices = distributed.share_slices(len(tasks), num)
    mine = sum(slices[s].stop - slices[s].start for s in distributed.my_shares(num))
    bar = progress(mine, desc=f"eval ({label})", unit="episode")

    def episodes(share_tasks, key, _share, share_policy):
        trajs, _ = play(
            pool,
            share_policy,
            share_tasks,
            1,
            rng=key,
            greedy=greedy,
            agent=make_agent(cfg, share_policy.tokenizer),
            progress_bar=bar,
            cohorts=cfg.rollout.overlap_cohorts,
        )
        return [
            (t.task_id, bool(t.won), t.total_reward, len(t.steps), [s.invalid for s in t.steps])
            for t in trajs
        ]

    played = [e for _, part in play_in_shares(tasks, num, rng, policy, episodes) for e in part]
    bar.close()
    invalid = [i for e in played for i in e[4]]
    out = {
        "eval/success": float(np.mean([e[1] for e in played])),
        "eval/episodes": [int(e[1]) for e in played],
        "eval/task_ids": [e[0] for e in played],
        "eval/return": float(np.mean([e[2] for e in played])),
        "eval/episode_len": float(np.mean([e[3] for e in played])),
        "eval/invalid_frac": float(np.mean(invalid)) if invalid else 0.0,
        "eval/num_episodes": len(played),
        "eval/seconds": time.time() - t0,
        "eval/cached": 0.0,
    }
    log.info(
        "eval %-10s success %.3f over %d episodes (%.0fs)",
        label,
        out["eval/success"],
        len(played),
        out["eval/seconds"],
    )
    if cache is not None:
        cache.put(key, out)
    return out


def pooled(results: list[dict]) -> dict:
    """Several splits' results as one (episode-weighted means; lists concatenated)."""
    results = [r for r in results if r]
    if not results:
        return {}
    n = [r["eval/num_episodes"] for r in results]
    out = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if isinstance(values[0], list):
            out[key] = [v for vs in values for v in vs]
        elif key == "eval/update_step":
            out[key] = values[0]
        elif key in ("eval/num_episodes", "eval/seconds"):
            out[key] = sum(values)
        else:
            out[key] = float(np.average(values, weights=n))
    return out


class EvalLog:
    """Evaluation results of this run, persisted to `evals.json` as they come."""

    def __init__(self, path: epath.Path, resume: bool, writer: MetricWriter, splits=()):
        self.path = path
        self.splits = tuple(splits)  # An evaluation counts as recorded once all splits are.
        self.writer = writer
        results = json.loads(path.read_text()) if resume and path.exists() else {}
        # Process 0's record on every host, so that all of them skip (or run) the same ones.
        self.results = distributed.allgather_objects(results)[0]

    def __contains__(self, name):
        return name in self.results and all(
            f"{name}/{split}" in self.results for split in self.splits
        )

    def step_of(self, name: str) -> int | None:
        """The update step evaluation `name` was recorded at (None: not recorded)."""
        if name not in self.results:
            return None
        return self.results[name].get("eval/update_step")

    def record(self, name: str, result: dict, step: int):
        result = {**result, "eval/update_step": int(step)}
        self.results[name] = result
        if distributed.is_lead():  # Every host holds the same results; one writes them.
            files.write_text(self.path, json.dumps(self.results, indent=2))
        scalars = {k: v for k, v in result.items() if not isinstance(v, list)}
        prefix = "eval_" + name.replace("/", "_")
        self.writer.write(step, {k.replace("eval/", f"{prefix}/"): v for k, v in scalars.items()})

    def success(self, name):
        return self.results.get(name, {}).get("eval/success")
