"""Snapshot and restore latency, and memory per held snapshot, of each sandbox backend on ALFWorld.

For every backend and for episode depths 1, 10 and 30 it plays an ALFWorld game to that depth,
then times `snapshot()`, `fork(handle, 1)` (a restore into a new sandbox) and `clone(sandbox, 1)`
(a copy of the live sandbox: snapshot, fork and release in one call) a few times and reports
medians, and the bytes a held snapshot costs (`stats()["snapshot_bytes"]` after the live
sandbox has moved on a few steps, so that the fork backend's copy-on-write pages are counted).
Targets: a copy (a clone, or a fork of a held snapshot) within 10 ms on the fork server and
300 ms with CRIU, both flat in depth, while replay grows with depth. `inprocess` cannot
snapshot ALFWorld and is listed with its error.

Usage:
    python bench/bench_sandbox.py [--json out.json] [--backends fork,criu,replay] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from envs.sandbox import (  # noqa: E402 - after the path set-up.
    BackendUnavailableError,
    SnapshotUnsupportedError,
    make_backend,
)

DEPTHS = (1, 10, 30)
# Steps the live sandbox takes after a snapshot before its memory cost is read.
_MOVE_ON_STEPS = 3


def _default_data_root() -> None:
    shared = _REPO.parent / "shared" / "data" / "alfworld"
    if "ALFWORLD_DATA" not in os.environ and shared.is_dir():
        os.environ["ALFWORLD_DATA"] = str(shared)


def pick_task() -> Any:
    from envs.alfworld import load_tasks

    tasks = load_tasks(None, "valid_unseen")
    # A pick-and-place game: walking between receptacles never wins it, so the episode is long.
    return next(t for t in tasks if t.task_type == "pick_and_place_simple")


def wander(info: dict[str, Any], step: int) -> str:
    """A deterministic action that never ends the episode: the step-th 'go to' in rotation."""
    moves = sorted(c for c in info["admissible_commands"] if c.startswith("go to"))
    return moves[step % len(moves)] if moves else "look"


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


def bench_backend(name: str, task: Any, repeats: int, max_depth: int) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": name, "depths": {}}
    t0 = time.perf_counter()
    try:
        backend = make_backend(name, "alfworld", {"max_steps": max_depth + 50})
    except BackendUnavailableError as e:
        row["error"] = str(e)
        return row
    row["startup_ms"] = _ms(time.perf_counter() - t0)
    try:
        sandbox = backend.new_sandbox()
        t0 = time.perf_counter()
        _, info = sandbox.reset(task)
        row["reset_ms"] = _ms(time.perf_counter() - t0)
        step = 0
        for depth in DEPTHS:
            while step < depth:
                info = sandbox.step(wander(info, step)).info
                step += 1
            snap_s, restore_s, clone_s = [], [], []
            try:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    handle = sandbox.snapshot()
                    snap_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    (copy,) = backend.fork(handle, 1)
                    restore_s.append(time.perf_counter() - t0)
                    copy.close()
                    backend.release(handle)
                    t0 = time.perf_counter()
                    (copy,) = backend.clone(sandbox, 1)
                    clone_s.append(time.perf_counter() - t0)
                    copy.close()
            except SnapshotUnsupportedError as e:
                row["error"] = str(e)
                break
            # Memory: hold one snapshot while the live sandbox moves on a few steps (then the
            # pages it writes are the snapshot's alone).
            handle = sandbox.snapshot()
            for _ in range(_MOVE_ON_STEPS):
                info = sandbox.step(wander(info, step)).info
                step += 1
            held = backend.stats()["snapshot_bytes"]
            backend.release(handle)
            snap, restore = statistics.median(snap_s), statistics.median(restore_s)
            row["depths"][depth] = {
                "snapshot_ms": _ms(snap),
                "restore_ms": _ms(restore),
                "total_ms": _ms(snap + restore),
                "clone_ms": _ms(statistics.median(clone_s)),
                "snapshot_mib": round(held / 2**20, 2),
            }
        if name == "criu" and "error" not in row:
            handle = sandbox.snapshot()
            t0 = time.perf_counter()
            copies = backend.fork(handle, 4)
            row["fork4_ms_each"] = _ms((time.perf_counter() - t0) / 4)
            for copy in copies:
                copy.close()
            backend.release(handle)
    finally:
        backend.close()
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'backend':<10} {'depth':>5} {'snapshot ms':>12} {'restore ms':>11} {'total ms':>9}"
    header += f" {'clone ms':>9} {'held MiB':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if not row["depths"]:
            print(f"{row['backend']:<10} unavailable: {row.get('error', '?')[:200]}")
            continue
        for depth, cell in row["depths"].items():
            print(
                f"{row['backend']:<10} {depth:>5} {cell['snapshot_ms']:>12.1f} "
                f"{cell['restore_ms']:>11.1f} {cell['total_ms']:>9.1f} {cell['clone_ms']:>9.1f} "
                f"{cell['snapshot_mib']:>9.2f}"
            )
        extra = {k: row[k] for k in ("startup_ms", "reset_ms", "fork4_ms_each") if k in row}
        print(f"{'':<10} {extra}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--backends", default="fork,criu,replay,inprocess")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    _default_data_root()
    task = pick_task()
    print(f"task: {task.task_id}")
    rows = []
    for name in args.backends.split(","):
        rows.append(bench_backend(name, task, args.repeats, max(DEPTHS)))
        print(f"done: {name}", file=sys.stderr)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": task.task_id, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
