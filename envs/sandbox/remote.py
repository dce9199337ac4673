"""The trainer's side of a sandbox process: requests with deadlines, fault detection, waiting.

A `Remote` is one worker (or frozen snapshot) process and its channel. `Remote.request` sends a
frame and returns a `RemoteCall`; `wait_all` multiplexes many calls with `poll`, so that a pool
dispatches every request first and then collects replies as they come, each with its own
deadline. A peer that closes its channel mid-request (crash), misses the deadline (hang), sends a
frame that does not parse (garbage), or reports that its env raised, faults the call: the
`on_fault` callback kills the process (with its process group) and the call raises
`SandboxFault`.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from envs.base import StepResult, Task
from envs.sandbox import procutil, wire
from envs.sandbox.base import Call, Sandbox, SandboxError, SandboxFault

__all__ = ["Remote", "RemoteCall", "RemoteSandbox", "wait_all", "wait_some"]


class Remote:
    """One sandbox-side process, as the trainer sees it.

    Args:
        pid: Host pid of the process.
        rfd: Fd the trainer reads replies from.
        wfd: Fd the trainer writes requests to (may equal `rfd` for a socket).
        pgid: Process group to kill (default `pid`); None to kill only `pid`.
        label: Name used in error messages, e.g. "fork worker".
        on_kill: Called after the kill, e.g. to reap a child (gets the Remote).
    """

    def __init__(
        self,
        pid: int,
        rfd: int,
        wfd: int,
        *,
        pgid: int | None = -1,
        label: str = "worker",
        on_kill: Callable[[Remote], None] | None = None,
    ):
        self.pid = pid
        self.rfd = rfd
        self.wfd = wfd
        self.pgid = pid if pgid == -1 else pgid
        self.label = label
        self.on_kill = on_kill
        self.reader = wire.FrameReader(rfd)
        self.dead = False
        self.exit_note = ""  # Filled by on_kill where the exit status is known.
        # Requests sent and not yet answered, oldest first: replies come back in request order.
        self.inflight: collections.deque[RemoteCall] = collections.deque()
        # A pidfd names this very process even after its pid number is reused by another one.
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None
        for fd in {rfd, wfd}:
            os.set_blocking(fd, False)

    def __repr__(self) -> str:
        return f"{self.label} pid {self.pid}"

    def send(self, obj: Any, fds: Sequence[int] = (), deadline: float | None = None) -> None:
        """Sends one frame (with `fds` over a unix socket); blocks until it is written."""
        data = wire.encode(obj)
        if fds:
            import socket

            sock = socket.socket(fileno=os.dup(self.wfd))
            try:
                sock.setblocking(True)
                sent = socket.send_fds(sock, [data], list(fds))
            finally:
                sock.close()
            # The dup shares the file status flags: put non-blocking mode back.
            os.set_blocking(self.wfd, False)
            data = data[sent:]
        wire.write_all(self.wfd, data, deadline)

    def request(
        self,
        op: str,
        *args: Any,
        timeout_s: float,
        fds: Sequence[int] = (),
        on_fault: Callable[[str, str], None] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> RemoteCall:
        """Starts request `op(*args)`; see `RemoteCall`."""
        return RemoteCall(self, op, args, timeout_s, fds, on_fault, convert)

    def call(self, op: str, *args: Any, timeout_s: float, fds: Sequence[int] = ()) -> Any:
        """Synchronous `request`: the value, or the call's exception."""
        return self.request(op, *args, timeout_s=timeout_s, fds=fds).result()

    def kill(self) -> None:
        """Kills the process (and its group) and closes the channel. Idempotent."""
        if self.dead:
            return
        self.dead = True
        if self._pidfd is None:
            if self.pgid is not None:
                procutil.kill_group(self.pgid)
        elif self.alive():
            # The process may not have made its own group yet: signal it directly too. While it
            # is alive its pid (and so its group id) cannot name another process.
            if self.pgid is not None:
                procutil.kill_group(self.pgid)
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self.close_channel()
        if self.on_kill is not None:
            self.on_kill(self)
        self._fail_inflight("crash", lambda call: f"{self} was killed during {call.op!r}")

    def pump(self) -> None:
        """Reads what is available and hands every complete reply to its call, in order."""
        try:
            alive = self.reader.fill()
        except BlockingIOError:
            return
        except OSError as e:
            why = e.strerror or str(e)
            self._fail_inflight("crash", lambda call: f"{self} died during {call.op!r} ({why})")
            return
        while True:
            try:
                ok, reply = self.reader.pop()
            except wire.ProtocolError as e:
                bad = str(e)
                self._fail_inflight(
                    "garbage",
                    lambda call, bad=bad: f"{self} sent garbage in reply to {call.op!r}: {bad}",
                )
                return
            if not ok:
                break
            if not self.inflight:  # A reply nobody asked for: the channel is out of sync.
                self.kill()
                return
            self.inflight.popleft()._finish(reply)
        if not alive:
            self._fail_inflight(
                "crash", lambda call: f"{self} died during {call.op!r} (its channel closed)"
            )

    def _fail_inflight(self, kind: str, reason: Callable[[RemoteCall], str]) -> None:
        while self.inflight:
            call = self.inflight.popleft()
            call._fault(kind, reason(call))

    def alive(self) -> bool:
        """Whether the process still runs (False once it has exited, reaped or not)."""
        if self._pidfd is None:
            return procutil.pid_alive(self.pid)
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return not poller.poll(0)

    def let_go(self) -> None:
        """Closes the channel and the pidfd without a signal: the process exits at end of file
        (the zygote, after killing what is below it). Its in-flight calls fault."""
        if self.dead:
            return
        self.dead = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self.close_channel()
        self._fail_inflight("crash", lambda call: f"{self} was let go during {call.op!r}")

    def close_channel(self) -> None:
        wire.close_channel(self.reader, self.rfd, self.wfd)
        self.rfd = self.wfd = -1


