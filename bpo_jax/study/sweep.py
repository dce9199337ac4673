r"""Runs a sweep of experiments (algorithms x seeds x ablations), resumably, one or N at a time.

  python -m bpo_jax.study.sweep --sweep=experiments/paper/alfworld_cpu.py
  --workdir=runs/alfworld_cpu \
      [--parallel=2] [--dry_run] [--commit_to=results/alfworld_cpu]

A sweep file defines `get_sweep() -> Sweep`: the experiment config (with its `:variants`), the
algorithms, the seeds, overrides every run gets, and named ablations (override sets, each for
some algorithms). Every run is a subprocess

  python -m bpo_jax.main --config=<config>,algo=<algo> --workdir=<workdir>/<run name> \
      --config.seed=<seed> <overrides>

with its stdout and stderr appended to `<workdir>/<run name>/log.txt`. Run names are stable:
`<algo>[_<ablation>]/seed_<seed>` (e.g. `bpo/seed_3`, `bpo_k4/seed_0`). Runs are ordered seed
by seed, so that a sweep stopped early leaves complete paired seeds.

With `Sweep.shared_bc`, behaviour cloning runs once per seed as `bc/seed_<n>` (no RL iterations)
before the seed's other runs, which start RL from its checkpoint (`--config.init_from`): the
algorithms of a seed are compared from one policy. With `Sweep.bc_once` as well, one behaviour
cloning run, `bc/shared` (at the first seed), is the start of every run of every seed, as one
pretrained checkpoint is in the paper's setting: seeds then vary RL alone. A run whose start
failed is marked failed.

With `Sweep.probe` (and shared_bc), the gradient-variance probe (`bpo_jax.study.probe`) of each
start
runs as soon as the start is done, as `probe/shared` (or `probe/seed_<n>`): every algorithm's
gradient at the same parameters, matched spend, `probe.json` for Table 2. It is finished when its
probe.json exists.

With `Sweep.share_evals`, every run gets `--config.eval.cache_dir=<workdir>/eval_cache`: an
evaluation of exactly the same episodes is played once for the sweep (`bpo_jax.io.eval_cache`;
e.g. the before-RL evaluations of the algorithms of a seed, which share their start).

Resuming: a run whose `summary.json` reports `iterations == train.iterations` of its resolved
config is finished and skipped; any other run is started again in the same workdir, where the
main job resumes from its latest checkpoint. The manifest `<workdir>/sweep.json` records every
run's command, status (pending | running | done | failed | interrupted), return code, attempts
and wall time. Ctrl-C (or SIGTERM) terminates the running children (each in its own process
group), marks them interrupted and exits with status 130; re-running the command resumes, and
retries failed runs. One sweep at a time holds a folder (`<workdir>/.sweep.lock`).

`--commit_to=PATH` copies each finished run's small record (config.json, summary.json,
evals.json, metrics.jsonl, and probe.json where present) into `PATH/<run name>/` as soon as it
finishes, for committing while the sweep goes on. A run whose committed record is finished counts
as finished even where its workdir is gone (a sweep resumed on a fresh machine), except a
behaviour-cloning start that a pending run still needs: its checkpoint is not in the record, so
it runs again, and its committed record, the one its runs were paired with, is kept: a finished
committed record is never overwritten. A re-run start must reproduce that record (its
metrics.jsonl, timings and cache hits aside): if it does not, it is marked failed and its runs do
not start, since they would not start from the policy the committed runs started from. It is
deterministic on one kind of machine (`bc/shared` re-ran bit for bit on the AMD EPYC machines of
2026-12-02), but XLA's CPU arithmetic differs between CPUs: on an Intel Xeon on 2026-12-03 its
gradient norm differed in the 7th digit at step 2 and the policy it ended with played
differently. `--allow_changed_start` starts them anyway (they are then paired with each other,
not with the committed runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from bpo_jax.experiment import load_experiment

MANIFEST = "sweep.json"
LOG = "log.txt"
# The small JSON record of a run that `--commit_to` copies (probe.json only where present).
RECORD_FILES = ("config.json", "summary.json", "evals.json", "metrics.jsonl", "probe.json")
_POLL_SECONDS = 0.2
_TERM_GRACE_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Ablation:
    """A named set of config overrides, e.g. `Ablation("k4", {"rollout.num_branches": 4})`.

    Attributes:
      name: appended to the algorithm in run names (`bpo_k4/seed_0`); letters, digits, `_`.
      overrides: config field (dotted, below `config.`) -> value.
      algos: the algorithms it applies to; empty = all of the sweep's.
    """

    name: str
    overrides: Mapping[str, Any]
    algos: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Probe:
    """The gradient-variance probe (`bpo_jax.study.probe`) of a sweep's start policy: every
    algorithm's gradient at the same parameters, the first algorithm the reference.

    Attributes:
      algos: the algorithms probed; the first is the reference (RLOO: no std normalisation).
      batches: recorded rollout batches per algorithm.
    """

    algos: tuple[str, ...] = ("rloo", "bpo")
    batches: int = 64


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What a sweep file's `get_sweep()` returns.

    Attributes:
      config: experiment file and variants, relative to the working directory,
        e.g. 'experiments/alfworld.py:cpu' (the sweep adds `algo=<name>` to the variants).
      algos: algorithm names (config.ALGOS).
      seeds: `config.seed` values; every algorithm runs every seed (paired seeds).
      overrides: config overrides every run gets (field -> value).
      ablations: extra run sets beside the plain algorithms.
      shared_bc: behaviour cloning runs once per seed (`bc/seed_<n>`, no RL), and every run of
        that seed starts RL from its policy (`init_from`): paired seeds share their start.
      bc_once: with shared_bc, one behaviour cloning run (`bc/shared`, at the first seed) starts
        every run of every seed.
      share_evals: runs share evaluation results (`eval.cache_dir` in the sweep's folder).
      probe: with shared_bc, the probe of each start (`probe/shared`, or `probe/seed_<n>`),
        run as soon as its start is done; its `probe.json` is Table 2's record.
    """

    config: str
    algos: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ablations: tuple[Ablation, ...] = ()
    shared_bc: bool = False
    bc_once: bool = False
    share_evals: bool = False
    probe: Probe | None = None


