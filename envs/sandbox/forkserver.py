"""The `fork` backend: each sandbox is a worker process; a snapshot is a frozen `os.fork()` of it.

Costs: a snapshot or a restore is one fork of a process whose memory is shared copy-on-write
(milliseconds, flat in the episode's length); a held snapshot costs the pages the live workers
have since written (reported from /proc/<pid>/smaps_rollup). See `forkserver_proc` for the
process side and the process tree: trainer -> keeper -> zygote -> workers -> frozen copies ->
workers. The keeper (a child subreaper) keeps every process of the backend below it, so that a
SIGKILLed zygote's workers are still the backend's (counted, driven, reaped); the next new
sandbox then starts a new keeper and zygote.

Limits: only the worker process is copied. An env that keeps state in child processes refuses
to snapshot (use `criu`); one that keeps state in open files shares their offsets between copies.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.registry import preload_for
from envs.sandbox import procutil, wire
from envs.sandbox.backend import SandboxBackend, register_backend
from envs.sandbox.base import (
    BackendUnavailableError,
    Sandbox,
    SandboxError,
    SandboxFault,
    SnapshotHandle,
    SnapshotUnsupportedError,
)
from envs.sandbox.remote import Remote, RemoteCall, RemoteSandbox, wait_all
from envs.sandbox.worker import worker_environ

__all__ = ["ForkBackend", "ForkSandbox"]

# Control requests (spawn, snapshot) are quick forks; past this the process is hung.
_CONTROL_TIMEOUT_S = 30.0


def _receive_hello(fd: int, timeout_s: float) -> int:
    """The zygote's pid, the first frame on its channel (read before the channel's `Remote`).

    Raises:
        SandboxFault: If it does not come within `timeout_s`, the channel closes, or it is not
            a frame.
    """
    reader = wire.FrameReader(fd)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            done, message = reader.pop()
            if done:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise SandboxFault("timeout", f"no word from the zygote in {timeout_s:g} s")
            if not reader.fill():
                raise SandboxFault("crash", "the keeper exited before the zygote started")
    except wire.ProtocolError as e:
        raise SandboxFault("garbage", f"the zygote sent garbage: {e}") from e
    finally:
        reader.close()
    if not (isinstance(message, tuple) and len(message) == 2 and message[0] == "ok"):
        raise SandboxFault("garbage", f"the zygote's first word is {message!r}, not its pid")
    return int(message[1])


class _Frozen:
    """A held snapshot: the frozen process and the trainer's channel to it."""

    def __init__(self, remote: Remote):
        self.remote = remote


class ForkSandbox(RemoteSandbox):
    """A sandbox whose environment lives in a fork-server worker process."""

    backend: ForkBackend


