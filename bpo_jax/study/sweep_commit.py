"""What a sweep writes down: every run's status (`<workdir>/sweep.json`), whether a run is
finished, and the committed records (`--commit_to`), where a finished record is never overwritten
and a re-run start must reproduce its own.
"""

from __future__ import annotations

import datetime
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from bpo_jax.study.sweep_plan import Run

MANIFEST = "sweep.json"
# The small JSON record of a run that `--commit_to` copies (probe.json only where present).
RECORD_FILES = ("config.json", "summary.json", "evals.json", "metrics.jsonl", "probe.json")


def is_finished(run_dir: Path, iterations: int, probe: bool = False) -> bool:
    """Whether the run in `run_dir` has written its summary after `iterations` iterations (a
    probe: its probe.json)."""
    if probe:
        return (run_dir / "probe.json").is_file()
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return summary.get("iterations") == iterations


def commit_record(run_dir: Path, dest: Path) -> list[str]:
    """Copies the run's small JSON record into `dest`; returns the file names copied."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in RECORD_FILES:
        src = run_dir / name
        if src.is_file():
            shutil.copy2(src, dest / name)
            copied.append(name)
    return copied


def _timing_key(key: str) -> bool:
    """Keys of a metric record that differ between identical runs: clocks and cache hits."""
    return key == "time" or key.startswith("time/") or key.endswith(("seconds", "/cached"))


def record_difference(run_dir: Path, record_dir: Path) -> str | None:
    """Where a run's metrics.jsonl first differs from a committed record's (timings and cache
    hits aside), in words; None where they agree."""

    def load(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [{k: v for k, v in r.items() if not _timing_key(k)} for r in rows]

    ran, committed = load(run_dir / "metrics.jsonl"), load(record_dir / "metrics.jsonl")
    for i, (a, b) in enumerate(zip(ran, committed)):
        if a != b:
            key = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[0]
            return (
                f"metric record {i} (step {a.get('step')}) differs from the committed one: "
                f"{key} {a.get(key)!r} against {b.get(key)!r}"
            )
    if len(ran) != len(committed):
        return f"{len(ran)} metric records against {len(committed)} committed"
    return None


def now() -> str:
    """The time in UTC, to the second: the manifest's and the run logs' clock."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Manifest:
    """`<workdir>/sweep.json`: every run's command and status, rewritten atomically on change."""

    def __init__(self, workdir: Path, sweep_path: str, runs: Sequence[Run], module: str):
        self.path = workdir / MANIFEST
        old = {}
        if self.path.is_file():
            old = {r["name"]: r for r in json.loads(self.path.read_text()).get("runs", [])}
        self.data = {"sweep": str(sweep_path), "module": module, "updated": now(), "runs": []}
        self.entries = {}
        for run in runs:
            prev = old.get(run.name, {})
            entry = {
                "name": run.name,
                "algo": run.algo,
                "seed": run.seed,
                "ablation": run.ablation,
                "command": run.command(workdir, module),
                "status": prev.get("status", "pending"),
                "returncode": prev.get("returncode"),
                "attempts": prev.get("attempts", 0),
                "wall_seconds": prev.get("wall_seconds", 0.0),
                "started": prev.get("started"),
                "finished": prev.get("finished"),
            }
            self.data["runs"].append(entry)
            self.entries[run.name] = entry

    def update(self, name: str, **fields) -> None:
        self.entries[name].update(fields)
        self.data["updated"] = now()
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


class CommittedRecords:
    """The records under `--commit_to` (none when it is unset): which runs they finish, copying a
    finished run's record in, and whether a start re-run here reproduces its committed record.

    Args:
      commit_to: the records' folder, or None.
      workdir: the sweep's folder.
      runs: the sweep's runs.
      finished: `fn(run, folder) -> bool`, whether `folder/<run name>` holds the finished run.
      allow_changed_start: a re-run start that does not reproduce its record still starts its
        runs (with a warning).
    """

    def __init__(
        self,
        commit_to: str | Path | None,
        workdir: Path,
        runs: Sequence[Run],
        finished: Callable[[Run, Path], bool],
        allow_changed_start: bool = False,
    ):
        self.commit_to, self.workdir = commit_to, workdir
        self.allow_changed_start = allow_changed_start
        # Finished records already committed are never overwritten: a start re-run on a fresh
        # machine (for its checkpoint) keeps the record its runs were paired with.
        self.recorded = {r.name for r in runs if commit_to and finished(r, Path(commit_to))}
        self.starts = {r.init_from for r in runs if r.init_from}

    def finished_elsewhere(self, runs: Sequence[Run], here: set[str]) -> set[str]:
        """The runs finished on another machine (their record is committed, their workdir is
        gone), less the starts that a run not finished still needs."""
        if not self.commit_to:
            return set()
        committed = {name for name in self.recorded if name not in here}
        # A start's record is not its checkpoint: it runs again while a run still needs it.
        needed = {r.init_from for r in runs if r.name not in here | committed and r.init_from}
        return committed - needed

    def commit(self, run: Run) -> str:
        """Copies the finished run's record in, unless a finished one is there already; returns
        the words that say it was kept ('' otherwise, and without `commit_to`)."""
        if not self.commit_to:
            return ""
        if run.name in self.recorded:
            return f"; its committed record in {self.commit_to} is kept"
        commit_record(self.workdir / run.name, Path(self.commit_to) / run.name)
        return ""

    def changed_start(self, run: Run, warn: Callable[[str], None]) -> str | None:
        """Why a start that ran here does not stand in for its committed record, or None (with
        `allow_changed_start`, the difference goes to `warn` instead)."""
        if not self.commit_to or run.name not in self.recorded or run.name not in self.starts:
            return None
        diff = record_difference(self.workdir / run.name, Path(self.commit_to) / run.name)
        if diff is None:
            return None
        if self.allow_changed_start:
            warn(f"WARNING: {diff}; its runs start from it (--allow_changed_start)")
            return None
        return (
            f"{diff}: its runs would not start from the policy the committed runs started "
            "from (XLA's CPU arithmetic differs between machines). Run the sweep on a machine "
            "like the one that made the record, commit to a new folder, or pass "
            "--allow_changed_start"
        )