# The shared behaviour-cloning run of a seed trains no RL iterations, and its own evaluations
# are not results (every run that starts from it evaluates that policy before RL itself): one
# training game keeps them short.
BC_OVERRIDES = {"train.iterations": 0, "env.eval_split": "train", "eval.num_tasks": 1}
BC_GROUP = "bc"
BC_SHARED = f"{BC_GROUP}/shared"  # The one start of a `bc_once` sweep.
EVAL_CACHE = "eval_cache"  # The sweep folder's shared evaluations (`share_evals`).
PROBE_GROUP = "probe"  # The probes of the starts (`Sweep.probe`).


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its name, and the flags of its main job (without `--workdir`)."""

    name: str
    algo: str
    seed: int
    ablation: str  # '' for the plain algorithm.
    config: str  # --config value, variants included.
    overrides: tuple[str, ...]  # --config.<field>=<value> flags.
    init_from: str = ""  # Name of the run (in the same sweep) whose policy RL starts from.
    share_evals: bool = False  # Evaluations go through the sweep's cache (`EVAL_CACHE`).
    probe_flags: tuple[str, ...] = ()  # Set for a probe (`bpo_jax.study.probe`), not a main job.

    @property
    def is_probe(self) -> bool:
        return bool(self.probe_flags)

    def command(
        self, workdir: Path, module: str = "bpo_jax.main", probe_module: str = "bpo_jax.study.probe"
    ) -> list[str]:
        run_dir = workdir / self.name
        module = probe_module if self.is_probe else module
        init = [f"--config.init_from={workdir / self.init_from}"] if self.init_from else []
        if self.share_evals:
            init.append(f"--config.eval.cache_dir={workdir / EVAL_CACHE}")
        return [
            sys.executable,
            "-m",
            module,
            f"--config={self.config}",
            f"--workdir={run_dir}",
            *self.overrides,
            *init,
            *self.probe_flags,
        ]


def format_value(value: Any) -> str:
    """A config value as config_flags parses it from the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    if isinstance(value, (int, float, str)):
        return str(value) if isinstance(value, str) else repr(value)
    raise TypeError(f"override value {value!r} of type {type(value).__name__} is not a flag value")