@register_backend("fork")
class ForkBackend(SandboxBackend):
    """Fork-server sandboxes; see the module docstring.

    Args:
        env_name, env_kwargs, step_timeout_s, reset_timeout_s, max_snapshots, snapshot_policy:
            See `SandboxBackend`.
        preload: Modules the zygote imports before creating the env (default:
            `envs.registry.preload_for(env_name)`), so that workers start with them imported.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        preload: Sequence[str] | None = None,
        **options: Any,
    ):
        super().__init__(env_name, env_kwargs, **options)
        self._preload = tuple(preload_for(env_name) if preload is None else preload)
        # Keepers of zygotes that died: each holds the dead zygote's workers until they are
        # killed, then exits by itself; shutdown makes sure of it.
        self._retired: list[subprocess.Popen] = []
        self._start_zygote()

    def _start_zygote(self) -> None:
        """Starts a keeper and its zygote and sets the env up in it.

        Raises:
            BackendUnavailableError: If the zygote does not start or cannot create the env.
        """
        ours, theirs = socket.socketpair()
        try:
            # The keeper: it forks the zygote and keeps every process below it (see
            # forkserver_proc), so that none escapes this backend, not even a dead zygote's.
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", "envs.sandbox.forkserver_proc", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                process_group=0,
                env=worker_environ(),
            )
        finally:
            theirs.close()
        fd = ours.detach()
        try:
            pid = _receive_hello(fd, _CONTROL_TIMEOUT_S)
        except SandboxFault as e:
            os.close(fd)
            _stop_keeper(self._keeper, sigterm_first=True)
            raise BackendUnavailableError(f"The fork server did not start: {e.reason}") from e
        self._zygote = Remote(pid, fd, fd, pgid=None, label="fork-server zygote")
        try:
            self._zygote.call(
                "init", self.env_name, self.env_kwargs, self._preload,
                timeout_s=self.reset_timeout_s,
            )  # fmt: skip
        except (SandboxError, SandboxFault) as e:
            self._stop_zygote()
            raise BackendUnavailableError(
                f"The fork server could not set up env {self.env_name!r} with "
                f"{self.env_kwargs}: {e}"
            ) from e

    def _live_zygote(self) -> Remote:
        """The zygote; a new one (keeper and all) if it died, so that resets go on working."""
        if self._zygote.dead or not self._zygote.alive():
            self._zygote.let_go()
            self._retired.append(self._keeper)
            self._start_zygote()
        return self._zygote

    # Process plumbing ---------------------------------------------------------------------------

    def _spawn_from(
        self, parent: Remote, n: int, label: str, op: str = "spawn", on_fault=None
    ) -> list[Remote]:
        """Asks `parent` for `n` new workers (pipelined): `spawn` of the zygote or a frozen copy,
        or `clone` of a live worker.

        Raises:
            SnapshotUnsupportedError: the parent refused (a worker with child processes).
            SandboxFault: the parent failed; `on_fault` (default: kill it) has run.
        """
        if on_fault is None:

            def on_fault(kind: str, reason: str) -> None:
                parent.kill()

        pairs = [socket.socketpair() for _ in range(n)]
        calls: list[RemoteCall] = []
        try:
            for _, theirs in pairs:
                calls.append(
                    parent.request(
                        op, timeout_s=_CONTROL_TIMEOUT_S, fds=[theirs.fileno()], on_fault=on_fault
                    )
                )
        finally:
            for _, theirs in pairs:
                theirs.close()
        wait_all(calls)
        remotes, errors = [], []
        for (ours, _), call in zip(pairs, calls):
            try:
                pid = call.result()
            except SandboxError as e:
                ours.close()
                errors.append(e)
                continue
            fd = ours.detach()
            remotes.append(Remote(pid, fd, fd, label=label))
        if errors:
            for remote in remotes:
                remote.kill()
            if isinstance(errors[0], SandboxFault):
                raise errors[0]
            reason = getattr(errors[0], "refused_reason", None)
            if reason is not None:
                raise SnapshotUnsupportedError(
                    f"The fork backend cannot copy env {self.env_name!r}: {reason}"
                ) from errors[0]
            raise SandboxFault("crash", f"could not start {label}s: {errors[0]}")
        return remotes

    def _new_sandbox(self) -> Sandbox:
        (remote,) = self._spawn_workers(1)
        return ForkSandbox(self, remote)

    def _new_sandboxes(self, n: int) -> list[Sandbox]:
        remotes = self._spawn_workers(n) if n else []
        return [ForkSandbox(self, remote) for remote in remotes]

    def _spawn_workers(self, n: int) -> list[Remote]:
        """`n` fresh workers from the zygote; if it dies under the request, from a new one."""
        try:
            return self._spawn_from(self._live_zygote(), n, "fork worker")
        except SandboxFault:
            # `_spawn_from` killed the zygote that failed: the next one is started afresh.
            return self._spawn_from(self._live_zygote(), n, "fork worker")

    def _snapshot_state(self, sandbox: Sandbox) -> _Frozen:
        assert isinstance(sandbox, ForkSandbox)
        ours, theirs = socket.socketpair()
        try:
            call = sandbox.remote.request(
                "snapshot",
                timeout_s=_CONTROL_TIMEOUT_S,
                fds=[theirs.fileno()],
                on_fault=sandbox._on_fault,
            )
        finally:
            theirs.close()
        try:
            pid = call.result()
        except SandboxFault:
            ours.close()
            raise
        except SandboxError as e:
            ours.close()
            reason = getattr(e, "refused_reason", str(e))
            raise SnapshotUnsupportedError(
                f"The fork backend cannot snapshot env {self.env_name!r}: {reason}"
            ) from e
        fd = ours.detach()
        return _Frozen(Remote(pid, fd, fd, label="fork snapshot"))

    def _fork(self, handle: SnapshotHandle, record: _Frozen, n: int) -> list[Sandbox]:
        if n == 0:
            return []
        remotes = self._spawn_from(record.remote, n, "fork worker")
        return [ForkSandbox(self, remote) for remote in remotes]

    def _clone(self, sandbox: Sandbox, n: int) -> list[Sandbox]:
        assert isinstance(sandbox, ForkSandbox)
        remotes = self._spawn_from(
            sandbox.remote, n, "fork worker", op="clone", on_fault=sandbox._on_fault
        )
        return [ForkSandbox(self, remote) for remote in remotes]

    def _restore_state(self, sandbox: Sandbox, handle: SnapshotHandle, record: _Frozen) -> None:
        assert isinstance(sandbox, ForkSandbox)
        (remote,) = self._spawn_from(record.remote, 1, "fork worker")
        old, sandbox.remote = sandbox.remote, remote
        old.kill()

    def _free_snapshot(self, record: _Frozen) -> None:
        record.remote.kill()

    def _close_sandbox_impl(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, ForkSandbox)
        sandbox.remote.kill()

    def _snapshot_bytes(self, record: _Frozen) -> int:
        return procutil.private_bytes(record.remote.pid)

    def _shutdown(self) -> None:
        self._stop_zygote()

    def _stop_zygote(self) -> None:
        # End of file on its channel makes the zygote kill whatever is left below it and exit;
        # then the keeper, with nothing left below it, exits too. If the zygote is dead, its
        # keeper holds the orphans: SIGTERM makes it kill them.
        alive = self._zygote.alive()
        self._zygote.let_go()
        _stop_keeper(self._keeper, sigterm_first=not alive)
        for keeper in self._retired:
            _stop_keeper(keeper, sigterm_first=True)
        self._retired.clear()

    def _keepers(self) -> list[subprocess.Popen]:
        return [k for k in [self._keeper, *self._retired] if k.poll() is None]

    def process_count(self) -> int:
        """Processes this backend started but its keepers and live zygote: workers, frozen
        copies, their children, and the workers of zygotes that died."""
        return len([p for p in self.owned_pids() if p not in self._control_pids()])

    def _control_pids(self) -> set[int]:
        return {k.pid for k in self._keepers()} | {self._zygote.pid}

    def owned_pids(self) -> list[int]:
        """Every live process this backend started, its keepers and zygote included."""
        pids = []
        for keeper in self._keepers():
            pids += [keeper.pid, *procutil.descendant_pids(keeper.pid)]
        return pids


def _stop_keeper(keeper: subprocess.Popen, sigterm_first: bool) -> None:
    """Waits for a keeper to exit: 10 s on its own (unless `sigterm_first`), then 10 s after
    SIGTERM (it kills everything below it), then SIGKILL as the last resort."""
    steps = [(None, 10.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)]
    for sig, timeout_s in steps[1 if sigterm_first else 0 :]:
        if sig is not None and keeper.poll() is None:
            keeper.send_signal(sig)
        try:
            keeper.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