class RemoteCall(Call):
    """One request in flight to a `Remote`.

    Args:
        remote: The process.
        op, args: The request.
        timeout_s: Seconds until the call counts as hung.
        fds: File descriptors to send along (unix socket channels only).
        on_fault: Called with (kind, reason) when the call faults; default: kill the remote.
        convert: Applied to the reply value on success.
    """

    def __init__(
        self,
        remote: Remote,
        op: str,
        args: tuple,
        timeout_s: float,
        fds: Sequence[int] = (),
        on_fault: Callable[[str, str], None] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ):
        self.remote = remote
        self.op = op
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._on_fault = on_fault
        self._convert = convert
        self._finished = False
        self._value: Any = None
        self._error: BaseException | None = None
        if remote.dead:
            self._fault("crash", f"{remote} is already dead")
            return
        if remote.reader.has_partial():
            self._fault("garbage", f"{remote} sent unrequested bytes between requests")
            return
        remote.inflight.append(self)
        try:
            remote.send((op, args), fds, self.deadline)
        except TimeoutError:
            self._fault("timeout", f"{remote} did not read its request within {timeout_s:g} s")
        except OSError as e:
            self._fault("crash", f"{remote} is gone (sending {op!r}: {e.strerror or e})")

    def fileno(self) -> int | None:
        return None if self._finished else self.remote.rfd

    def on_readable(self) -> None:
        if not self._finished:
            self.remote.pump()

    def expire(self) -> None:
        if not self._finished:
            self._fault(
                "timeout", f"{self.remote} did not answer {self.op!r} in {self.timeout_s:g} s"
            )

    def result(self) -> Any:
        if not self._finished:
            wait_all([self])
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, reply: Any) -> None:
        tag = reply[0] if isinstance(reply, tuple) and reply else None
        if tag == "ok" and len(reply) == 2:
            self._finished = True
            try:
                self._value = reply[1] if self._convert is None else self._convert(reply[1])
            except Exception as e:  # noqa: BLE001 - a malformed value is garbage.
                self._finished = False
                self._fault("garbage", f"{self.remote} sent a malformed {self.op!r} reply: {e}")
        elif tag == "refused" and len(reply) == 2:
            self._finished = True
            self._error = SandboxError(f"{self.remote} refused {self.op!r}: {reply[1]}")
            self._error.refused_reason = reply[1]  # type: ignore[attr-defined]
        elif tag == "err" and len(reply) == 4:
            _, type_name, message, remote_tb = reply
            last = remote_tb.strip().splitlines()[-3:] if remote_tb else []
            self._fault(
                "error",
                f"{type_name}: {message} (raised in {self.remote} during {self.op!r})",
                remote_tb="\n".join(last),
            )
        else:
            self._fault("garbage", f"{self.remote} sent an unknown reply {reply!r:.200}")

    def _fault(self, kind: str, reason: str, remote_tb: str = "") -> None:
        if self._finished and self._error is not None:
            return
        self._finished = True
        if self in self.remote.inflight:
            self.remote.inflight.remove(self)
        error = SandboxFault(kind, reason)
        error.remote_traceback = remote_tb  # type: ignore[attr-defined]
        self._error = error
        if self._on_fault is not None:
            self._on_fault(kind, reason)
        else:
            self.remote.kill()
        if kind == "crash" and self.remote.exit_note and self.remote.exit_note not in reason:
            error.reason = f"{reason}; {self.remote.exit_note}"
            error.args = (f"sandbox fault ({kind}): {error.reason}",)


