"""`SandboxBackend`: creates the sandboxes of one environment configuration and owns their
snapshots; and the registry that picks a backend by name (`make_backend`).

Backends differ in cost and in what they can snapshot, never in what a sandbox observes: the same
actions from the same snapshot give the same observations, rewards and done flags on every
backend (tests check them all against `replay`). The environment is named as `envs.base.make_env`
names it (short name, gymnasium id or entry point); workers import `envs.registry.preload_for`
of it before they create the env.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import itertools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from envs.base import Task
from envs.sandbox.base import (
    HandleError,
    Sandbox,
    SandboxError,
    SnapshotHandle,
    SnapshotLimitError,
)

__all__ = [
    "SandboxBackend",
    "import_modules",
    "known_backends",
    "make_backend",
    "register_backend",
]


_B = TypeVar("_B", bound="type[SandboxBackend]")


@dataclasses.dataclass
class _Held:
    """A held snapshot: the backend's own record plus the episode bookkeeping at that point."""

    record: Any
    task: Task | None
    steps: int
    done: bool

    def apply(self, sandbox: Sandbox) -> None:
        sandbox.task, sandbox.steps, sandbox.done = self.task, self.steps, self.done


class SandboxBackend(abc.ABC):
    """Creates sandboxes of one environment configuration and owns their snapshots.

    Bounded memory: at most `max_snapshots` snapshots are held at once (None: no limit). When a
    new snapshot would exceed it, `snapshot_policy` decides: "error" raises `SnapshotLimitError`
    (the caller must release some), "evict_oldest" releases the oldest held snapshot first (its
    handle then raises `HandleError` like any released handle).

    Args:
        env_name: Short name, gymnasium id or entry point (`envs.base.make_env`).
        env_kwargs: Constructor kwargs of the environment.
        step_timeout_s: Seconds a step may take before the sandbox counts as hung.
        reset_timeout_s: Same for reset (and for starting a sandbox).
        max_snapshots: Cap on snapshots held at once, or None.
        snapshot_policy: "error" or "evict_oldest".
    """

    name: ClassVar[str] = "?"
    _ids = itertools.count(1)

    def __init__(
        self,
        env_name: str,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        step_timeout_s: float = 60.0,
        reset_timeout_s: float = 120.0,
        max_snapshots: int | None = None,
        snapshot_policy: str = "error",
    ):
        if not step_timeout_s > 0 or not reset_timeout_s > 0:
            raise ValueError(
                f"Timeouts must be positive, got step_timeout_s={step_timeout_s!r}, "
                f"reset_timeout_s={reset_timeout_s!r}."
            )
        if max_snapshots is not None and max_snapshots < 1:
            raise ValueError(f"max_snapshots must be >= 1 or None, got {max_snapshots!r}.")
        if snapshot_policy not in ("error", "evict_oldest"):
            raise ValueError(
                f"snapshot_policy must be 'error' or 'evict_oldest', got {snapshot_policy!r}."
            )
        self.env_name = env_name
        self.env_kwargs = dict(env_kwargs or {})
        self.step_timeout_s = float(step_timeout_s)
        self.reset_timeout_s = float(reset_timeout_s)
        self.max_snapshots = max_snapshots
        self.snapshot_policy = snapshot_policy
        self.id = next(SandboxBackend._ids)
        self.closed = False
        self._snapshot_index = itertools.count(1)
        self._snapshots: dict[int, _Held] = {}  # Snapshot index -> state; oldest first.
        self._sandboxes: set[Sandbox] = set()
        self.counts = {
            "snapshots": 0,
            "restores": 0,
            "clones": 0,
            "faults": 0,
            "evictions": 0,
            "resets": 0,
        }

    # Public API ---------------------------------------------------------------------------------

    def new_sandbox(self) -> Sandbox:
        """A new sandbox with no episode running; `reset` it first."""
        self._check_open()
        sandbox = self._new_sandbox()
        self._sandboxes.add(sandbox)
        return sandbox

    def new_sandboxes(self, n: int) -> list[Sandbox]:
        """`n` new sandboxes (backends may start them in parallel)."""
        self._check_open()
        sandboxes = self._new_sandboxes(n)
        self._sandboxes.update(sandboxes)
        return sandboxes

    def fork(self, handle: SnapshotHandle, n: int) -> list[Sandbox]:
        """`n` new sandboxes, each at the state saved in `handle` (which stays valid)."""
        self._check_open()
        if n < 0:
            raise ValueError(f"fork needs n >= 0 copies, got {n}.")
        held = self._held(handle)
        sandboxes = self._fork(handle, held.record, n)
        for sandbox in sandboxes:
            held.apply(sandbox)
        self._sandboxes.update(sandboxes)
        self.counts["restores"] += len(sandboxes)
        return sandboxes

    def clone(self, sandbox: Sandbox, n: int) -> list[Sandbox]:
        """`n` new sandboxes at `sandbox`'s current state; `sandbox` goes on unchanged.

        The same as `snapshot`, `fork(handle, n)` and `release(handle)`, which is how backends
        without a direct path do it. The fork server forks the live worker `n` times: one
        `os.fork` per copy instead of `n + 1`, and no frozen process in between (this is what a
        BPO branch point does).
        """
        self._check_open()
        sandbox._check_open()
        if n < 0:
            raise ValueError(f"clone needs n >= 0 copies, got {n}.")
        if n == 0:
            return []
        copies = self._clone(sandbox, n)
        if copies is None:
            handle = sandbox.snapshot()
            try:
                return self.fork(handle, n)
            finally:
                self.release(handle)
        for copy in copies:
            copy.task, copy.steps, copy.done = sandbox.task, sandbox.steps, sandbox.done
        self._sandboxes.update(copies)
        self.counts["clones"] += len(copies)
        return copies

    def release(self, handle: SnapshotHandle) -> None:
        """Frees the state saved in `handle`; using the handle afterwards raises `HandleError`."""
        self._held(handle)
        self._free_snapshot(self._snapshots.pop(handle.index).record)

    def held_snapshots(self) -> int:
        return len(self._snapshots)

    def live_sandboxes(self) -> int:
        return sum(1 for s in self._sandboxes if not s.closed)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: live sandboxes, held snapshots, bytes they hold, event counts."""
        return {
            "backend": self.name,
            "live_sandboxes": self.live_sandboxes(),
            "held_snapshots": self.held_snapshots(),
            "snapshot_bytes": sum(self._snapshot_bytes(h.record) for h in self._snapshots.values()),
            "max_snapshots": self.max_snapshots,
            "snapshot_policy": self.snapshot_policy,
            **self.counts,
        }

    def close(self) -> None:
        """Closes every sandbox and frees every snapshot. Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        for sandbox in list(self._sandboxes):
            sandbox.closed = True
            self._close_sandbox(sandbox)
        self._sandboxes.clear()
        for held in self._snapshots.values():
            self._free_snapshot(held.record)
        self._snapshots.clear()
        self._shutdown()

    def __enter__(self) -> SandboxBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # What backends implement ---------------------------------------------------------------------

    @abc.abstractmethod
    def _new_sandbox(self) -> Sandbox: ...

    def _new_sandboxes(self, n: int) -> list[Sandbox]:
        sandboxes: list[Sandbox] = []
        try:
            for _ in range(n):
                sandboxes.append(self._new_sandbox())
        except BaseException:
            for sandbox in sandboxes:
                self._close_sandbox_impl(sandbox)
            raise
        return sandboxes

    @abc.abstractmethod
    def _snapshot_state(self, sandbox: Sandbox) -> Any:
        """Saves `sandbox`'s state and returns the record `_fork`/`_restore_into` read."""

    @abc.abstractmethod
    def _fork(self, handle: SnapshotHandle, record: Any, n: int) -> list[Sandbox]: ...

    @abc.abstractmethod
    def _restore_state(self, sandbox: Sandbox, handle: SnapshotHandle, record: Any) -> None: ...

    @abc.abstractmethod
    def _free_snapshot(self, record: Any) -> None: ...

    @abc.abstractmethod
    def _close_sandbox_impl(self, sandbox: Sandbox) -> None: ...

    def _clone(self, sandbox: Sandbox, n: int) -> list[Sandbox] | None:
        """Direct copies of a live sandbox, or None to go through a snapshot (the default)."""
        return None

    def _snapshot_bytes(self, record: Any) -> int:
        """Memory or disk the snapshot holds that nothing else does (best effort)."""
        return 0

    def _shutdown(self) -> None:  # noqa: B027 - optional hook.
        """Frees backend-wide resources after every sandbox and snapshot is gone."""

    # Shared machinery ---------------------------------------------------------------------------

    def _take_snapshot(self, sandbox: Sandbox) -> SnapshotHandle:
        self._check_open()
        if self.max_snapshots is not None and len(self._snapshots) >= self.max_snapshots:
            if self.snapshot_policy == "error":
                raise SnapshotLimitError(
                    f"{self.name} backend already holds {len(self._snapshots)} snapshots "
                    f"(max_snapshots={self.max_snapshots}); release some with release(handle) or "
                    "use snapshot_policy='evict_oldest'."
                )
            oldest = next(iter(self._snapshots))
            self._free_snapshot(self._snapshots.pop(oldest).record)
            self.counts["evictions"] += 1
        record = self._snapshot_state(sandbox)
        index = next(self._snapshot_index)
        self.counts["snapshots"] += 1
        self._snapshots[index] = _Held(record, sandbox.task, sandbox.steps, sandbox.done)
        task_id = getattr(sandbox.task, "task_id", None)
        return SnapshotHandle(self.id, index, sandbox.steps, task_id)

    def _restore_into(self, sandbox: Sandbox, handle: SnapshotHandle) -> None:
        held = self._held(handle)
        self._restore_state(sandbox, handle, held.record)
        held.apply(sandbox)
        self.counts["restores"] += 1

    def _close_sandbox(self, sandbox: Sandbox) -> None:
        self._sandboxes.discard(sandbox)
        self._close_sandbox_impl(sandbox)

    def _held(self, handle: SnapshotHandle) -> _Held:
        if not isinstance(handle, SnapshotHandle):
            raise HandleError(
                f"Expected a SnapshotHandle, got {type(handle).__name__}: {handle!r}."
            )
        if handle.backend_id != self.id:
            raise HandleError(
                f"{handle!r} belongs to another sandbox backend (id {handle.backend_id}), not to "
                f"this {self.name} backend (id {self.id}); snapshots cannot move between pools."
            )
        held = self._snapshots.get(handle.index)
        if held is None:
            raise HandleError(
                f"{handle!r} was released (or evicted by max_snapshots={self.max_snapshots}); "
                "take a new snapshot."
            )
        return held

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"The {self.name} sandbox backend is closed.")

    def _fault(self, sandbox: Sandbox) -> None:
        """Counts a fault; the sandbox is dead and closed."""
        self.counts["faults"] += 1
        if not sandbox.closed:
            sandbox.close()


