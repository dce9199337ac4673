"""Reading run records: what `bpo_jax.main` (and the probe) leave in a run's workdir.

The schema is documented at the top of `bpo_jax/study/tables.py`, which is what reads it. A run
folder is any folder with `config.json` and `summary.json`; a sweep names its runs
`<group>/seed_<n>`, where the group is the algorithm, or the algorithm and an ablation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence

import numpy as np
from etils import epath

from bpo_jax.io import files
from bpo_jax.io.metrics import (
    BRANCH_PARTS_FILE,
    BRANCH_STEP_PREFIX,
    METRICS_FILE,
    read_json_lines,
    read_metrics,
)
from bpo_jax.rollout.explained import DEPTH_PARTS, PARTS_PREFIX

_SEED_DIR = re.compile(r"seed_\d+")
BC_FOLDER = (
    "bc"  # Where a sweep keeps its behaviour-cloning starts (`bpo_jax.study.sweep.BC_GROUP`).
)
_ITER = re.compile(r"iter_(\d+)")


@dataclasses.dataclass
class RunRecord:
    """One run's record, as read from its folder."""

    path: epath.Path
    group: str  # The row of the tables: algorithm, or `<algo>_<ablation>` for a sweep's ablation.
    seed: int
    config: dict
    summary: dict
    evals: dict
    metrics: list[dict]
    probe: dict | None
    branch_parts: list[dict] = dataclasses.field(default_factory=list)  # `f_parts_of`'s input.

    @property
    def env(self) -> str:
        return self.config.get("env", {}).get("name", "unknown")

    @property
    def tasks_per_iter(self) -> int:
        return int(self.config.get("train", {}).get("tasks_per_iter", 1))

    def splits(self, point: str) -> list[str]:
        """The evaluation splits of point `point` (e.g. 'after_rl'): per-split names, or one."""
        per_split = sorted(k.split("/", 1)[1] for k in self.evals if k.startswith(point + "/"))
        if per_split:
            return per_split
        if point in self.evals:
            return [self.default_split]
        return []

    @property
    def default_split(self) -> str:
        return str(
            self.summary.get("eval_split") or self.config.get("env", {}).get("eval_split", "")
        )

    def entry(self, point: str, split: str) -> dict | None:
        """The evaluation result of `point` on `split`, under either naming."""
        if f"{point}/{split}" in self.evals:
            return self.evals[f"{point}/{split}"]
        if split == self.default_split and point in self.evals:
            return self.evals[point]
        return None

    def episodes(self, point: str, splits: Sequence[str]) -> list[np.ndarray] | None:
        """Per-split arrays of per-episode success at `point`; None if a split lacks them."""
        out = []
        for split in splits:
            e = self.entry(point, split)
            if e is None or "eval/episodes" not in e:
                return None
            out.append(np.asarray(e["eval/episodes"], np.float64))
        return out

    def success(self, point: str, splits: Sequence[str]) -> tuple[float, int] | None:
        """(success over the splits' episodes pooled, number of episodes), or None if missing."""
        eps = self.episodes(point, splits)
        if eps is not None:
            pooled = np.concatenate(eps) if eps else np.zeros(0)
            return (float(pooled.mean()), int(pooled.size)) if pooled.size else None
        total, n = 0.0, 0
        for split in splits:
            e = self.entry(point, split)
            if e is None or "eval/success" not in e:
                return None
            k = int(e.get("eval/num_episodes", 1))
            total, n = total + float(e["eval/success"]) * k, n + k
        return (total / n, n) if n else None

    def eval_points(self) -> list[str]:
        """Names of the evaluation points of RL, in order: before_rl, iter_N..., after_rl."""
        bases = {k.split("/", 1)[0] for k in self.evals}
        iters = sorted(int(m.group(1)) for b in bases if (m := _ITER.fullmatch(b)))
        points = ["before_rl"] if "before_rl" in bases else []
        points += [f"iter_{n}" for n in iters]
        return points + (["after_rl"] if "after_rl" in bases else [])

    def iteration_of(self, point: str) -> int:
        """The RL iterations done at evaluation point `point`."""
        if point == "before_rl":
            return 0
        if point == "after_rl":
            return int(self.summary.get("iterations", 0))
        return int(_ITER.fullmatch(point).group(1))

    def _step_at_iteration(self) -> dict[int, int]:
        return {
            int(m["train/iteration"]): int(m["step"])
            for m in self.metrics
            if "train/iteration" in m
        }

    def rl_step0(self) -> int:
        """The update step RL starts from (behaviour-cloning steps come before it)."""
        for m in self.metrics:
            if any(k.startswith("eval_before_rl") for k in m):
                return int(m["step"])
        return int(self.config.get("bc", {}).get("steps", 0))

    def updates_at(self, point: str) -> int | None:
        """RL policy updates done at evaluation point `point`, from the metrics' steps."""
        it = self.iteration_of(point)
        if it == 0:
            return 0
        step = self._step_at_iteration().get(it)
        if step is None and point == "after_rl" and "updates" in self.summary:
            step = int(self.summary["updates"])
        return None if step is None else step - self.rl_step0()

    def generated_per_task(self) -> float | None:
        """Mean generated tokens per task over the RL iterations, or None if not recorded."""
        per_iter = [
            float(m["compute/generated_tokens"])
            for m in self.metrics
            if "compute/generated_tokens" in m and "train/iteration" in m
        ]
        return float(np.mean(per_iter)) / self.tasks_per_iter if per_iter else None

    def cumulative_tokens(self) -> dict[int, float]:
        """Iteration -> generated tokens of iterations 1..N."""
        rows = sorted(
            (int(m["train/iteration"]), float(m["compute/generated_tokens"]))
            for m in self.metrics
            if "compute/generated_tokens" in m and "train/iteration" in m
        )
        out, total = {0: 0.0}, 0.0
        for it, tokens in rows:
            total += tokens
            out[it] = total
        return out

    def series(self, key: str) -> list[float]:
        """The values of metric `key`, in file order."""
        return [float(m[key]) for m in self.metrics if key in m]

    def f_parts(self) -> tuple[list[dict], str] | None:
        """f's recorded parts, one column set per RL iteration (`f_parts_of`)."""
        return f_parts_of(self.metrics, self.branch_parts)

    def branch_steps(self) -> list[int]:
        """The step of every branch point of the run, all iterations pooled (empty for records
        written before the per-step counts were)."""
        out: list[int] = []
        for m in self.metrics:
            for key, n in m.items():
                if key.startswith(BRANCH_STEP_PREFIX):
                    out += [int(key[len(BRANCH_STEP_PREFIX) :])] * int(n)
        return out