def wait_some(calls: Sequence[Call], pending: set[int]) -> set[int]:
    """Blocks until at least one of `calls[i] for i in pending` finishes; returns those that did.

    Calls past their deadline are expired (and so finish). `pending` is not modified.
    """
    while True:
        now = time.monotonic()
        for i in pending:
            if calls[i].deadline <= now and calls[i].fileno() is not None:
                calls[i].expire()
        done = {i for i in pending if calls[i].fileno() is None}
        if done:
            return done
        by_fd: dict[int, list[int]] = {}
        for i in pending:
            by_fd.setdefault(calls[i].fileno(), []).append(i)
        timeout = min(min(calls[i].deadline for i in pending) - time.monotonic(), 3600.0)
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        for fd, _ in poller.poll(max(0, int(timeout * 1000) + 1)):
            for i in by_fd[fd]:
                calls[i].on_readable()


def wait_all(calls: Sequence[Call]) -> None:
    """Waits until every call has finished, expiring those past their deadline."""
    pending = set(range(len(calls)))
    while pending:
        pending -= wait_some(calls, pending)


class RemoteSandbox(Sandbox):
    """A sandbox whose environment lives in a worker process behind a `Remote`.

    Resets and steps are requests with the backend's deadlines; a fault (crash, hang, garbage,
    env error) kills the worker through the backend, which marks the sandbox faulted. Backends
    that swap the worker (a restore) assign `remote`.
    """

    def __init__(self, backend: Any, remote: Remote):
        super().__init__(backend)
        self.remote = remote

    def pid(self) -> int | None:
        return self.remote.pid

    def start_reset(self, task: Task) -> Call:
        self._check_open()

        def convert(value: Any) -> tuple[str, dict]:
            observation, info = value
            self._after_reset(task)
            return observation, info

        return self._request("reset", task, self.backend.reset_timeout_s, convert)

    def start_step(self, action: str | None) -> Call:
        self._check_open()

        def convert(value: Any) -> StepResult:
            result = StepResult(*value)
            self._after_step(result)
            return result

        return self._request("step", action, self.backend.step_timeout_s, convert)

    def _request(self, op: str, arg: Any, timeout_s: float, convert: Callable[[Any], Any]) -> Call:
        """Sends `op(arg)` to the worker; a failed call faults this sandbox (`_on_fault`)."""
        return self.remote.request(
            op, arg, timeout_s=timeout_s, on_fault=self._on_fault, convert=convert
        )

    def _on_fault(self, kind: str, reason: str) -> None:
        self.backend._fault(self)
