"""The sandbox protocol: errors, snapshot handles, calls in flight, and the `Sandbox` itself.

A *backend* owns every sandbox of one environment configuration (name + constructor kwargs) and
every snapshot taken of them. A *sandbox* plays one episode at a time of a gymnasium text env
(`reset(task)` -> `(observation, info)`, `step(action)` -> `StepResult`, with `done =
terminated or truncated`) and adds `snapshot()` (a cheap handle to the current state) and
`restore(handle)`; the backend adds `fork(handle, n)` (n new sandboxes at a snapshot's state)
and `release(handle)`.

Handles are plain tokens: the state they name lives in the backend (a frozen process, a CRIU
image, a copied object, an action prefix) until `release`. Using a released handle, or one from
another backend, raises `HandleError`.

Backends (`envs.sandbox.backend`) are chosen by name from a registry (`make_backend("fork",
"alfworld", {...})`): `inprocess`, `fork`, `criu` and `replay`. They differ in cost and in what
they can snapshot, never in what a sandbox observes: the same actions from the same snapshot give
the same observations, rewards and done flags on every backend (tests check them all against
`replay`).

Process-based backends also answer asynchronously (`start_reset`, `start_step` return a `Call`),
which lets `SandboxPool` run many sandboxes in parallel with per-request timeouts.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from envs.base import StepResult, Task

__all__ = [
    "BackendUnavailableError",
    "Call",
    "DoneCall",
    "HandleError",
    "Sandbox",
    "SandboxError",
    "SandboxFault",
    "SandboxOwner",
    "SnapshotHandle",
    "SnapshotLimitError",
    "SnapshotUnsupportedError",
]


class SandboxError(RuntimeError):
    """Base class of the errors this package raises."""


class SandboxFault(SandboxError):
    """A sandbox stopped working: its process crashed, hung, sent garbage, or its env raised.

    The sandbox is dead afterwards (its processes are killed); start a new one.

    Attributes:
        kind: One of "crash", "timeout", "garbage", "error" (the env raised).
        reason: Human-readable cause, e.g. "worker pid 123 exited (signal SIGKILL)".
    """

    def __init__(self, kind: str, reason: str):
        super().__init__(f"sandbox fault ({kind}): {reason}")
        self.kind = kind
        self.reason = reason


class SnapshotUnsupportedError(SandboxError):
    """The backend cannot snapshot this environment (the message says why and what to use)."""


class HandleError(SandboxError, ValueError):
    """A snapshot handle was used after `release`, or with a backend that did not create it."""


class BackendUnavailableError(SandboxError):
    """The backend cannot run on this machine (e.g. `criu check` fails); the message says why."""


class SnapshotLimitError(SandboxError):
    """Taking another snapshot would exceed the backend's `max_snapshots` (policy "error")."""


@dataclasses.dataclass(frozen=True, eq=False)
class SnapshotHandle:
    """A token for one saved sandbox state. Cheap to hold; release it with `backend.release`.

    Attributes:
        backend_id: Identity of the backend that owns the state.
        index: Serial number of the snapshot within its backend.
        steps: Actions taken in the episode when the snapshot was taken.
        task_id: The episode's task id (None if no episode was running).
    """

    backend_id: int
    index: int
    steps: int
    task_id: str | None

    def __repr__(self) -> str:
        return f"SnapshotHandle(#{self.index}, steps={self.steps}, task={self.task_id!r})"


class Call(abc.ABC):
    """A request in flight to one sandbox; `SandboxPool` waits on many at once.

    A call is finished when `fileno()` is None. Otherwise the caller polls `fileno()` for input,
    calls `on_readable()` when there is some, and `expire()` once `deadline` (time.monotonic) has
    passed. `result()` then returns the value or raises (a `SandboxFault` for a dead sandbox).
    """

    deadline: float = float("inf")

    @abc.abstractmethod
    def fileno(self) -> int | None:
        """The fd to poll for the reply, or None if the call is finished."""

    def on_readable(self) -> None:  # noqa: B027 - optional: a finished call needs none.
        """Consumes the input available on `fileno()`; may finish the call."""

    def expire(self) -> None:  # noqa: B027 - optional: a finished call needs none.
        """Gives up on the call after its deadline: the sandbox is killed and marked faulted."""

    @abc.abstractmethod
    def result(self) -> Any:
        """The reply, once finished; raises what the call failed with."""


class DoneCall(Call):
    """A call that finished when it was made (in-process backends)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value = value
        self._error = error

    @classmethod
    def run(cls, fn: Callable[[], Any]) -> DoneCall:
        try:
            return cls(fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller by result().
            return cls(error=e)

    def fileno(self) -> int | None:
        return None

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class SandboxOwner(Protocol):
    """What a sandbox asks of the backend that made it (`envs.sandbox.backend.SandboxBackend`).

    A protocol, so that imports run one way: the backend's module imports this one.
    """

    @property
    def name(self) -> str: ...

    def _take_snapshot(self, sandbox: Sandbox) -> SnapshotHandle: ...

    def _restore_into(self, sandbox: Sandbox, handle: SnapshotHandle) -> None: ...

    def _close_sandbox(self, sandbox: Sandbox) -> None: ...

    def _fault(self, sandbox: Sandbox) -> None: ...


class Sandbox(abc.ABC):
    """One environment instance with snapshot/restore. Create it with `backend.new_sandbox()`."""

    def __init__(self, backend: SandboxOwner):
        self.backend = backend
        self.closed = False
        self.steps = 0  # Actions taken in the current episode.
        self.task: Task | None = None
        self.done = True  # No episode running until reset.

    # Synchronous API ----------------------------------------------------------------------------

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Starts an episode of `task`: the env's `reset(options={"task": task})`."""
        return self.start_reset(task).result()

    def step(self, action: str | None) -> StepResult:
        """Plays one action: the env's `step`, as `envs.base.step_result` reports it."""
        return self.start_step(action).result()

    def snapshot(self) -> SnapshotHandle:
        """Saves the current state; the handle stays valid until `backend.release(handle)`."""
        self._check_open()
        return self.backend._take_snapshot(self)

    def restore(self, handle: SnapshotHandle) -> None:
        """Puts this sandbox into the state saved in `handle` (the handle stays valid)."""
        self._check_open()
        self.backend._restore_into(self, handle)

    def close(self) -> None:
        """Frees the sandbox (kills its processes). Safe to call more than once."""
        if not self.closed:
            self.closed = True
            self.backend._close_sandbox(self)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Asynchronous API, for pools ----------------------------------------------------------------

    @abc.abstractmethod
    def start_reset(self, task: Task) -> Call:
        """Starts `reset(task)`; the call's result is `(observation, info)`."""

    @abc.abstractmethod
    def start_step(self, action: str | None) -> Call:
        """Starts `step(action)`; the call's result is a `StepResult`."""

    def pid(self) -> int | None:
        """Host pid of the process that runs the environment (None for in-process backends)."""
        return None

    # Helpers for subclasses ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"{self!r} is closed; create a new sandbox with new_sandbox().")

    def _after_reset(self, task: Task) -> None:
        self.task, self.steps, self.done = task, 0, False

    def _after_step(self, result: StepResult) -> None:
        self.steps += 1
        self.done = bool(result.done)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"steps={self.steps}"
        return f"<{type(self).__name__} {self.backend.name} {state}>"
