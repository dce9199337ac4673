"""Tests for the CRIU sandbox backend: whole process trees, PID and network namespaces.

CRIU needs root and a working `criu` >= 4 (scripts/install_criu.sh builds one). Where it cannot
run, these tests are skipped with CRIU's reason, unless $BPO_REQUIRE_CRIU is set (CI sets it
after installing CRIU), in which case they fail.
"""

import os
import signal
from pathlib import Path

import pytest

from envs.sandbox import SnapshotUnsupportedError, make_backend, procutil
from envs.sandbox.testing import (
    CounterTask,
    alfworld_case,
    check_alfworld_parity,
    criu_unavailable_reason,
    fault_scenario,
    leftover_processes,
    play,
    trainer_death_scenario,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _criu_available():
    reason = criu_unavailable_reason()
    if reason is not None:
        if os.environ.get("BPO_REQUIRE_CRIU"):
            pytest.fail(f"$BPO_REQUIRE_CRIU is set but the criu backend cannot run: {reason}")
        pytest.skip(f"criu backend unavailable: {reason}")


def _pid_namespace(pid):
    return os.readlink(f"/proc/{pid}/ns/{'pid'}")


def _names(pids):
    names = []
    for pid in pids:
        with open(f"/proc/{pid}/comm") as f:
            names.append(f.read().strip())
    return names


def test_shell_process_tree_forks_three_independent_copies():
    before = set(procutil.descendant_pids(os.getpid()))
    with make_backend("criu", "sandbox_shell", {"max_steps": 50}) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("shell"))
        assert [r[0] for r in play(sandbox, ["a", "b"])] == ["1 a", "2 b"]
        shell = procutil.descendant_pids(sandbox.pid())
        assert _names(shell) == ["bash"], "the count lives in a bash child of the worker"
        handle = sandbox.snapshot()
        copies = backend.fork(handle, 3)

        # Each copy is a whole tree (worker + its own bash) in its own PID namespace.
        workers = [sandbox.pid()] + [c.pid() for c in copies]
        namespaces = {_pid_namespace(pid) for pid in workers}
        assert len(namespaces) == 4 and _pid_namespace(os.getpid()) not in namespaces
        shells = [procutil.descendant_pids(pid) for pid in workers]
        assert all(_names(s) == ["bash"] for s in shells)
        assert len({s[0] for s in shells}) == 4

        # They evolve independently: copy i reads i + 1 lines; the original reads one.
        for i, copy in enumerate(copies):
            lines = play(copy, [f"x{i}"] * (i + 1))
            assert [r[0] for r in lines] == [f"{3 + j} x{i}" for j in range(i + 1)]
        assert sandbox.step("c").observation == "3 c"
        assert [c.step("y").observation for c in copies] == ["4 y", "5 y", "6 y"]

        # A snapshot restores many times, also into a sandbox that already runs.
        sandbox.restore(handle)
        assert sandbox.step("again").observation == "3 again"
        stats = backend.stats()
        assert stats["held_snapshots"] == 1 and stats["restores"] == 4
        assert stats["snapshot_bytes"] > 0
        backend.release(handle)
    assert leftover_processes(before) == []


def test_alfworld_snapshot_restore_fork_match_replay():
    check_alfworld_parity("criu", alfworld_case())


def test_network_namespaces_isolate_tcp_servers():
    # Each copy restores a listening AF_INET socket on the same port: only separate network
    # namespaces make that possible (and dumping it needs CRIU's Linux >= 6.16 socket fix).
    port = 18765
    with make_backend("criu", "sandbox_counter", network_namespace=True) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("net"))
        sandbox.step(f"listen {port}")
        assert sandbox.step(f"probe {port}").info["port_open"]
        handle = sandbox.snapshot()
        copies = backend.fork(handle, 2)
        for copy in copies:
            assert copy.step(f"probe {port}").info["port_open"]
        nets = {os.readlink(f"/proc/{s.pid()}/ns/net") for s in [sandbox, *copies]}
        assert len(nets) == 3 and os.readlink("/proc/self/ns/net") not in nets
        # Nothing listens on the host's loopback.
        import socket

        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_without_network_namespace_a_dump_with_a_server_still_works():
    with make_backend("criu", "sandbox_counter") as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("net"))
        sandbox.step("listen 0")  # Any free port; a copy restores it only where it is free.
        handle = sandbox.snapshot()
        assert backend.stats()["snapshot_bytes"] > 0
        backend.release(handle)


def test_faults_are_contained():
    fault_scenario("criu")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_criu_sandboxes_die_with_the_trainer(sig):
    assert trainer_death_scenario("criu", sig, str(REPO)) == -sig


def test_failed_checkpoint_is_an_error_not_a_fault():
    with make_backend("criu", "sandbox_counter", ghost_limit_bytes=1 << 20) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        sandbox.step("ghost 2")  # Holds a deleted 2 MiB file: over this backend's limit.
        with pytest.raises(SnapshotUnsupportedError, match=r"(?s)criu dump.*ghost file"):
            sandbox.snapshot()
        assert sandbox.step("inc").observation.startswith("count=1 ")  # Still running.
        stats = backend.stats()
        assert stats["faults"] == 0 and stats["held_snapshots"] == 0
