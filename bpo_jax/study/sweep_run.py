"""Running a sweep's runs: each a subprocess in its own process group, N at a time, a run only
after its start is done; Ctrl-C (or SIGTERM) terminates them and marks them interrupted, and a
run that finished earlier is skipped, so running the sweep again resumes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bpo_jax.study.sweep_commit import CommittedRecords, Manifest, is_finished, now
from bpo_jax.study.sweep_plan import Run, resolve_config

LOG = "log.txt"
_POLL_SECONDS = 0.2
_TERM_GRACE_SECONDS = 30.0


def _terminate(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to each child's process group, then SIGKILL to what is left after a grace period."""
    import os

    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + _TERM_GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


@contextlib.contextmanager
def exclusive(workdir: Path):
    """Holds `<workdir>/.sweep.lock`: two sweeps in one folder would run the same runs twice."""
    with (workdir / ".sweep.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another sweep is running in {workdir} (it holds {workdir / '.sweep.lock'}); "
                "wait for it or stop it first."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def execute(
    runs, workdir, sweep_path, parallel, commit_to, module, probe_module, out, allow_changed_start
) -> dict[str, str]:
    """The body of `bpo_jax.study.sweep.run_sweep`, under the sweep folder's lock (`exclusive`)."""
    manifest = Manifest(workdir, sweep_path, runs, module)
    total, done_count = len(runs), 0
    statuses: dict[str, str] = {}

    def line(run: Run, text: str) -> None:
        print(f"[{done_count}/{total}] {run.name}: {text}", file=out, flush=True)

    target = {run.name: int(resolve_config(run).train.iterations) for run in runs}

    def finished(run: Run, folder: Path) -> bool:
        return is_finished(folder / run.name, target[run.name], run.is_probe)

    here = {r.name for r in runs if finished(r, workdir)}
    records = CommittedRecords(commit_to, workdir, runs, finished, allow_changed_start)
    committed = records.finished_elsewhere(runs, here)

    def changed_start(run: Run) -> str | None:
        return records.changed_start(run, lambda text: line(run, text))

    pending = []
    for run in runs:
        n = target[run.name]
        what = "its probe.json" if run.is_probe else f"{n} iterations"
        if run.name in here or run.name in committed:
            done_count += 1
            statuses[run.name] = "done"
            manifest.update(
                run.name, status="done", returncode=manifest.entries[run.name]["returncode"]
            )
            if run.name in committed:
                line(run, f"finished earlier ({what}; record in {commit_to}), skipped")
                continue
            why = changed_start(run)
            if why:
                statuses[run.name] = "failed"
                manifest.update(run.name, status="failed", returncode=None)
                line(run, f"failed: {why}")
                continue
            kept = records.commit(run)
            line(run, f"finished earlier ({what}), skipped{kept}")
        else:
            pending.append((run, n))
    running: dict[str, tuple[Run, int, subprocess.Popen, Any, float]] = {}
    try:
        while pending or running:
            # A run whose shared start failed cannot start: it fails with it.
            blocked = [x for x in pending if statuses.get(x[0].init_from) == "failed"]
            for item in blocked:
                pending.remove(item)
                run = item[0]
                done_count += 1
                statuses[run.name] = "failed"
                manifest.update(run.name, status="failed", returncode=None)
                line(run, f"not started: {run.init_from} failed")
            while len(running) < parallel:
                ready = [
                    i
                    for i, (run, _) in enumerate(pending)
                    if not run.init_from or statuses.get(run.init_from) == "done"
                ]
                if not ready:
                    if pending and not running:  # Nothing can ever start (no such start).
                        raise RuntimeError(
                            f"runs wait for starts that are not in the sweep: {pending}"
                        )
                    break
                run, iterations = pending.pop(ready[0])
                run_dir = workdir / run.name
                run_dir.mkdir(parents=True, exist_ok=True)
                log = (run_dir / LOG).open("a", encoding="utf-8")
                cmd = run.command(workdir, module, probe_module)
                log.write(f"=== {now()} sweep starts: {shlex.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                entry = manifest.entries[run.name]
                manifest.update(
                    run.name,
                    status="running",
                    started=now(),
                    returncode=None,
                    attempts=entry["attempts"] + 1,
                )
                running[run.name] = (run, iterations, proc, log, time.time())
            time.sleep(_POLL_SECONDS)
            for name in list(running):
                run, iterations, proc, log, t0 = running[name]
                rc = proc.poll()
                if rc is None:
                    continue
                del running[name]
                log.close()
                wall = time.time() - t0
                done = rc == 0 and finished(run, workdir)
                why = changed_start(run) if done else None
                done = done and not why
                status = "done" if done else "failed"
                done_count += 1
                statuses[name] = status
                manifest.update(
                    name,
                    status=status,
                    returncode=rc,
                    finished=now(),
                    wall_seconds=manifest.entries[name]["wall_seconds"] + wall,
                )
                kept = records.commit(run) if done else ""
                summary = _summary_text(workdir / name) if done else f"see {workdir / name / LOG}"
                summary = why or summary
                line(run, f"{status} (rc {rc}) in {wall:.0f}s; {summary}{kept}")
    except KeyboardInterrupt:
        procs = [proc for _, _, proc, _, _ in running.values()]
        _terminate(procs)
        for name, (_, _, proc, log, t0) in running.items():
            log.write(f"=== {now()} sweep interrupted; run terminated\n")
            log.close()
            statuses[name] = "interrupted"
            manifest.update(
                name,
                status="interrupted",
                returncode=proc.returncode,
                finished=now(),
                wall_seconds=manifest.entries[name]["wall_seconds"] + time.time() - t0,
            )
        print(
            f"sweep interrupted: {len(running)} run(s) terminated; re-run to resume.",
            file=out,
            flush=True,
        )
        raise
    return statuses


def _summary_text(run_dir: Path) -> str:
    if (run_dir / "probe.json").is_file() and not (run_dir / "summary.json").is_file():
        results = json.loads((run_dir / "probe.json").read_text())["results"]
        return "trace-variance ratios " + ", ".join(
            f"{a} {r.get('trace_var_ratio', float('nan')):.3f}" for a, r in results.items()
        )
    s = json.loads((run_dir / "summary.json").read_text())
    after = s.get("success_after_rl")
    return f"success after RL {after:.3f}" if isinstance(after, (int, float)) else "no success"
