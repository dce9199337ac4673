r"""Writes a run's demo cache from episodes already played at a longer step limit.

A run plays its demos once (about 10 s per ALFWorld reset on a busy 2-core machine) and caches
them in its workdir (`bpo_jax.agent.demos.demos_path`). The games are deterministic and an expert's
actions depend only on what the game showed it, so an episode played at step limit L is, cut
to its first M <= L steps, exactly the episode the run would play at limit M (won iff it won
within M steps). This writes that cut, in the order the run lists its training tasks, so a run
started on the same workdir loads it instead of replaying:

  PYTHONPATH=$PWD python bench/seed_demo_cache.py --episodes=search_train_demos_ms100.json \
      --played_max_steps=100 --source=search --workdir=/work/runs/start_policy/search_s300 \
      env.max_steps=30 env.num_train_tasks=0 env.dev_fraction=0.3

The trailing `section.field=value` words are the run's config overrides (values parsed as
Python literals when they are, else kept as strings) on `experiments/alfworld.py:cpu`.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from bpo_jax.agent.demos import demos_path
from bpo_jax.builders import select_tasks
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]


def cut(demo: dict, max_steps: int) -> dict:
    """The episode as a run with step limit `max_steps` plays it."""
    if len(demo["actions"]) <= max_steps:
        return demo
    return {
        **demo,
        "actions": demo["actions"][:max_steps],
        "observations": demo["observations"][:max_steps],
        "won": False,  # Only the last step can win, and it is past the limit.
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", required=True, help="played episodes (JSON list)")
    parser.add_argument("--played_max_steps", type=int, required=True)
    parser.add_argument("--source", default="search", choices=("walkthrough", "search"))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    for item in args.overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        cfg[section][name] = value
    cfg.bc.demos = args.source
    v = validate(cfg)
    train, _ = select_tasks(v)
    played = {d["task_id"]: d for d in json.loads(Path(args.episodes).read_text())}
    missing = [t.task_id for t in train if t.task_id not in played]
    if missing:
        raise SystemExit(f"{len(missing)} training tasks were not played, e.g. {missing[:3]}")
    for t in train:  # An episode stopped by the old limit may have gone on under a longer one.
        d = played[t.task_id]
        if v.env.max_steps > args.played_max_steps <= len(d["actions"]) and not d["won"]:
            raise SystemExit(
                f"{t.task_id} was stopped by max_steps={args.played_max_steps}, fewer than the "
                f"run's env.max_steps={v.env.max_steps}: replay it instead."
            )
    demos = [cut(played[t.task_id], v.env.max_steps) for t in train]
    path = demos_path(Path(args.workdir), args.source)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(demos))
    won = sum(d["won"] for d in demos)
    print(f"{path}: {len(demos)} demos, {won} won within {v.env.max_steps} steps")


if __name__ == "__main__":
    main()
