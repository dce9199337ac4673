"""Steps in flight: what `SandboxPool.submit_steps` returns, and the clock that times replies.

`SandboxPool.step_many` is `submit_steps(...).results()`. Between the two the caller is free to
do other work (the rollout engine samples another cohort's actions on the accelerator) while the
sandboxes' worker processes step. The pool sends at most `num_workers` requests at a time over all
batches in flight; the rest are sent as earlier ones are collected (the pool acts only when its
thread calls into it).

Latency. A reply that arrives while the caller is busy elsewhere sits in its channel until the
pool reads it, so the time the pool reads it says nothing about the step. A `ReplyClock` thread
polls duplicates of the channels of the requests in flight and notes when each reply starts to
arrive; `PendingSteps.latencies` are send-to-arrival seconds per request. The thread only polls
its own duplicate fds and never touches the pool's objects, which stay single-threaded.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from envs.base import StepResult
from envs.sandbox.base import Call, Sandbox, SandboxError

__all__ = ["PendingSteps", "ReplyClock", "StepsOwner", "read_arrived"]


class StepsOwner(Protocol):
    """What a batch of steps asks of the pool that made it (`envs.sandbox.pool.SandboxPool`).

    A protocol, so that imports run one way: the pool's module imports this one.
    """

    def close_sandbox(self, sid: int) -> None: ...

    def _check_open(self) -> None: ...

    def _progress(self, block: bool) -> None: ...

    def _collect(self, batch: PendingSteps, calls: list[Call]) -> list[StepResult]: ...

    def _drop(self, batch: PendingSteps) -> None: ...

    def _clock_watch(self, fd: int) -> int: ...

    def _clock_take(self, key: int) -> float | None: ...

    def _clock_forget(self, key: int) -> None: ...


class PendingSteps:
    """One batch of steps submitted with `SandboxPool.submit_steps`.

    Attributes:
      requests: the `(sid, action)` pairs, in order.
      latencies: after `results()`: per request, seconds from sending it to its reply's arrival
        (for an in-process backend, the step itself, which ran when it was sent).
      wait_seconds: seconds `results()` spent blocked (what the caller waited for the envs).
    """

    def __init__(self, pool: StepsOwner, requests: list, sandboxes: list[Sandbox], watch: bool):
        self.requests = requests
        self.latencies: list[float] = []
        self.wait_seconds = 0.0
        self._pool = pool
        self._sandboxes = sandboxes
        self._watch = watch
        n = len(requests)
        self._calls: list[Any] = [None] * n
        self._queue: collections.deque[int] = collections.deque(range(n))  # Not sent yet.
        self._running: set[int] = set()  # Sent, reply not read yet.
        self._sent = [math.nan] * n
        self._arrived = [math.nan] * n
        self._keys: dict[int, int] = {}  # Request -> its ReplyClock key.
        self._results: list[StepResult] | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        """Whether `results()` has run (it is then free to call again)."""
        return self._results is not None

    def results(self) -> list[StepResult]:
        """Waits for every step; one `StepResult` per request, in order, as `step_many` gives.

        A sandbox that faulted gives `faulted_step_result(...)` (done, truncated,
        `info["error"]` says why) and is closed.

        Raises:
          SandboxError: the batch was cancelled, or the pool was closed under it.
        """
        if self._results is not None:
            return self._results
        if self.cancelled:
            raise SandboxError(
                "these steps were cancelled (or their pool closed); their results are gone."
            )
        pool = self._pool
        t0 = time.perf_counter()
        while self._queue or self._running:
            pool._check_open()
            pool._progress(block=True)
        self.wait_seconds = time.perf_counter() - t0
        self._results = pool._collect(self, self._calls)
        self.latencies = [a - s for s, a in zip(self._sent, self._arrived)]
        return self._results

    def cancel(self) -> None:
        """Gives up on the steps: the sandbox of every request already sent is closed (a worker
        still stepping is killed, which its backend counts as a fault), the others are left as
        they were. A no-op once `results()` has run."""
        if self._results is not None or self.cancelled:
            return
        self.cancelled = True
        for i in self._keys:
            self._pool._clock_forget(self._keys[i])
        sent = [i for i, c in enumerate(self._calls) if c is not None]
        self._queue.clear()
        self._running.clear()
        self._pool._drop(self)
        for i in sent:
            self._pool.close_sandbox(self.requests[i][0])

    # The pool's side ------------------------------------------------------------------------

    def _send_next(self) -> bool:
        """Sends the next queued request; whether it is now running (not finished at once)."""
        i = self._queue.popleft()
        sandbox, (_, action) = self._sandboxes[i], self.requests[i]
        self._sent[i] = time.perf_counter()
        call: Call = sandbox.start_step(action)
        self._calls[i] = call
        if call.fileno() is None:  # Ran synchronously (in-process), or failed at once.
            self._arrived[i] = time.perf_counter()
            return False
        self._running.add(i)
        if self._watch:
            self._keys[i] = self._pool._clock_watch(call.fileno())
        return True

    def _arrive(self, i: int, now: float) -> None:
        """Request i's reply has been read (at `now` or, by the clock, earlier)."""
        self._running.discard(i)
        seen = self._pool._clock_take(self._keys.pop(i)) if i in self._keys else None
        self._arrived[i] = now if seen is None else min(now, seen)


