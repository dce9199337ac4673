"""Process side of the fork-server backend: `python -m envs.sandbox.forkserver_proc <fd>`.

One process runs in one of four roles, switching roles only across `os.fork()`:
- **keeper** (one per backend: the process the trainer starts): forks the zygote and does
  nothing else. It is the child subreaper of everything below it and ignores SIGCHLD, so that
  every process the backend ever starts stays below it, and is reaped the moment it exits, even
  after the zygote died (a SIGKILLed zygote's workers re-parent to it, not to PID 1, and go on
  serving their sandboxes). It exits once the zygote is gone and nothing is left below it; on
  SIGTERM (the trainer's death signal, or the trainer's last word at shutdown) it kills them all.
- **zygote**: imports the environment's modules once, then forks a fresh *worker* per new
  sandbox. It is a child subreaper and ignores SIGCHLD too, so that orphans below it are reaped
  at once; when the trainer goes away (end of file on its channel, or SIGTERM from
  PR_SET_PDEATHSIG) it kills everything below it.
- **worker**: owns one environment and serves reset/step (see `envs.sandbox.worker`). `snapshot`
  forks it: the child becomes a *frozen* copy of the env. `clone` forks it too, and the child is
  a new worker at the same state (a snapshot and a spawn in one fork).
- **frozen**: never touches the env; `spawn` forks it again and the child becomes a worker that
  continues from the frozen state (copy-on-write, a few milliseconds), as often as asked.

Every process talks to the trainer over its own unix socketpair; a new process's end arrives
with the request that creates it (SCM_RIGHTS), so the trainer holds the other end before the
process exists. Every worker and frozen copy leads its own process group, so that killing one
sandbox (and any helper processes it started) never touches another. Each process exits when
its channel closes.

Only the calling process is copied by fork: a worker whose env has child processes (a shell, a
server) refuses to snapshot, since the copy would share those children; use the CRIU backend.

Copies are exact: Python's `random` module, which reseeds itself in every forked child, gets the
parent's state back. The zygote's and frozen copies' heaps are `gc.freeze()`d, so that the cyclic
collector does not write to (and so copy) every shared page in every worker.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import sys
import time
from typing import Any

from envs.sandbox import procutil, wire, worker

__all__ = ["main"]


class _Become(BaseException):
    """Raised in a freshly forked child to drop the parent's stack and take up a new role."""

    def __init__(self, role: str, channel: worker.Channel, env: Any = None):
        super().__init__(role)
        self.role = role
        self.channel = channel
        self.env = env


def _socket_channel(fd: int) -> worker.Channel:
    return worker.Channel(fd, fd, want_fds=True)


def _fork() -> int:
    """os.fork(), keeping the child's `random` state equal to the parent's.

    Python reseeds the `random` module in every forked child; a snapshot must not change the
    state an env would have drawn its next random numbers from.
    """
    worker.flush_stdio()
    rng = sys.modules.get("random")
    state = rng.getstate() if rng is not None else None
    pid = os.fork()
    if pid == 0 and state is not None:
        rng.setstate(state)
    return pid


def _claim_group(pid: int) -> None:
    """Parent side of a fork: make the child lead its own group even if it has not yet."""
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # The child got there first, or already exited.


def _after_fork(parent_channel: worker.Channel, new_fd: int) -> worker.Channel:
    """Common set-up of a forked child: own process group, own channel only."""
    parent_channel.close()
    _forked_children.clear()  # The parent's children, not ours.
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return _socket_channel(new_fd)


# --- worker --------------------------------------------------------------------------------------


# Frozen copies and clones this worker forked: its children until they exit, then zombies until
# reaped (a worker cannot ignore SIGCHLD: its env may wait for children of its own).
_forked_children: set[int] = set()