def _check_name(name: str, what: str) -> None:
    if not name or not all(ch.isalnum() or ch == "_" for ch in name):
        raise ValueError(f"{what} {name!r} must be letters, digits and '_' (it names a folder).")


def expand(sweep: Sweep) -> list[Run]:
    """The sweep's runs, seed by seed, then algorithm, then ablation, with unique names."""
    if not sweep.algos or not sweep.seeds:
        raise ValueError(f"a sweep needs algorithms and seeds, got {sweep.algos}, {sweep.seeds}.")
    path, _, variants = sweep.config.partition(":")
    if "algo=" in variants:
        raise ValueError(
            f"sweep config {sweep.config!r} sets algo= itself; list algorithms in Sweep.algos."
        )
    for algo in sweep.algos:
        _check_name(algo, "algorithm")
    for ab in sweep.ablations:
        _check_name(ab.name, "ablation name")
        unknown = set(ab.algos) - set(sweep.algos)
        if unknown:
            raise ValueError(
                f"ablation {ab.name!r} names algorithms {sorted(unknown)} "
                f"that the sweep does not run ({sweep.algos})."
            )
    sets = [("", {}, ())] + [(ab.name, dict(ab.overrides), ab.algos) for ab in sweep.ablations]
    for own in (BC_GROUP, PROBE_GROUP):
        if sweep.shared_bc and own in sweep.algos:
            raise ValueError(f"with shared_bc the run group {own!r} is the sweep's own.")
    if "init_from" in sweep.overrides:
        raise ValueError("overrides must not set init_from; use Sweep.shared_bc.")
    if sweep.bc_once and not sweep.shared_bc:
        raise ValueError("Sweep.bc_once needs shared_bc=True (it says how the start is shared).")
    if sweep.share_evals and "eval.cache_dir" in sweep.overrides:
        raise ValueError("overrides must not set eval.cache_dir; share_evals sets the sweep's.")
    if sweep.probe is not None:
        if not sweep.shared_bc:
            raise ValueError("Sweep.probe needs shared_bc=True: it probes the shared start.")
        if not sweep.probe.algos or sweep.probe.batches < 2:
            raise ValueError(f"Sweep.probe needs algorithms and >= 2 batches: {sweep.probe}.")
    runs, names = [], set()
    shares = sweep.share_evals

    def bc_run(name: str, seed: int) -> Run:
        fields = {**dict(sweep.overrides), **BC_OVERRIDES, "seed": int(seed)}
        flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
        config = f"{path}:{variants + ',' if variants else ''}algo={sweep.algos[0]}"
        names.add(name)
        return Run(name, BC_GROUP, int(seed), "", config, flags_, share_evals=shares)

    def probe_run(start: str, seed: int) -> Run:
        fields = {**dict(sweep.overrides), "seed": int(seed)}
        flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
        config = f"{path}:{variants + ',' if variants else ''}algo={sweep.algos[0]}"
        name = f"{PROBE_GROUP}/{start.split('/', 1)[1]}"
        probe = (f"--algos={','.join(sweep.probe.algos)}", f"--batches={sweep.probe.batches}")
        names.add(name)
        return Run(name, PROBE_GROUP, int(seed), "", config, flags_, start, probe_flags=probe)

    if sweep.bc_once:
        runs.append(bc_run(BC_SHARED, sweep.seeds[0]))
        if sweep.probe is not None:
            runs.append(probe_run(BC_SHARED, sweep.seeds[0]))
    for seed in sweep.seeds:
        bc_name = BC_SHARED if sweep.bc_once else ""
        if sweep.shared_bc and not sweep.bc_once:
            bc_name = f"{BC_GROUP}/seed_{seed}"
            runs.append(bc_run(bc_name, seed))
            if sweep.probe is not None:
                runs.append(probe_run(bc_name, seed))
        for algo in sweep.algos:
            for ab_name, ab_overrides, ab_algos in sets:
                if ab_algos and algo not in ab_algos:
                    continue
                name = f"{algo}_{ab_name}/seed_{seed}" if ab_name else f"{algo}/seed_{seed}"
                if name in names:
                    raise ValueError(
                        f"run name {name!r} twice: seeds and ablations must be unique."
                    )
                names.add(name)
                fields = {**dict(sweep.overrides), **ab_overrides, "seed": int(seed)}
                if "train.algo" in fields:
                    raise ValueError("overrides must not set train.algo; list it in Sweep.algos.")
                flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
                config = f"{path}:{variants + ',' if variants else ''}algo={algo}"
                runs.append(Run(name, algo, int(seed), ab_name, config, flags_, bc_name, shares))
    return runs


