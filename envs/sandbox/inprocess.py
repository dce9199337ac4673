"""The `inprocess` backend: a snapshot is `copy.deepcopy` of the environment object.

Cheapest where it works: environments whose whole state is plain Python objects (the test MDPs).
Environments that hold live resources (ALFWorld's textworld game, a subprocess, a socket)
cannot be copied; their snapshot fails with `SnapshotUnsupportedError` naming the class and the
reason (use the `fork` or `criu` backend for them).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from envs.sandbox.backend import register_backend
from envs.sandbox.base import Sandbox, SnapshotHandle, SnapshotUnsupportedError
from envs.sandbox.local import LocalBackend, LocalSandbox

__all__ = ["InProcessBackend"]


class _Copy:
    """A held snapshot: a private deep copy of the env (copied again on every restore)."""

    def __init__(self, env: Any):
        self.env = env
        try:
            self.nbytes = len(pickle.dumps(env, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - size is best effort.
            self.nbytes = 0


@register_backend("inprocess")
class InProcessBackend(LocalBackend):
    """In-process sandboxes snapshotted by deep copy; see the module docstring."""

    def _copy(self, env: Any) -> Any:
        try:
            return copy.deepcopy(env)
        except Exception as e:  # noqa: BLE001 - every failure means "cannot copy".
            raise SnapshotUnsupportedError(
                f"The inprocess backend cannot snapshot {type(env).__module__}."
                f"{type(env).__qualname__} (env {self.env_name!r}): copy.deepcopy failed with "
                f"{type(e).__name__}: {e}. Use backend='fork' (or 'criu' if the env runs child "
                "processes)."
            ) from e

    def _snapshot_state(self, sandbox: Sandbox) -> _Copy:
        assert isinstance(sandbox, LocalSandbox)
        return _Copy(self._copy(sandbox.env))

    def _fork(self, handle: SnapshotHandle, record: _Copy, n: int) -> list[Sandbox]:
        return [LocalSandbox(self, self._copy(record.env)) for _ in range(n)]

    def _restore_state(self, sandbox: Sandbox, handle: SnapshotHandle, record: _Copy) -> None:
        assert isinstance(sandbox, LocalSandbox)
        env, sandbox.env = sandbox.env, self._copy(record.env)
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass

    def _free_snapshot(self, record: _Copy) -> None:
        record.env = None

    def _snapshot_bytes(self, record: _Copy) -> int:
        return record.nbytes