def _reap_forked_children() -> None:
    for pid in list(_forked_children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _forked_children.discard(pid)


def _fork_copy(env: Any, channel: worker.Channel, role: str) -> int:
    """Forks this worker; the child takes up `role` on the channel whose fd came with the request.

    Returns the child's pid (in the parent). The child leads its own process group and is
    reaped by this worker (`_reap_forked_children`).
    """
    (fd,) = channel.reader.take_fds(1)
    _reap_forked_children()
    children = [p for p in procutil.child_pids(os.getpid()) if p not in _forked_children]
    if children:
        os.close(fd)
        names = []
        for pid in children[:5]:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    names.append(f"{pid} ({f.read().strip()})")
            except OSError:
                names.append(str(pid))
        raise worker.Refused(
            f"the {type(env).__name__} worker has child processes [{', '.join(names)}]; os.fork "
            "copies only the worker, so the copies would share them. Use backend='criu', which "
            "checkpoints the whole process tree."
        )
    pid = _fork()
    if pid == 0:
        channel = _after_fork(channel, fd)
        raise _Become(role, channel, env)
    _claim_group(pid)
    _forked_children.add(pid)
    os.close(fd)
    return pid


def _op_snapshot(env: Any, channel: worker.Channel, args: tuple) -> int:
    """A frozen copy of this worker (spawn more workers from it later)."""
    return _fork_copy(env, channel, "frozen")


def _op_clone(env: Any, channel: worker.Channel, args: tuple) -> int:
    """A new worker at this worker's current state (a snapshot and a spawn in one fork)."""
    return _fork_copy(env, channel, "worker")


def _run_worker(env: Any, channel: worker.Channel) -> None:
    worker.reset_signals_for_worker()
    ops = {"snapshot": _op_snapshot, "clone": _op_clone}
    worker.serve(env, channel, ops, after_reply=_reap_forked_children)


# --- frozen copy ---------------------------------------------------------------------------------


def _run_frozen(env: Any, channel: worker.Channel) -> None:
    # Children (restored workers) are reaped by the kernel; a frozen copy never waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # Keep the collector away from the copied heap: scanning it would write to (and so copy)
    # every page of it in this process and in every worker forked from it.
    gc.freeze()
    while True:
        try:
            op, _ = channel.recv()
        except (wire.PeerClosed, wire.ProtocolError, OSError):
            os._exit(0)
        if op == "spawn":
            (fd,) = channel.reader.take_fds(1)
            pid = _fork()
            if pid == 0:
                raise _Become("worker", _after_fork(channel, fd), env)
            _claim_group(pid)
            os.close(fd)
            channel.send(("ok", pid))
        elif op == "exit":
            os._exit(0)
        else:
            channel.send(("refused", f"a frozen snapshot does not serve {op!r}"))


# --- zygote --------------------------------------------------------------------------------------


def _kill_descendants() -> None:
    """SIGKILLs every process below this one (and their groups) until none is left (<= 5 s)."""
    me, my_group = os.getpid(), os.getpgid(0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = procutil.descendant_pids(me)
        if not pids:
            return
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group != my_group:
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


class _Stop(Exception):
    """SIGTERM in the keeper: kill everything below and exit."""


def _run_keeper(zygote: int, trainer: int) -> None:
    """The keeper's life (see the module docstring); returns when it should exit."""

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, on_term)
    try:
        procutil.set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != trainer:  # The trainer died before the line above.
            return
        try:
            pidfd: int | None = os.pidfd_open(zygote)
        except ProcessLookupError:
            pidfd = None  # Already gone (and reaped: SIGCHLD is ignored).
        if pidfd is not None:
            # Blocks until the zygote exits; a SIGTERM interrupts it through `on_term`.
            select.select([pidfd], [], [])
        # The zygote is gone. Its orphans (if it died before killing them) are ours now: the
        # trainer still drives them; wait until it has killed them all.
        while procutil.descendant_pids(os.getpid()):
            time.sleep(0.25)  # A walk of /proc each time: keep it rare.
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_descendants()


def _run_zygote(channel: worker.Channel, keeper: int) -> None:
    procutil.set_child_subreaper()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    procutil.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != keeper:  # The keeper died before the line above.
        raise SystemExit(0)

    env_name: str | None = None
    env_kwargs: dict[str, Any] = {}
    try:
        while True:
            try:
                op, args = channel.recv()
            except (wire.PeerClosed, wire.ProtocolError, OSError):
                return
            if op == "init":
                env_name, env_kwargs, preload = args
                try:
                    from envs.base import make_env

                    # The preload list registers envs and imports what the env would otherwise
                    # import on first use; a throwaway instance checks the configuration.
                    for module in preload:
                        importlib.import_module(module)
                    make_env(env_name, **env_kwargs).close()
                except Exception as e:  # noqa: BLE001 - reported to the trainer.
                    channel.send(("refused", f"{type(e).__name__}: {e}"))
                    continue
                # The imported modules stay shared with every worker: keep the collector from
                # writing to (and so copying) their pages in each of them.
                gc.freeze()
                channel.send(("ok", os.getpid()))
            elif op == "spawn":
                (fd,) = channel.reader.take_fds(1)
                pid = _fork()
                if pid == 0:
                    raise _Become("worker", _after_fork(channel, fd), ("new", env_name, env_kwargs))
                _claim_group(pid)
                os.close(fd)
                channel.send(("ok", pid))
            elif op == "exit":
                return
            else:
                channel.send(("refused", f"the zygote does not serve {op!r}"))
    finally:
        if os.getpid() == _zygote_pid:
            # The trainer's death shows up twice: end of file, then SIGTERM (its death signal)
            # a moment later. The second must not cut the clean-up short.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _kill_descendants()


_zygote_pid = -1


def main(argv: list[str]) -> None:
    """Entry point (the keeper, which forks the zygote): `argv[1]` is the fd of the zygote's
    end of its socketpair."""
    global _zygote_pid
    fd = int(argv[1])
    worker.detach_stdio()
    # Before the fork: a zygote that dies at once must already have a subreaper parent.
    procutil.set_child_subreaper()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    keeper, trainer = os.getpid(), os.getppid()
    pid = os.fork()
    if pid > 0:
        os.close(fd)  # The channel is the zygote's alone.
        _run_keeper(pid, trainer)
        os._exit(0)
    _zygote_pid = os.getpid()
    role, channel, env = "zygote", _socket_channel(fd), None
    # The trainer learns the zygote's pid before anything else (it started the keeper).
    channel.send(("ok", _zygote_pid))
    while True:
        try:
            if role == "zygote":
                _run_zygote(channel, keeper)
            elif role == "worker":
                if isinstance(env, tuple) and env and env[0] == "new":
                    env = _make_env_or_report(channel, env[1], env[2])
                _run_worker(env, channel)
            else:
                _run_frozen(env, channel)
            break
        except _Become as b:
            role, channel, env = b.role, b.channel, b.env
    os._exit(0)


def _make_env_or_report(channel: worker.Channel, env_name: str, env_kwargs: dict) -> Any:
    from envs.base import make_env

    try:
        return make_env(env_name, **env_kwargs)
    except Exception as e:  # noqa: BLE001 - the first request gets the error, then we exit.
        try:
            channel.recv()
            channel.send(("err", type(e).__name__, f"creating the env failed: {e}", ""))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv)