def load_sweep(path: str | Path) -> Sweep:
    """Imports a sweep file and returns its `get_sweep()`."""
    module = load_experiment(path)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"sweep file {path} defines no get_sweep().")
    sweep = module.get_sweep()
    if not isinstance(sweep, Sweep):
        raise TypeError(
            f"{path}: get_sweep() returned {type(sweep).__name__}, not bpo_jax.study.sweep.Sweep."
        )
    return sweep


def resolve_config(run: Run):
    """The run's ConfigDict, parsed exactly as the main job parses its flags."""
    from ml_collections import config_flags

    argv = ["sweep", f"--config={run.config}", *run.overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "", flag_values=fv, lock_config=True, sys_argv=argv
    )
    fv(argv)
    return fv.config


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


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Manifest:
    """`<workdir>/sweep.json`: every run's command and status, rewritten atomically on change."""

    def __init__(self, workdir: Path, sweep_path: str, runs: Sequence[Run], module: str):
        self.path = workdir / MANIFEST
        old = {}
        if self.path.is_file():
            old = {r["name"]: r for r in json.loads(self.path.read_text()).get("runs", [])}
        self.data = {"sweep": str(sweep_path), "module": module, "updated": _now(), "runs": []}
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
        self.data["updated"] = _now()
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)


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


def run_sweep(
    sweep_path: str | Path,
    workdir: str | Path,
    *,
    parallel: int = 1,
    dry_run: bool = False,
    commit_to: str | Path | None = None,
    module: str = "bpo_jax.main",
    probe_module: str = "bpo_jax.study.probe",
    out=None,
    allow_changed_start: bool = False,
) -> dict[str, str]:
    """Runs (or resumes) the sweep; returns run name -> final status.

    With `commit_to`, a start re-run here that does not reproduce its committed record fails
    (and its runs with it) unless `allow_changed_start` (see the module's docstring).

    Raises:
      KeyboardInterrupt: after terminating the running children (their status: interrupted).
    """
    out = out or sys.stdout
    if parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {parallel}.")
    workdir = Path(workdir).absolute()
    runs = expand(load_sweep(sweep_path))
    if dry_run:
        for run in runs:
            resolve_config(run)  # A bad override fails here, not hours into the sweep.
            print(shlex.join(run.command(workdir, module, probe_module)), file=out, flush=True)
        return {run.name: "dry_run" for run in runs}
    workdir.mkdir(parents=True, exist_ok=True)
    with _exclusive(workdir):
        return _execute(
            runs,
            workdir,
            str(sweep_path),
            parallel,
            commit_to,
            module,
            probe_module,
            out,
            allow_changed_start,
        )


@contextlib.contextmanager
def _exclusive(workdir: Path):
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


