"""Small Linux process helpers: prctl, /proc walks, memory accounting, killing process groups."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import time

__all__ = [
    "child_pids",
    "descendant_pids",
    "describe_status",
    "kill_group",
    "pid_alive",
    "private_bytes",
    "reap",
    "set_child_subreaper",
    "set_parent_death_signal",
    "wait_gone",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = None


def _prctl(option: int, arg: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def set_parent_death_signal(sig: int) -> None:
    """Asks the kernel to send `sig` to this process when its parent thread exits."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def set_child_subreaper() -> None:
    """Makes orphaned descendants of this process re-parent to it (instead of to init)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _ppid_map() -> dict[int, int]:
    """pid -> ppid for every process visible in /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses; fields after the last
        # ')' are fixed: state, ppid, ...
        rest = stat[stat.rfind(b")") + 2 :].split()
        parents[int(name)] = int(rest[1])
    return parents


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            # Kernels without CONFIG_PROC_CHILDREN: scan every process.
            return sorted(p for p, pp in _ppid_map().items() if pp == pid)
        except OSError:
            continue
    return sorted(children)


def descendant_pids(pid: int) -> list[int]:
    """Every living descendant of `pid`, parents before children."""
    parents = _ppid_map()
    by_parent: dict[int, list[int]] = {}
    for child, parent in parents.items():
        by_parent.setdefault(parent, []).append(child)
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for c in sorted(by_parent.get(p, ())):
                out.append(c)
                nxt.append(c)
        frontier = nxt
    return out


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to process group `pgid`; a group that no longer exists is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as e:  # pragma: no cover - would mean a foreign process group.
        raise RuntimeError(f"not allowed to signal process group {pgid}: {e}") from e


def private_bytes(pid: int) -> int:
    """Memory only `pid` maps (unique set size: Private_Clean + Private_Dirty), 0 if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Waits until none of `pids` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.005)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def reap(pid: int, timeout_s: float = 5.0) -> int | None:
    """Reaps our child `pid` (SIGKILL after `timeout_s`); its wait status, None if not ours."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        except OSError as e:  # pragma: no cover
            if e.errno == errno.EINTR:
                continue
            raise
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return status
        time.sleep(0.002)


def describe_status(status: int | None) -> str:
    """'exited with status 3' / 'killed by SIGKILL' for a wait status."""
    if status is None:
        return "exited"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
