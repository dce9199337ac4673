"""Fault soak of the sandbox pool: episodes started, finished, truncated (by reason) and lost,
faults injected and seen, processes left (see `envs.sandbox.soak`).

A few hundred short BPO-shaped episodes (reset, a few steps, snapshot, fork, play on) of the
`sandbox_counter` env run through the fork pool while workers are SIGKILLed, SIGSTOPped past
the step timeout and made to write garbage on their pipe, each at a set rate per step, and the
zygote is SIGKILLed at a set rate per wave. Lost episodes and processes left must be 0, and
the pool must report exactly the faults that were injected; the exit status is 1 otherwise.

Usage:
    python bench/bench_soak.py [--json out.json] [--waves 10] [--tasks-per-wave 16]
        [--kill-rate 0.01] [--hang-rate 0.005] [--garbage-rate 0.01] [--zygote-kill-rate 0.5]
        [--step-timeout-s 0.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from envs.sandbox.soak import SoakConfig, SoakReport, run_soak  # noqa: E402 - after sys.path.


def table(config: SoakConfig, report: SoakReport) -> str:
    """The report as an aligned two-column table."""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report.truncated_by_reason.items()))
    injected = ", ".join(f"{k} {v}" for k, v in sorted(report.faults_injected.items()))
    seen = ", ".join(f"{k} {v}" for k, v in sorted(report.faults_seen.items()))
    rows = [
        ("fault rates per step", f"kill {config.kill_rate:g}, hang {config.hang_rate:g}, "
                                 f"garbage {config.garbage_rate:g}"),
        ("zygote kill rate per wave", f"{config.zygote_kill_rate:g}"),
        ("episodes started", f"{report.episodes_started}"),
        ("episodes finished", f"{report.episodes_finished}"),
        ("episodes truncated", f"{report.episodes_truncated} ({reasons})"),
        ("episodes lost", f"{report.lost}"),
        ("steps", f"{report.steps}"),
        ("faults injected", injected or "none"),
        ("faults the pool saw", seen or "none"),
        ("zygote kills", f"{report.zygote_kills}"),
        ("processes left", f"{report.processes_left}"),
        ("unreaped children", f"{report.unreaped_children}"),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("verdict", "ok" if report.ok() else "FAILED"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# The `SoakConfig` fields the command line sets, each by `--name-with-dashes` (the others keep
# their defaults).
_OPTIONS = ("waves", "tasks_per_wave", "kill_rate", "hang_rate", "garbage_rate",
            "zygote_kill_rate", "step_timeout_s", "seed")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    defaults = dataclasses.replace(SoakConfig(), waves=10)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the config and report to this file")
    parser.add_argument("--backend", default="fork")
    for name in _OPTIONS:
        default = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args(argv)
    config = dataclasses.replace(defaults, **{name: getattr(args, name) for name in _OPTIONS})
    report = run_soak(config, backend=args.backend)
    print(table(config, report))
    if report.left:
        print("left behind:", ", ".join(report.left))
    if args.json:
        out = {"backend": args.backend, "config": dataclasses.asdict(config),
               "report": dataclasses.asdict(report), "ok": report.ok()}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if report.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
