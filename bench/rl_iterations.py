r"""What each RL iteration of a run played and learnt: its tasks, how the greedy policy did on
them before and after RL, and the iteration's metrics (docs/rl_at_cpu_scale.md).

  PYTHONPATH=$PWD python bench/rl_iterations.py RUN_DIR [RUN_DIR ...]

Reads RUN_DIR's config.json, evals.json and metrics.jsonl; the iteration's tasks are redrawn
as `bpo_jax.train.iteration_tasks` draws them (the config's seed, the training games). Prints
one row per iteration: the drawn games (indices into the training games), the greedy wins on
them before and after RL, rollout success, the update's gradient norm and parameter norm, the
mean token entropy of the rows with a nonzero advantage, spend / budget and branch points.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_collections
import numpy as np

from bpo_jax.builders import select_tasks
from bpo_jax.config import validate
from bpo_jax.io.metrics import read_metrics


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def report(run: Path) -> None:
    raw = json.loads((run / "config.json").read_text())
    cfg = validate(ml_collections.ConfigDict(raw))
    train, _ = select_tasks(cfg)
    evals = json.loads((run / "evals.json").read_text())
    won = {
        name: dict(zip(evals[name]["eval/task_ids"], evals[name]["eval/episodes"], strict=True))
        for name in ("before_rl", "after_rl")
        if name in evals
    }
    records = {r["train/iteration"]: r for r in read_metrics(run) if "train/iteration" in r}
    print(f"{run}: {cfg.train.algo}, lr {cfg.train.lr:g}, {len(train)} training games")
    print("iter  games              before after  rollout  grad   param     entropy spend  bp")
    for it in sorted(records):
        r = records[it]
        rng = np.random.default_rng([cfg.seed, it - 1])  # As train.iteration_tasks draws them.
        n = len(train)
        picked = rng.choice(n, size=cfg.train.tasks_per_iter, replace=n < cfg.train.tasks_per_iter)
        ids = [train[i].task_id for i in picked]
        wins = {k: sum(v.get(t, 0) for t in ids) for k, v in won.items()}
        print(
            f"{it:>4}  {str(sorted(int(i) for i in picked)):<18} "
            f"{wins.get('before_rl', '-')!s:>4}/{len(ids)} {wins.get('after_rl', '-')!s:>3}/"
            f"{len(ids)}  {r['train/success']:.3f}    {r.get('train/grad_norm_mean', 0):.3f}  "
            f"{r.get('train/param_norm_mean', 0):.4f}  {_fmt(r.get('train/entropy_mean'))}   "
            f"{_fmt(r.get('compute/spend_ratio'), '.2f')}   {r.get('train/branch_points', 0)}"
        )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        report(Path(arg))
