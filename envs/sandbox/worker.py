"""The worker side: a process that owns one environment and answers requests over its channel.

Requests are `(op, args)` frames; replies are one of
- `("ok", value)`,
- `("err", type_name, message, traceback)`: the environment raised; the sandbox is faulted,
- `("refused", message)`: the request cannot be served here (e.g. an unsupported snapshot); the
  sandbox is fine.

Ops every worker serves: `reset(task)` and `step(action)` (the env's gymnasium `reset(options=
{"task": task})` and `step`, reported as `envs.base.step_result` does), and `ping()`; backends
add their own (the fork server adds `snapshot`). A worker exits when its channel closes (the
trainer is gone).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from envs.base import reset_to, step_result
from envs.sandbox import wire

__all__ = [
    "Channel",
    "Refused",
    "current_reply_fd",
    "detach_stdio",
    "flush_stdio",
    "reset_signals_for_worker",
    "serve",
    "worker_environ",
]

_reply_fd: int | None = None


def current_reply_fd() -> int | None:
    """The fd this worker writes replies to (None outside a worker). For fault-injection tests."""
    return _reply_fd


class Refused(Exception):
    """Raised by an op handler to refuse a request without faulting the sandbox."""


class Channel:
    """A worker's end of its channel: read and write fds (equal for a socket)."""

    def __init__(self, rfd: int, wfd: int, want_fds: bool = False):
        self.rfd = rfd
        self.wfd = wfd
        self.reader = wire.FrameReader(rfd, want_fds=want_fds)

    def recv(self) -> Any:
        return wire.recv_blocking(self.reader)

    def send(self, obj: Any) -> None:
        wire.send_blocking(self.wfd, obj)

    def close(self) -> None:
        wire.close_channel(self.reader, self.rfd, self.wfd)


# A worker serves one request at a time: math-library thread pools only slow down its forks and
# checkpoints (more threads to copy, freeze and shoot down TLBs for) and oversubscribe the CPUs.
_SINGLE_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_environ() -> dict[str, str]:
    """Environment variables for a worker process: ours, with thread pools of one unless set.

    `PYTHONPATH` gets this process's import path, so that a worker imports every module the
    trainer can (a user's env found through a path the trainer added, e.g. by pytest).
    """
    environ = dict(os.environ)
    for name in _SINGLE_THREAD_VARS:
        environ.setdefault(name, "1")
    # The interpreter's own folders (stdlib, site-packages) are on every worker's path already.
    own = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    ours = [
        os.path.abspath(p)
        for p in sys.path
        if p and os.path.isdir(p) and not os.path.abspath(p).startswith(own)
    ]
    given = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(given + ours))
    return environ


def detach_stdio() -> None:
    """Points stdin at /dev/null, so a worker never competes with the trainer for input."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


def _encode_reply(reply: tuple) -> bytes:
    try:
        return wire.encode(reply)
    except Exception as e:  # noqa: BLE001 - an unpicklable value is the env's bug, reported.
        return wire.encode(
            ("err", type(e).__name__, f"reply could not be pickled: {e}", traceback.format_exc())
        )


def serve(
    env: Any,
    channel: Channel,
    extra_ops: dict[str, Callable[[Any, Channel, tuple], Any]] | None = None,
    after_reply: Callable[[], None] | None = None,
) -> None:
    """Answers requests for `env` until the channel closes (then returns).

    Exceptions other than `Exception` subclasses (e.g. a role switch after a fork) propagate.

    Args:
        env: The environment.
        channel: The worker's channel.
        extra_ops: op name -> handler(env, channel, args) for backend-specific ops.
        after_reply: Called after each reply is sent (housekeeping off the critical path).
    """
    global _reply_fd
    _reply_fd = channel.wfd
    ops = extra_ops or {}
    while True:
        try:
            op, args = channel.recv()
        except (wire.PeerClosed, wire.ProtocolError, OSError):
            return
        try:
            if op == "step":
                # Plain tuple on the wire: cheaper, and the trainer rebuilds the StepResult.
                value = tuple(step_result(env, *args))
            elif op == "reset":
                value = reset_to(env, *args)
            elif op == "ping":
                value = os.getpid()
            elif op == "exit":
                channel.send(("ok", None))
                return
            elif op in ops:
                value = ops[op](env, channel, args)
            else:
                raise Refused(f"unknown op {op!r}")
            reply: tuple = ("ok", value)
        except Refused as e:
            reply = ("refused", str(e))
        except Exception as e:  # noqa: BLE001 - the env's failure is the trainer's to handle.
            reply = ("err", type(e).__name__, str(e), traceback.format_exc())
        try:
            wire.write_all(channel.wfd, _encode_reply(reply))
        except OSError:
            return
        if after_reply is not None:
            after_reply()


def flush_stdio() -> None:
    """Flushes Python's stdio buffers, so that a fork does not print them twice."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream is fine.
            pass


def reset_signals_for_worker() -> None:
    """Gives the env default SIGCHLD and SIGTERM handling (its parent may have changed them)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