def read_arrived(calls: Sequence[Call]) -> set[int]:
    """Reads what has arrived for the unfinished calls, without blocking; those now finished."""
    by_fd: dict[int, list[int]] = {}
    for i, call in enumerate(calls):
        fd = call.fileno()
        if fd is not None:
            by_fd.setdefault(fd, []).append(i)
    if by_fd:
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        for fd, _ in poller.poll(0):
            for i in by_fd[fd]:
                calls[i].on_readable()
    return {i for i, call in enumerate(calls) if call.fileno() is None}


class ReplyClock:
    """A thread that notes when data (or a hang-up) first shows on fds it is given.

    `watch(fd)` polls a duplicate of `fd` (the caller may close its own at any time) and returns
    a key; `take(key)` is the `time.perf_counter()` at which the fd became readable, or None if it
    has not (and stops watching it). The thread starts with the first `watch` and ends at `close`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._todo: list[tuple[str, int, int]] = []  # (op, key, fd) for the thread.
        self._seen: dict[int, float] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, fd: int) -> int:
        key = next(self._ids)
        dup = os.dup(fd)
        with self._lock:
            self._todo.append(("watch", key, dup))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sandbox-reply-clock")
            self._thread.daemon = True
            self._thread.start()
        self._wake(b"w")
        return key

    def take(self, key: int) -> float | None:
        if self._closed:
            return None
        with self._lock:
            seen = self._seen.pop(key, None)
            if seen is None:
                self._todo.append(("forget", key, -1))
        if seen is None:
            self._wake(b"w")
        return seen

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            os.set_blocking(self._wake_w, True)  # The quit byte must get through.
            os.write(self._wake_w, b"q")
            self._thread.join()
        with self._lock:
            for op, _, fd in self._todo:
                if op == "watch":
                    os.close(fd)
            self._todo.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self, byte: bytes) -> None:
        try:
            os.write(self._wake_w, byte)
        except BlockingIOError:  # The pipe is full of wake-ups the thread has yet to read.
            pass

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds: dict[int, int] = {}  # Our duplicate fd -> key.
        keys: dict[int, int] = {}  # key -> fd.

        def drop(fd: int) -> None:
            poller.unregister(fd)
            os.close(fd)
            del keys[fds.pop(fd)]

        while True:
            events = [fd for fd, _ in poller.poll()]
            # Replies first: an fd number closed below may be reused by a new duplicate.
            now = time.perf_counter()
            for fd in events:
                if fd in fds:
                    key = fds[fd]
                    drop(fd)
                    with self._lock:
                        self._seen[key] = now
            if self._wake_r not in events:
                continue
            if b"q" in os.read(self._wake_r, 4096):
                for own in list(fds):
                    drop(own)
                return
            with self._lock:
                todo, self._todo = self._todo, []
            for op, key, own in todo:
                if op == "watch":
                    fds[own], keys[key] = key, own
                    poller.register(own, select.POLLIN | select.POLLHUP | select.POLLERR)
                elif key in keys:
                    drop(keys[key])
                else:  # Its reply was noted after `take` asked: nobody will ask again.
                    with self._lock:
                        self._seen.pop(key, None)
