"""The `replay` backend: a snapshot is the task and the actions taken; restore replays them.

Works for any deterministic environment and holds almost no memory, but a restore costs a reset
plus one step per recorded action, so it grows with depth. It is the reference the other backends
are tested against. A restore checks that the replay ends in the observation seen when the
snapshot was taken, and raises if it does not (the env is not deterministic).
"""

from __future__ import annotations

import dataclasses
import sys

from envs.base import Task
from envs.sandbox.backend import register_backend
from envs.sandbox.base import Sandbox, SandboxError, SnapshotHandle
from envs.sandbox.local import LocalBackend, LocalSandbox

__all__ = ["ReplayBackend"]


@dataclasses.dataclass(frozen=True)
class _Prefix:
    task: Task | None
    actions: tuple[str | None, ...]
    last_observation: str | None


@register_backend("replay")
class ReplayBackend(LocalBackend):
    """In-process sandboxes restored by reset + replay; see the module docstring."""

    def _snapshot_state(self, sandbox: Sandbox) -> _Prefix:
        assert isinstance(sandbox, LocalSandbox)
        return _Prefix(sandbox.task, tuple(sandbox.actions), sandbox.last_observation)

    def _replay(self, sandbox: LocalSandbox, record: _Prefix) -> None:
        if record.task is None:
            # A snapshot of a sandbox that was never reset: a fresh env is that state.
            self._close_sandbox_impl(sandbox)
            sandbox.env = self._make_env()
            return
        sandbox.reset(record.task)
        for action in record.actions:
            sandbox.step(action)
        if sandbox.last_observation != record.last_observation:
            raise SandboxError(
                f"Replaying {len(record.actions)} actions of task {record.task.task_id!r} on "
                f"{self.env_name!r} ended in {sandbox.last_observation!r}, not in the snapshot's "
                f"{record.last_observation!r}: the env is not deterministic, so the replay "
                "backend cannot restore it."
            )

    def _fork(self, handle: SnapshotHandle, record: _Prefix, n: int) -> list[Sandbox]:
        sandboxes = []
        try:
            for _ in range(n):
                sandbox = LocalSandbox(self, self._make_env())
                sandboxes.append(sandbox)
                self._replay(sandbox, record)
        except BaseException:
            for sandbox in sandboxes:
                self._close_sandbox_impl(sandbox)
            raise
        return sandboxes

    def _restore_state(self, sandbox: Sandbox, handle: SnapshotHandle, record: _Prefix) -> None:
        assert isinstance(sandbox, LocalSandbox)
        self._replay(sandbox, record)

    def _free_snapshot(self, record: _Prefix) -> None:
        pass

    def _snapshot_bytes(self, record: _Prefix) -> int:
        return sys.getsizeof(record.actions) + sum(sys.getsizeof(a) for a in record.actions)
