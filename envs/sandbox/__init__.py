"""Snapshottable sandboxes around `envs.base` environments, and the pool the trainer uses.

Backends (chosen by name, same observable behaviour): `inprocess` (deep copy of the env's Python
state), `fork` (fork-server worker processes; a snapshot is a frozen fork), `criu` (the worker's
whole process tree checkpointed with CRIU, each copy in its own PID namespace) and `replay`
(reset and replay the action prefix; the reference). See DESIGN.md, "Sandboxes".

Example:
    from envs.sandbox import SandboxPool

    with SandboxPool("alfworld", {"max_steps": 50}, backend="fork") as pool:
        sid, observation, info = pool.reset(task)
        handle = pool.snapshot(sid)
        a, b = pool.fork(handle, 2)
        results = pool.step_many([(a, "go to desk 1"), (b, "go to bed 1")])
        pool.release(handle)
"""

from envs.sandbox.backend import SandboxBackend, known_backends, make_backend, register_backend
from envs.sandbox.base import (
    BackendUnavailableError,
    HandleError,
    Sandbox,
    SandboxError,
    SandboxFault,
    SnapshotHandle,
    SnapshotLimitError,
    SnapshotUnsupportedError,
)

__all__ = [
    "BackendUnavailableError",
    "HandleError",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxFault",
    "SandboxPool",
    "SnapshotHandle",
    "SnapshotLimitError",
    "SnapshotUnsupportedError",
    "known_backends",
    "make_backend",
    "register_backend",
]


def __getattr__(name: str):
    # The pool pulls in every process backend; import it only when asked for.
    if name == "SandboxPool":
        from envs.sandbox.pool import SandboxPool

        return SandboxPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
