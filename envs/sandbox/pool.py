"""`SandboxPool`: the API the trainer's rollout code uses to run many sandboxes at once.

Sandboxes are named by integer ids. Batched calls (`reset_many`, `step_many`) send requests
first and then collect replies as they arrive (poll), so with a process backend (`fork`, `criu`)
all cores work at once; each request has its own deadline. At most `num_workers` requests are in
flight at a time; as one finishes the next is sent. `submit_steps` is `step_many` without the
wait: it sends what fits and returns a `PendingSteps`, whose `results()` collects (the caller
does other work in between; see `envs.sandbox.pending`).

Faults: a sandbox whose worker crashes, hangs past its timeout, sends garbage, or whose env
raises, is killed (with its whole process group or namespace) and closed. In `step_many` its
result is `StepResult("", 0.0, True, {"truncated": True, "won": False, "invalid_action": False,
"error": reason, "fault": kind})`, and the rest of the batch is unaffected. Resets are retried
once on a fresh sandbox after a crash, hang or garbage; if that fails too, `reset_many` closes
the sandboxes it made and raises `SandboxFault`. `stats()` counts faults by kind and `faults()`
lists the recent ones. On the fork backend a zygote that dies is replaced at the next reset; its
workers go on serving their sandboxes (they stay below the backend's keeper process, which reaps
them). `envs.sandbox.soak` runs episodes through a pool while all of this happens at set rates.

Bounded memory: `max_snapshots` caps the snapshots held at once; `snapshot_policy="error"`
raises `SnapshotLimitError` when a new one would exceed it, `"evict_oldest"` releases the oldest
(its handle then raises `HandleError`).

Clean-up: `close()` (or leaving the `with` block, interpreter exit, SIGTERM) kills every process
the pool started. Not thread-safe: use a pool from one thread.

Example:
    with SandboxPool("alfworld", {"max_steps": 50}, backend="fork") as pool:
        sid, observation, info = pool.reset(task)
        root = pool.snapshot(sid)
        group = pool.fork(root, 8)
        results = pool.step_many([(s, action) for s, action in zip(group, actions)])
        pool.release(root)
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envs.base import StepResult, Task
from envs.sandbox.backend import make_backend
from envs.sandbox.base import Call, Sandbox, SandboxError, SandboxFault, SnapshotHandle
from envs.sandbox.pending import PendingSteps, ReplyClock, read_arrived
from envs.sandbox.remote import wait_some

__all__ = ["PendingSteps", "SandboxPool", "faulted_step_result"]

# Fault kinds after which a reset is worth one more try on a fresh sandbox.
_RETRIED_KINDS = ("crash", "timeout", "garbage")


def faulted_step_result(fault: SandboxFault) -> StepResult:
    """The step result a faulted sandbox yields: an empty, truncated end of episode."""
    # The info contract's keys (envs.base) hold here too: the agent did nothing invalid.
    info = {
        "truncated": True,
        "won": False,
        "invalid_action": False,
        "error": fault.reason,
        "fault": fault.kind,
    }
    return StepResult("", 0.0, True, info)


class SandboxPool:
    """Many sandboxes of one environment configuration behind integer ids.

    Args:
        env_name: The environment, as `envs.base.make_env` names it: a short name ("alfworld"),
            a gymnasium id ("bpo_jax/ALFWorld-v0", or a user's registered one) or an entry
            point ("package.module:ClassName") of a gymnasium env over text. Workers import
            the class's module and its `preload_modules` first (`envs.registry.preload_for`).
        env_kwargs: The environment's constructor kwargs.
        backend: Snapshot backend: "fork" (default), "criu", "inprocess" or "replay".
        num_workers: Most requests in flight at once in the batched calls (default: twice the
            number of CPUs: enough to keep every core busy while replies are read, few enough
            that a request's deadline, which starts when it is sent, measures its own work).
        step_timeout_s: Seconds a step may take before its sandbox counts as hung.
        reset_timeout_s: Same for a reset.
        max_snapshots: Cap on snapshots held at once (None: no cap).
        snapshot_policy: "error" or "evict_oldest" when the cap is reached.
        **backend_options: Passed to the backend (e.g. `network_namespace=True` for criu).
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        backend: str = "fork",
        num_workers: int | None = None,
        step_timeout_s: float = 60.0,
        reset_timeout_s: float = 120.0,
        max_snapshots: int | None = None,
        snapshot_policy: str = "error",
        **backend_options: Any,
    ):
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 or None, got {num_workers!r}.")
        self.num_workers = num_workers or 2 * (os.cpu_count() or 1)
        self.backend = make_backend(
            backend,
            env_name,
            env_kwargs,
            step_timeout_s=step_timeout_s,
            reset_timeout_s=reset_timeout_s,
            max_snapshots=max_snapshots,
            snapshot_policy=snapshot_policy,
            **backend_options,
        )
        self._sandboxes: dict[int, Sandbox] = {}
        self._ids = itertools.count()
        self._fault_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self._fault_kinds: collections.Counter[str] = collections.Counter()
        self._steps = 0
        self._open: list[PendingSteps] = []  # Submitted step batches not collected, oldest first.
        self._busy: set[int] = set()  # Sids with a step in one of them.
        self._clock: ReplyClock | None = None
        self.closed = False
        _register(self)

    # Episodes -----------------------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[int, str, dict[str, Any]]:
        """Starts a new sandbox on `task`; returns `(sid, observation, info)`."""
        return self.reset_many([task])[0]

    def reset_many(self, tasks: Sequence[Task]) -> list[tuple[int, str, dict[str, Any]]]:
        """Starts one new sandbox per task, resetting them in parallel.

        Returns:
            `(sid, observation, info)` per task, in order.

        Raises:
            SandboxFault: If a reset still fails after one retry (no sandbox of the call is left).
        """
        self._check_open()
        tasks = list(tasks)
        sandboxes = self.backend.new_sandboxes(len(tasks))
        try:
            calls = self._run([lambda s=s, t=t: s.start_reset(t) for s, t in zip(sandboxes, tasks)])
            results = []
            for i, (call, task) in enumerate(zip(calls, tasks)):
                try:
                    observation, info = call.result()
                except SandboxFault as fault:
                    self._record_fault(None, fault, task)
                    if fault.kind not in _RETRIED_KINDS:
                        raise SandboxFault(
                            fault.kind, f"reset of task {_task_name(task)} failed: {fault.reason}"
                        ) from fault
                    sandboxes[i] = self.backend.new_sandbox()
                    try:
                        observation, info = sandboxes[i].reset(task)
                    except SandboxFault as again:
                        self._record_fault(None, again, task)
                        raise SandboxFault(
                            again.kind,
                            f"reset of task {_task_name(task)} failed twice: {fault.reason}; then "
                            f"{again.reason}",
                        ) from again
                results.append((observation, info))
        except BaseException:
            for sandbox in sandboxes:
                sandbox.close()
            raise
        out = []
        for sandbox, (observation, info) in zip(sandboxes, results):
            sid = next(self._ids)
            self._sandboxes[sid] = sandbox
            out.append((sid, observation, info))
        self.backend.counts["resets"] += len(out)
        return out

    def step_many(self, requests: Sequence[tuple[int, str | None]]) -> list[StepResult]:
        """Plays one action in each of several sandboxes, in parallel.

        Args:
            requests: `(sid, action)` pairs; each sid at most once.

        Returns:
            One `StepResult` per request, in order. A sandbox that faulted gives
            `faulted_step_result(...)` (done, truncated, `info["error"]` says why) and is closed.

        Raises:
            SandboxError: For an unknown or closed sid, a sid whose episode is over, a sid
                given twice, or one with a step still in flight (nothing is stepped then).
        """
        return self._submit(requests, watch=False).results()

    def submit_steps(self, requests: Sequence[tuple[int, str | None]]) -> PendingSteps:
        """`step_many` without the wait: sends the steps (as many as `num_workers` allows) and
        returns at once; `.results()` of the returned batch is what `step_many` would return.

        Until it is collected, its sids cannot be stepped, snapshotted or cloned (closing one
        faults its step). A backend that steps in-process has finished every step on return.

        Raises:
            SandboxError: As `step_many` (nothing is sent then).
        """
        return self._submit(requests, watch=True)

    def _submit(self, requests: Sequence[tuple[int, str | None]], watch: bool) -> PendingSteps:
        self._check_open()
        requests = list(requests)
        seen: set[int] = set()
        sandboxes = []
        for sid, _ in requests:
            if sid in seen:
                raise SandboxError(f"sandbox {sid} appears twice in one step_many call.")
            seen.add(sid)
            sandbox = self._get_idle(sid)
            if sandbox.done:
                raise SandboxError(
                    f"sandbox {sid}'s episode is over (after {sandbox.steps} steps); reset a new "
                    "sandbox, fork a snapshot, or close this one."
                )
            sandboxes.append(sandbox)
        batch = PendingSteps(self, requests, sandboxes, watch)
        self._open.append(batch)
        self._busy.update(seen)
        try:
            self._send_queued()
        except BaseException:
            batch.cancel()
            raise
        return batch

    def step(self, sid: int, action: str | None) -> StepResult:
        """`step_many([(sid, action)])[0]`."""
        return self.step_many([(sid, action)])[0]

    # Snapshots ----------------------------------------------------------------------------------

    def snapshot(self, sid: int) -> SnapshotHandle:
        """Saves sandbox `sid`'s current state; release the handle when done with it."""
        self._check_open()
        return self._get_idle(sid).snapshot()

    def fork(self, handle: SnapshotHandle, n: int) -> list[int]:
        """`n` new live sandboxes at the snapshot's state; returns their ids."""
        self._check_open()
        return self._adopt(self.backend.fork(handle, n))

    def clone(self, sid: int, n: int) -> list[int]:
        """`n` new live sandboxes at sandbox `sid`'s current state (which goes on); their ids.

        See `SandboxBackend.clone`: cheaper than snapshot + fork + release on the fork server.
        """
        self._check_open()
        return self._adopt(self.backend.clone(self._get_idle(sid), n))

    def _adopt(self, sandboxes: list[Sandbox]) -> list[int]:
        """Gives new sandboxes ids in this pool."""
        sids = []
        for sandbox in sandboxes:
            sid = next(self._ids)
            self._sandboxes[sid] = sandbox
            sids.append(sid)
        return sids

    def restore(self, sid: int, handle: SnapshotHandle) -> None:
        """Puts existing sandbox `sid` into the snapshot's state."""
        self._check_open()
        self._get_idle(sid).restore(handle)

    def release(self, handle: SnapshotHandle) -> None:
        """Frees a snapshot; its handle is invalid afterwards."""
        self._check_open()
        self.backend.release(handle)

    def close_sandbox(self, sid: int) -> None:
        """Closes sandbox `sid` (kills its processes). Unknown or already closed ids are fine."""
        sandbox = self._sandboxes.pop(sid, None)
        if sandbox is not None:
            sandbox.close()

    # Introspection ------------------------------------------------------------------------------

    def live(self) -> list[int]:
        """Ids of the live sandboxes."""
        return sorted(self._sandboxes)

    def done(self, sid: int) -> bool:
        """Whether sandbox `sid`'s episode is over."""
        return self._get(sid).done

    def pid(self, sid: int) -> int | None:
        """Host pid of sandbox `sid`'s worker process (None for in-process backends)."""
        return self._get(sid).pid()

    def faults(self) -> list[dict[str, Any]]:
        """The most recent faults (up to 100): sid (None for a reset), task_id, kind, reason."""
        return list(self._fault_log)

    def stats(self) -> dict[str, Any]:
        """Counters: live sandboxes, held snapshots and the bytes they hold, events, faults."""
        stats = self.backend.stats()
        stats.update(
            live_sandboxes=len(self._sandboxes),
            steps=self._steps,
            num_workers=self.num_workers,
            faults_by_kind=dict(self._fault_kinds),
        )
        return stats

    # Lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kills every sandbox and frees every snapshot. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        for batch in self._open:
            batch.cancelled = True
        self._open.clear()
        self._busy.clear()
        self._sandboxes.clear()
        self.backend.close()
        if self._clock is not None:
            self._clock.close()
        _unregister(self)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort; close() explicitly.
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # Internals ----------------------------------------------------------------------------------

    def _get(self, sid: int) -> Sandbox:
        sandbox = self._sandboxes.get(sid)
        if sandbox is None or sandbox.closed:
            self._sandboxes.pop(sid, None)
            raise SandboxError(
                f"no live sandbox with id {sid} (never created, closed, or faulted); live ids: "
                f"{self.live()[:20]}."
            )
        return sandbox

    def _get_idle(self, sid: int) -> Sandbox:
        sandbox = self._get(sid)
        if sid in self._busy:
            raise SandboxError(
                f"sandbox {sid} has a step in flight (submit_steps); collect its results first."
            )
        return sandbox

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError("this SandboxPool is closed.")

    # Steps in flight (PendingSteps) ---------------------------------------------------------

    def _send_queued(self) -> None:
        """Sends queued steps, oldest batch first, while fewer than `num_workers` are running."""
        room = self.num_workers - sum(len(b._running) for b in self._open)
        for batch in self._open:
            while room > 0 and batch._queue:
                room -= batch._send_next()

    def _progress(self, block: bool) -> None:
        """Reads the replies that have arrived (with `block`, waits until one does), then sends
        what fits. Replies are read before any deadline is checked: one that arrived while the
        caller was busy elsewhere is not a hang."""
        running = [(b, i) for b in self._open for i in b._running]
        if running:
            calls = [b._calls[i] for b, i in running]
            finished = read_arrived(calls)
            if block and not finished:
                finished = wait_some(calls, set(range(len(calls))))
            now = time.perf_counter()
            for j in finished:
                b, i = running[j]
                b._arrive(i, now)
        self._send_queued()

    def _collect(self, batch: PendingSteps, calls: list[Call]) -> list[StepResult]:
        """A finished batch's results, `step_many`'s way (faulted sandboxes are closed)."""
        self._drop(batch)
        results = []
        for (sid, _), sandbox, call in zip(batch.requests, batch._sandboxes, calls):
            try:
                results.append(call.result())
            except SandboxFault as fault:
                self._record_fault(sid, fault, sandbox.task)
                self._sandboxes.pop(sid, None)
                results.append(faulted_step_result(fault))
        self._steps += len(batch.requests)
        return results

    def _drop(self, batch: PendingSteps) -> None:
        if batch in self._open:
            self._open.remove(batch)
        self._busy.difference_update(sid for sid, _ in batch.requests)

    def _clock_watch(self, fd: int) -> int:
        if self._clock is None:
            self._clock = ReplyClock()
        return self._clock.watch(fd)

    def _clock_take(self, key: int) -> float | None:
        return None if self._clock is None else self._clock.take(key)

    def _clock_forget(self, key: int) -> None:
        self._clock_take(key)

    def _run(self, starters: Sequence[Callable[[], Call]]) -> list[Call]:
        """Starts the calls (at most `num_workers` in flight) and waits for all of them."""
        calls: list[Any] = [None] * len(starters)
        pending: set[int] = set()
        started = 0
        while started < len(starters) or pending:
            while started < len(starters) and len(pending) < self.num_workers:
                calls[started] = starters[started]()
                pending.add(started)
                started += 1
            pending -= wait_some(calls, pending)
        return calls

    def _record_fault(self, sid: int | None, fault: SandboxFault, task: Task | None) -> None:
        self._fault_kinds[fault.kind] += 1
        self._fault_log.append(
            {
                "sid": sid,
                "task_id": getattr(task, "task_id", None),
                "kind": fault.kind,
                "reason": fault.reason,
            }
        )


def _task_name(task: Any) -> str:
    return repr(getattr(task, "task_id", task))


# Closing pools at exit and on SIGTERM -----------------------------------------------------------

_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()
_hooks_installed = False


def _register(pool: SandboxPool) -> None:
    global _hooks_installed
    _POOLS.add(pool)
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is not threading.main_thread():
        return  # Signal handlers can only be set from the main thread; atexit still runs.
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        _close_all()
        if callable(previous):
            previous(signum, frame)
        else:
            # Die of SIGTERM as if no handler had been installed.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _unregister(pool: SandboxPool) -> None:
    _POOLS.discard(pool)


def _close_all() -> None:
    for pool in list(_POOLS):
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - best effort at exit.
            pass
