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

This module is the command and its flow; the plan (`Sweep`, the runs it expands to) is
`bpo_jax.study.sweep_plan`, running the runs `bpo_jax.study.sweep_run`, and what the sweep writes
down (sweep.json, committed records) `bpo_jax.study.sweep_commit`.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

from absl import flags

from bpo_jax import cli
from bpo_jax.study.sweep_commit import record_difference
from bpo_jax.study.sweep_plan import (
    BC_GROUP,
    Ablation,
    Probe,
    Sweep,
    expand,
    load_sweep,
    resolve_config,
)
from bpo_jax.study.sweep_run import exclusive, execute

# Sweep files import `Ablation`, `Probe` and `Sweep` from the command's module.
__all__ = [
    "BC_GROUP",
    "Ablation",
    "Probe",
    "Sweep",
    "expand",
    "load_sweep",
    "record_difference",
    "resolve_config",
    "run_sweep",
]


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
    with exclusive(workdir):
        return execute(
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


PROG = "python -m bpo_jax.study.sweep"


def check_arguments(sweep: str | None, workdir: str | None, parallel: int) -> None:
    """The command line's mistakes, before any run starts: a missing flag or sweep file, a
    sweep file without `get_sweep`, a run whose config or overrides do not parse.

    Raises:
      ValueError: naming the flag, the file or the run.
    """
    if sweep is None or workdir is None:
        raise ValueError("--sweep and --workdir are required.")
    if parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {parallel}.")
    if not Path(sweep).is_file():
        raise ValueError(f"--sweep={sweep}: no such file (a sweep file defines get_sweep()).")
    for run in expand(load_sweep(sweep)):
        resolve_config(run)


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; flags are --name=value", PROG)
    with cli.start_up_errors(PROG):
        check_arguments(FLAGS.sweep, FLAGS.workdir, FLAGS.parallel)

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
    cli.run(_sweep.main, PROG)