def _execute(
    runs, workdir, sweep_path, parallel, commit_to, module, probe_module, out, allow_changed_start
) -> dict[str, str]:
    """The body of `run_sweep`, under the sweep folder's lock."""
    manifest = Manifest(workdir, sweep_path, runs, module)
    total, done_count = len(runs), 0
    statuses: dict[str, str] = {}

    def line(run: Run, text: str) -> None:
        print(f"[{done_count}/{total}] {run.name}: {text}", file=out, flush=True)

    target = {run.name: int(resolve_config(run).train.iterations) for run in runs}

    def finished(run: Run, folder: Path) -> bool:
        return is_finished(folder / run.name, target[run.name], run.is_probe)

    here = {r.name for r in runs if finished(r, workdir)}
    committed = set()
    # Finished records already committed are never overwritten: a start re-run on a fresh
    # machine (for its checkpoint) keeps the record its runs were paired with.
    recorded = {r.name for r in runs if commit_to and finished(r, Path(commit_to))}

    starts = {r.init_from for r in runs if r.init_from}

    def record(run: Run) -> str:
        if run.name in recorded:
            return f"; its committed record in {commit_to} is kept"
        commit_record(workdir / run.name, Path(commit_to) / run.name)
        return ""

    def changed_start(run: Run) -> str | None:
        """Why a start that ran here does not stand in for its committed record, or None."""
        if not commit_to or run.name not in recorded or run.name not in starts:
            return None
        diff = record_difference(workdir / run.name, Path(commit_to) / run.name)
        if diff is None:
            return None
        if allow_changed_start:
            line(run, f"WARNING: {diff}; its runs start from it (--allow_changed_start)")
            return None
        return (
            f"{diff}: its runs would not start from the policy the committed runs started "
            "from (XLA's CPU arithmetic differs between machines). Run the sweep on a machine "
            "like the one that made the record, commit to a new folder, or pass "
            "--allow_changed_start"
        )

    if commit_to:  # Finished on another machine: its record is committed, its workdir is gone.
        committed = {name for name in recorded if name not in here}
        # A start's record is not its checkpoint: it runs again while a run still needs it.
        needed = {r.init_from for r in runs if r.name not in here | committed and r.init_from}
        committed -= needed
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
            kept = record(run) if commit_to else ""
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
                log.write(f"=== {_now()} sweep starts: {shlex.join(cmd)}\n")
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
                    started=_now(),
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
                    finished=_now(),
                    wall_seconds=manifest.entries[name]["wall_seconds"] + wall,
                )
                kept = record(run) if (done and commit_to) else ""
                summary = _summary_text(workdir / name) if done else f"see {workdir / name / LOG}"
                summary = why or summary
                line(run, f"{status} (rc {rc}) in {wall:.0f}s; {summary}{kept}")
    except KeyboardInterrupt:
        procs = [proc for _, _, proc, _, _ in running.values()]
        _terminate(procs)
        for name, (_, _, proc, log, t0) in running.items():
            log.write(f"=== {_now()} sweep interrupted; run terminated\n")
            log.close()
            statuses[name] = "interrupted"
            manifest.update(
                name,
                status="interrupted",
                returncode=proc.returncode,
                finished=_now(),
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


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined on demand: sweep files import this module)."""
    flags.DEFINE_string("sweep", None, "Sweep file (defines get_sweep()).")
    flags.DEFINE_string("workdir", None, "Sweep directory: one folder per run, and sweep.json.")
    flags.DEFINE_integer("parallel", 1, "Runs at a time.")
    flags.DEFINE_bool("dry_run", False, "Print the runs' commands and exit.")
    flags.DEFINE_string("commit_to", None, "Copy each finished run's record to PATH/<run name>.")
    flags.DEFINE_string("module", "bpo_jax.main", "The module each run executes (python -m).")
    flags.DEFINE_bool(
        "allow_changed_start",
        False,
        "Start runs from a re-run start that does not reproduce its committed record.",
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.sweep is None or FLAGS.workdir is None:
        raise app.UsageError("--sweep and --workdir are required.")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        statuses = run_sweep(
            FLAGS.sweep,
            FLAGS.workdir,
            parallel=FLAGS.parallel,
            dry_run=FLAGS.dry_run,
            commit_to=FLAGS.commit_to,
            module=FLAGS.module,
            allow_changed_start=FLAGS.allow_changed_start,
        )
    except KeyboardInterrupt:
        sys.exit(130)
    failed = sorted(n for n, s in statuses.items() if s == "failed")
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    # Run the importable module's main, so that sweep files and this command share one `Sweep`.
    from bpo_jax.study import sweep as _sweep

    _sweep.define_flags()
    app.run(_sweep.main)
