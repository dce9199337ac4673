r"""The searching demonstrator on real ALFWorld games: win rate, episode lengths, step limit.

Plays `envs.alfworld.search_expert.SearchExpert` (and, for comparison, the walkthroughs) on the
training games of the CPU task types through the sandbox pool, at a step limit high enough that
the limit decides nothing, and reports per source: wins, the episode-length distribution of the
won episodes (min, median, 90th, 95th percentile, max), and the share of wins that would finish
within each candidate `env.max_steps`.

  PYTHONPATH=$PWD python bench/bench_search_expert.py --split=train --max_steps=100 \
      --json=/work/runs/start_policy/search_expert_train.json

The played episodes go to `--demos` (the same records `bpo_jax.agent.demos` caches) when given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bpo_jax.agent.demos import play_search, play_walkthroughs
from envs.alfworld import load_tasks
from envs.alfworld.search_expert import SUPPORTED_TASK_TYPES
from envs.sandbox import SandboxPool

LIMITS = (12, 16, 20, 24, 30, 40, 50)


def summarise(demos: list[dict]) -> dict:
    """Wins and the length distribution of the won episodes (steps)."""
    won = [len(d["actions"]) for d in demos if d["won"]]
    out = {"episodes": len(demos), "wins": len(won), "win_rate": len(won) / max(len(demos), 1)}
    if won:
        q = np.percentile(won, [0, 50, 90, 95, 100])
        out["won_length"] = dict(zip(("min", "median", "p90", "p95", "max"), q.tolist()))
        out["won_length_mean"] = float(np.mean(won))
        out["wins_within"] = {str(m): int(sum(n <= m for n in won)) for m in LIMITS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="train")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--num_tasks", type=int, default=0, help="0: every game")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default="")
    parser.add_argument("--demos", default="", help="write the search episodes here")
    parser.add_argument("--skip_walkthroughs", action="store_true")
    args = parser.parse_args()

    tasks = load_tasks(None, args.split, SUPPORTED_TASK_TYPES)
    if args.num_tasks:
        tasks = tasks[: args.num_tasks]
    env_kwargs = {"max_steps": args.max_steps, "strip_welcome": True}
    report = {"split": args.split, "max_steps": args.max_steps, "tasks": len(tasks)}
    with SandboxPool("alfworld", env_kwargs, backend="fork", num_workers=args.workers) as pool:
        t0 = time.time()
        demos = play_search(pool, tasks, "alfworld")
        report["search"] = summarise(demos) | {"seconds": time.time() - t0}
        by_type = {}
        for t in SUPPORTED_TASK_TYPES:
            by_type[t] = summarise([d for d in demos if d["task_id"].split("/")[1].startswith(t)])
        report["search_by_type"] = by_type
        if args.demos:
            Path(args.demos).write_text(json.dumps(demos))
        print(json.dumps(report["search"], indent=1), flush=True)
        if not args.skip_walkthroughs:
            t0 = time.time()
            walk = play_walkthroughs(pool, tasks)
            report["walkthrough"] = summarise(walk) | {"seconds": time.time() - t0}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