def import_modules(modules: tuple[str, ...] | list[str]) -> None:
    """Imports each module (registering the envs they define)."""
    for module in modules:
        importlib.import_module(module)


# Backend registry -------------------------------------------------------------------------------

_REGISTRY: dict[str, type[SandboxBackend]] = {}
_BUILTIN_MODULES = {
    "inprocess": "envs.sandbox.inprocess",
    "fork": "envs.sandbox.forkserver",
    "criu": "envs.sandbox.criu",
    "replay": "envs.sandbox.replay",
}


def register_backend(name: str) -> Callable[[_B], _B]:
    """Class decorator: makes a `SandboxBackend` subclass constructible by `make_backend(name)`."""

    def decorator(cls: _B) -> _B:
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(
                f"Sandbox backend {name!r} is already registered to {existing.__qualname__}."
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def known_backends() -> list[str]:
    """The names `make_backend` accepts."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def make_backend(
    name: str, env_name: str, env_kwargs: Mapping[str, Any] | None = None, **options: Any
) -> SandboxBackend:
    """Creates the sandbox backend registered under `name` for one environment configuration.

    Args:
        name: "inprocess", "fork", "criu", "replay", or another registered name.
        env_name: Short name, gymnasium id or entry point (`envs.base.make_env`).
        env_kwargs: The environment's constructor kwargs.
        **options: Backend options (timeouts, max_snapshots, snapshot_policy, backend-specific).

    Raises:
        ValueError: If no backend is registered under `name`.
        BackendUnavailableError: If the backend cannot run here (the message says why).
    """
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"Unknown sandbox backend {name!r}; known backends: {known_backends()}.")
    return _REGISTRY[name](env_name, env_kwargs, **options)
