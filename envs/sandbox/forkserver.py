"""The `fork` backend: each sandbox is a worker process; a snapshot is a frozen `os.fork()` of it.

Costs: a snapshot or a restore is one fork of a process whose memory is shared copy-on-write
(milliseconds, flat in the episode's length); a held snapshot costs the pages the live workers
have since written (reported from /proc/<pid>/smaps_rollup). See `forkserver_proc` for the
process side and the process tree.

Limits: only the worker process is copied. An env that keeps state in child processes refuses
to snapshot (use `criu`); one that keeps state in open files shares their offsets between copies.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from envs.registry import preload_for
from envs.sandbox import procutil
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
        if preload is None:
            preload = preload_for(env_name)
        ours, theirs = socket.socketpair()
        try:
            self._zygote_proc = subprocess.Popen(
                [sys.executable, "-m", "envs.sandbox.forkserver_proc", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                process_group=0,
                env=worker_environ(),
            )
        finally:
            theirs.close()
        fd = ours.detach()
        self._zygote = Remote(self._zygote_proc.pid, fd, fd, pgid=None, label="fork-server zygote")
        try:
            self._zygote.call(
                "init", env_name, self.env_kwargs, tuple(preload), timeout_s=self.reset_timeout_s
            )
        except (SandboxError, SandboxFault) as e:
            self._stop_zygote()
            raise BackendUnavailableError(
                f"The fork server could not set up env {env_name!r} with {self.env_kwargs}: {e}"
            ) from e

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
        (remote,) = self._spawn_from(self._zygote, 1, "fork worker")
        return ForkSandbox(self, remote)

    def _new_sandboxes(self, n: int) -> list[Sandbox]:
        remotes = self._spawn_from(self._zygote, n, "fork worker") if n else []
        return [ForkSandbox(self, remote) for remote in remotes]

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
        # End of file on its channel makes the zygote kill whatever is left below it and exit.
        self._zygote.close_channel()
        self._zygote.dead = True
        try:
            self._zygote_proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._zygote_proc.send_signal(signal.SIGKILL)
            self._zygote_proc.wait()

    def process_count(self) -> int:
        """Processes below the zygote (workers, frozen copies, their children)."""
        return len(procutil.descendant_pids(self._zygote_proc.pid))
