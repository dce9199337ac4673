"""Process side of the CRIU backend: `python -m envs.sandbox.criu_proc <rfd> <wfd> [--net]`.

This module starts as a *launcher*: it creates a new PID namespace (and a network namespace with
`--net`), forks the *worker* as that namespace's init (pid 1), prints the worker's host pid on
stdout and waits for it. The worker talks to the trainer over two pipes only (requests in on
`rfd`, replies out on `wfd`), which CRIU re-attaches to fresh pipes on every restore with
`--inherit-fd`. Killing the worker kills everything else in its namespace (the kernel does that
when a namespace's init dies), so a sandbox can never leak a process.

Both die with the trainer: the launcher through PR_SET_PDEATHSIG, the worker through its own
death signal (kept across checkpoint and restore) and end of file on its request pipe.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
import tempfile

from envs.sandbox import procutil, worker

__all__ = ["main"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare({flags:#x}) failed: {os.strerror(err)}")


def _loopback_up() -> None:
    """Brings up `lo` in a new network namespace (it starts down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, ifreq))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _run_worker(rfd: int, wfd: int) -> None:
    """The worker: pid 1 of its namespace; builds the env on `init`, then serves it."""
    os.setsid()
    procutil.set_parent_death_signal(signal.SIGKILL)
    # Descriptors from the trainer's namespace (its terminal, pytest's capture pipes) would be
    # external to every checkpoint; the worker keeps only /dev/null and its two pipes.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    worker.reset_signals_for_worker()
    channel = worker.Channel(rfd, wfd)
    try:
        op, args = channel.recv()
    except Exception:  # noqa: BLE001 - the trainer went away before init.
        os._exit(0)
    if op != "init":
        channel.send(("refused", f"expected 'init' first, got {op!r}"))
        os._exit(1)
    env_name, env_kwargs, preload, tmp_dir = args
    # Temporary files on a tmpfs: a checkpoint saves the content of deleted files a process still
    # maps (ALFWorld's planner maps a deleted 33 MB copy of its library), and restore writes them
    # back to their old path before mapping them.
    os.environ["TMPDIR"] = tmp_dir
    tempfile.tempdir = None
    try:
        from envs.base import make_env
        from envs.sandbox.backend import import_modules

        import_modules(preload)
        env = make_env(env_name, **env_kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the trainer.
        channel.send(("refused", f"creating env {env_name!r} failed: {type(e).__name__}: {e}"))
        os._exit(1)
    channel.send(("ok", os.getpid()))
    worker.serve(env, channel)


def main(argv: list[str]) -> None:
    rfd, wfd = int(argv[1]), int(argv[2])
    net = "--net" in argv[3:]
    procutil.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == 1:  # The trainer died before the line above.
        os._exit(1)
    try:
        _unshare(_CLONE_NEWPID | (_CLONE_NEWNET if net else 0))
        if net:
            _loopback_up()
    except OSError as e:
        print(f"error: {e}", flush=True)
        os._exit(2)
    pid = os.fork()
    if pid == 0:
        try:
            _run_worker(rfd, wfd)
        finally:
            os._exit(0)
    # The launcher must not hold the worker's pipes: the trainer sees the worker's death as end
    # of file on the reply pipe, which needs the worker to be its only writer.
    os.close(rfd)
    os.close(wfd)
    print(pid, flush=True)
    os.close(1)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main(sys.argv)