def _last_per_iteration(records, key: str) -> list[dict]:
    """One record per iteration (`key`), the last written (a resumed run repeats some)."""
    kept = {int(r[key]): r for r in records if key in r}
    return [kept[i] for i in sorted(kept)]


def f_parts_of(metrics: Sequence[dict], branch_parts: Sequence[dict]) -> tuple[list[dict], str]:
    """f's parts as `study.table2a` reads them: one column set per RL iteration.

    From `branch_parts.jsonl` when the run wrote it: its per-(task, depth) sums, every part
    (unit "tasks": an iteration's task is one unit of a bootstrap). Else from the metrics'
    per-iteration sums (`train/f_parts/depth_<d>/...`: branch_points, between, var_return), one
    row per depth with task 0 (unit "iterations"). An iteration without branch points has no
    rows.

    Returns:
      (column sets, unit); ([], "") when the run recorded no f (no tree algorithm, or older).
    """
    if branch_parts:
        rows = _last_per_iteration(branch_parts, "iteration")
        drop = ("iteration", "step")
        return [{k: v for k, v in r.items() if k not in drop} for r in rows], "tasks"
    out = []
    for m in _last_per_iteration(metrics, "train/iteration"):
        if f"{PARTS_PREFIX}branch_points" not in m:
            continue
        per_depth: dict[int, dict[str, float]] = {}
        for key, value in m.items():
            depth, _, name = key[len(PARTS_PREFIX) :].partition("/")
            if key.startswith(PARTS_PREFIX + "depth_") and name in DEPTH_PARTS:
                per_depth.setdefault(int(depth[len("depth_") :]), {})[name] = float(value)
        depths = sorted(per_depth)
        columns = {"task": [0] * len(depths), "depth": depths}
        out.append(columns | {n: [per_depth[d].get(n, 0.0) for d in depths] for n in DEPTH_PARTS})
    return (out, "iterations") if out else ([], "")


def _load_json(path: epath.Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); is the run still writing it?") from e


def read_run(run_dir: str | os.PathLike) -> RunRecord:
    """Reads the record in `run_dir` (config.json and summary.json required)."""
    run_dir = files.as_path(run_dir)
    config = _load_json(run_dir / "config.json")
    name = run_dir.name
    group = run_dir.parent.name if _SEED_DIR.fullmatch(name) else None
    group = group or str(config.get("train", {}).get("algo", "unknown"))
    evals_path, probe_path = run_dir / "evals.json", run_dir / "probe.json"
    parts_path = run_dir / BRANCH_PARTS_FILE
    return RunRecord(
        path=run_dir,
        group=group,
        seed=int(config.get("seed", 0)),
        config=config,
        summary=_load_json(run_dir / "summary.json"),
        evals=_load_json(evals_path) if evals_path.is_file() else {},
        metrics=read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else [],
        probe=_load_json(probe_path) if probe_path.is_file() else None,
        branch_parts=read_json_lines(parts_path) if parts_path.is_file() else [],
    )


@dataclasses.dataclass
class ProbeRecord:
    """A gradient-variance probe's result (`probe.json`) and the seed of its config."""

    path: epath.Path
    seed: int
    probe: dict


def find_probes(root: str | os.PathLike) -> list[ProbeRecord]:
    """Every probe under `root` (recursively): folders with `probe.json` and `config.json`,
    runs' own and a sweep's probes of its starts (`probe/shared`) alike; sorted by path."""
    root = files.as_path(root)
    return [
        ProbeRecord(
            p.parent, int(_load_json(p.parent / "config.json").get("seed", 0)), _load_json(p)
        )  # fmt: skip
        for p in sorted(files.iter_files(root), key=str)
        if p.name == "probe.json" and (p.parent / "config.json").is_file()
    ]


def find_runs(root: str | os.PathLike) -> list[RunRecord]:
    """Every run record under `root` (recursively), sorted by group and seed.

    A sweep's behaviour-cloning starts (`bc/seed_<n>`, `bc/shared`: no RL) are not runs of the
    tables and are left out.

    Raises:
      ValueError: no run under `root`, or two runs of one group with the same seed.
    """
    root = files.as_path(root)
    dirs = sorted(
        p.parent
        for p in files.iter_files(root)
        if p.name == "config.json"
        and (p.parent / "summary.json").is_file()
        and p.parent.parent.name != BC_FOLDER
    )
    if not dirs:
        raise ValueError(f"no run records (config.json + summary.json) under {root}.")
    runs = [read_run(d) for d in dirs]
    seen: dict[tuple[str, int], epath.Path] = {}
    for r in runs:
        key = (r.group, r.seed)
        if key in seen:
            raise ValueError(
                f"two runs of {r.group} with seed {r.seed}: {seen[key]} and {r.path}; "
                "point --runs at one sweep."
            )
        seen[key] = r.path
    return sorted(runs, key=lambda r: (r.group, r.seed))
