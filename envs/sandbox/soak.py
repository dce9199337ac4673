"""A fault soak: many short episodes through a `SandboxPool` while its processes misbehave.

Episodes are BPO-shaped: each task is reset, played a few steps, snapshotted and forked, and
every copy plays on to its end. Before each step a fault injector picks, at set rates, sandboxes
to break: SIGKILL of the worker, SIGSTOP (a hang past the pool's step timeout), or an action
that makes the worker write garbage on its reply pipe (`CounterEnv`'s "garbage"); once a wave it
may also SIGKILL the fork server's zygote, whose workers must go on serving.

Every episode must end in exactly one way: finished (terminated), or truncated with a reason
(the step limit, or the fault the pool reports in `info["error"]`). An episode with no end is
lost. After the pool closes, no process it started may be left, nor an unreaped child. The
faults the pool reports must match what was injected, kind for kind.

Used by tests/test_soak.py and bench/bench_soak.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from typing import Any

from envs.sandbox import procutil
from envs.sandbox.base import SandboxFault
from envs.sandbox.pool import SandboxPool
from envs.sandbox.testing import CounterTask, leftover_processes

__all__ = ["SoakConfig", "SoakReport", "run_soak"]


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """What the soak runs.

    Attributes:
        waves: Rounds of `tasks_per_wave` tasks each.
        tasks_per_wave: Tasks reset together (a batch of trees).
        forks: Copies forked from each task's snapshot (each one more episode).
        branch_at: Steps played before the snapshot.
        target: Count that wins (an episode of "inc" ends after `target` steps)...
        unreachable_every: ...except every n-th task, whose target lies past the step limit, so
            that the step limit truncates it.
        max_steps: The env's step limit.
        kill_rate, hang_rate, garbage_rate: Chance per step request of each fault.
        zygote_kill_rate: Chance per wave of a SIGKILL of the zygote (fork backend).
        step_timeout_s: The pool's step timeout (a hung worker costs this much once per batch).
        num_workers: The pool's requests in flight.
        seed: Seeds the injector.
    """

    waves: int = 8
    tasks_per_wave: int = 16
    forks: int = 2
    branch_at: int = 2
    target: int = 6
    unreachable_every: int = 4
    max_steps: int = 8
    kill_rate: float = 0.01
    hang_rate: float = 0.005
    garbage_rate: float = 0.01
    zygote_kill_rate: float = 0.5
    step_timeout_s: float = 0.5
    num_workers: int | None = None
    seed: int = 0


@dataclasses.dataclass
class SoakReport:
    """What happened. `lost` and `processes_left` must be 0, and `faults_seen` equal
    `faults_injected`."""

    episodes_started: int = 0
    episodes_finished: int = 0
    episodes_truncated: int = 0
    truncated_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    lost: int = 0
    steps: int = 0
    faults_injected: dict[str, int] = dataclasses.field(default_factory=dict)
    faults_seen: dict[str, int] = dataclasses.field(default_factory=dict)
    zygote_kills: int = 0
    processes_left: int = 0
    unreaped_children: int = 0
    wall_s: float = 0.0
    left: list[str] = dataclasses.field(default_factory=list)

    def ok(self) -> bool:
        """All the soak's invariants hold."""
        return (
            self.lost == 0
            and self.processes_left == 0
            and self.unreaped_children == 0
            and self.episodes_started == self.episodes_finished + self.episodes_truncated
            and self.faults_seen == self.faults_injected
        )


_FAULT_OF_INJECTION = {"kill": "crash", "hang": "timeout", "garbage": "garbage"}


class _Injector:
    """Picks the faults of one batch of step requests."""

    def __init__(self, config: SoakConfig, report: SoakReport):
        self.rng = random.Random(config.seed)
        self.config = config
        self.report = report

    def arm(self, pool: SandboxPool, requests: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """Breaks some of the sandboxes about to be stepped; returns the requests to send."""
        c = self.config
        out = []
        for sid, action in requests:
            u = self.rng.random()
            pid = pool.pid(sid)
            if u < c.kill_rate and pid is not None:
                os.kill(pid, signal.SIGKILL)
                self._count("kill")
            elif u < c.kill_rate + c.hang_rate and pid is not None:
                os.kill(pid, signal.SIGSTOP)
                self._count("hang")
            elif u < c.kill_rate + c.hang_rate + c.garbage_rate:
                action = "garbage"
                self._count("garbage")
            out.append((sid, action))
        return out

    def maybe_kill_zygote(self, pool: SandboxPool) -> None:
        zygote = getattr(pool.backend, "_zygote", None)
        if zygote is not None and self.rng.random() < self.config.zygote_kill_rate:
            try:
                os.kill(zygote.pid, signal.SIGKILL)
                self.report.zygote_kills += 1
            except ProcessLookupError:
                pass

    def _count(self, injection: str) -> None:
        kind = _FAULT_OF_INJECTION[injection]
        self.report.faults_injected[kind] = self.report.faults_injected.get(kind, 0) + 1


class _Ledger:
    """One entry per episode: open until it ends one way or another."""

    def __init__(self, report: SoakReport):
        self.report = report
        self.open: set[int] = set()

    def start(self, sids: list[int]) -> None:
        self.report.episodes_started += len(sids)
        self.open.update(sids)

    def end(self, sid: int, info: dict[str, Any]) -> None:
        self.open.discard(sid)
        if not info["truncated"]:
            self.report.episodes_finished += 1
            return
        reason = info.get("fault") or "step limit"
        if not (info.get("error") or reason == "step limit"):
            return  # Truncated without a reason: counted as lost (never closed).
        self.report.episodes_truncated += 1
        by = self.report.truncated_by_reason
        by[reason] = by.get(reason, 0) + 1

    def end_by_fault(self, sid: int, fault: SandboxFault) -> None:
        """An episode whose sandbox faulted outside `step_many` (snapshot, fork)."""
        self.end(sid, {"truncated": True, "fault": fault.kind, "error": fault.reason})


def _play_until(pool, ledger, injector, report, sids, steps: int | None) -> list[int]:
    """Steps `sids` with "inc" (faults injected) `steps` times (None: to the end); returns the
    sandboxes still running."""
    live = list(sids)
    played = 0
    while live and (steps is None or played < steps):
        requests = injector.arm(pool, [(sid, "inc") for sid in live])
        results = pool.step_many(requests)
        report.steps += len(requests)
        played += 1
        still = []
        for (sid, _), result in zip(requests, results):
            if result.done:
                ledger.end(sid, result.info)
                pool.close_sandbox(sid)
            else:
                still.append(sid)
        live = still
    return live


def run_soak(config: SoakConfig = SoakConfig(), backend: str = "fork") -> SoakReport:
    """Runs the soak on `sandbox_counter` episodes; see the module docstring."""
    report = SoakReport()
    injector = _Injector(config, report)
    ledger = _Ledger(report)
    before = set(procutil.descendant_pids(os.getpid()))
    start = time.perf_counter()
    with SandboxPool(
        "sandbox_counter",
        {"max_steps": config.max_steps},
        backend=backend,
        step_timeout_s=config.step_timeout_s,
        num_workers=config.num_workers,
    ) as pool:
        for wave in range(config.waves):
            injector.maybe_kill_zygote(pool)
            tasks = []
            for i in range(config.tasks_per_wave):
                n = wave * config.tasks_per_wave + i
                unreachable = config.unreachable_every and n % config.unreachable_every == 0
                target = config.max_steps + 10 if unreachable else config.target
                tasks.append(CounterTask(f"soak-{n}", start=0, target=target))
            sids = [sid for sid, _, _ in pool.reset_many(tasks)]
            ledger.start(sids)
            live = _play_until(pool, ledger, injector, report, sids, config.branch_at)
            copies = []
            for sid in live:
                try:
                    handle = pool.snapshot(sid)
                except SandboxFault as fault:
                    ledger.end_by_fault(sid, fault)
                    pool.close_sandbox(sid)
                    continue
                forked = pool.fork(handle, config.forks)
                pool.release(handle)
                ledger.start(forked)
                copies += forked
            _play_until(pool, ledger, injector, report, [*live, *copies], None)
        # Still open, or ended without a reason: either way not accounted for.
        report.lost = report.episodes_started - report.episodes_finished - report.episodes_truncated
        report.faults_seen = dict(pool.stats()["faults_by_kind"])
    report.left = leftover_processes(before)
    report.processes_left = len(report.left)
    report.unreaped_children = len(
        [p for p in procutil.child_pids(os.getpid()) if not procutil.pid_alive(p)]
    )
    report.wall_s = time.perf_counter() - start
    return report
