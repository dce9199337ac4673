"""Tests for the sandbox layer (envs/sandbox): backends, handles, faults, the pool, clean-up.

Every backend is checked against `replay` (reset + replay, the reference): snapshot at step t,
continue, restore, replay the same actions; and forks that take different actions diverge, each
matching its own replay. The CRIU backend's tests live in test_sandbox_criu.py.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from envs.base import step_result
from envs.sandbox import (
    HandleError,
    SandboxError,
    SandboxFault,
    SandboxPool,
    SnapshotLimitError,
    SnapshotUnsupportedError,
    known_backends,
    make_backend,
    procutil,
)
from envs.sandbox.testing import (
    CounterTask,
    alfworld_case,
    check_alfworld_parity,
    fault_scenario,
    leftover_processes,
    play,
    trainer_death_scenario,
)

REPO = Path(__file__).resolve().parents[1]
LOCAL_BACKENDS = ["inprocess", "fork", "replay"]
COUNTER = "sandbox_counter"


def _descendants() -> set[int]:
    return set(procutil.descendant_pids(os.getpid()))


# --- Counter env: every backend against replay ---------------------------------------------------


PREFIX = ["inc", "add 3", "double"]
BRANCH_A = ["inc", "dec", "add 7"]
BRANCH_B = ["dec", "double", "inc"]


def _reference(actions):
    """Results of playing `actions` from a fresh reset with a plain env (the replay reference)."""
    from envs.sandbox.testing import CounterEnv

    env = CounterEnv(max_steps=100)
    env.reset(options={"task": CounterTask("t", start=0, target=1000)})
    return [tuple(step_result(env, a)) for a in actions]


@pytest.mark.parametrize("backend_name", LOCAL_BACKENDS)
def test_counter_snapshot_restore_fork_match_replay(backend_name):
    task = CounterTask("t", start=0, target=1000)
    ref_prefix = _reference(PREFIX)
    ref_a = _reference(PREFIX + BRANCH_A)[len(PREFIX) :]
    ref_b = _reference(PREFIX + BRANCH_B)[len(PREFIX) :]
    with make_backend(backend_name, COUNTER, {"max_steps": 100}) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(task)
        assert play(sandbox, PREFIX) == ref_prefix
        handle = sandbox.snapshot()
        assert handle.steps == len(PREFIX) and handle.task_id == "t"
        assert play(sandbox, BRANCH_A) == ref_a
        sandbox.restore(handle)
        assert sandbox.steps == len(PREFIX)
        assert play(sandbox, BRANCH_A) == ref_a  # Restored: the same actions, the same results.
        sandbox.restore(handle)  # A snapshot can be restored many times.
        first, second = backend.fork(handle, 2)
        got_a, got_b = [], []
        for a, b in zip(BRANCH_A, BRANCH_B):  # Interleaved: the forks are independent.
            got_a.append(tuple(first.step(a)))
            got_b.append(tuple(second.step(b)))
        assert got_a == ref_a and got_b == ref_b
        assert got_a[0][0] != got_b[0][0]
        assert play(sandbox, BRANCH_B) == ref_b
        stats = backend.stats()
        assert stats["held_snapshots"] == 1 and stats["snapshots"] == 1
        assert stats["restores"] == 4 and stats["live_sandboxes"] == 3
        backend.release(handle)
        assert backend.stats()["held_snapshots"] == 0


@pytest.mark.parametrize("backend_name", LOCAL_BACKENDS)
def test_counter_clone_of_a_live_sandbox_matches_replay(backend_name):
    before = _descendants()
    ref_a = _reference(PREFIX + BRANCH_A)[len(PREFIX) :]
    ref_b = _reference(PREFIX + BRANCH_B)[len(PREFIX) :]
    with make_backend(backend_name, COUNTER, {"max_steps": 100}) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t", start=0, target=1000))
        play(sandbox, PREFIX)
        assert backend.clone(sandbox, 0) == []
        clones = backend.clone(sandbox, 2)
        assert [c.steps for c in clones] == [len(PREFIX)] * 2 and clones[0].task.task_id == "t"
        got = {id(s): [] for s in [sandbox, *clones]}
        for a, b in zip(BRANCH_A, BRANCH_B):  # Interleaved: original and clones are independent.
            for s, action in zip([sandbox, *clones], [a, b, a]):
                got[id(s)].append(tuple(s.step(action)))
        assert got[id(sandbox)] == ref_a and got[id(clones[1])] == ref_a
        assert got[id(clones[0])] == ref_b
        stats = backend.stats()
        assert stats["live_sandboxes"] == 3 and stats["held_snapshots"] == 0
        if backend_name == "fork":  # One fork of the live worker per copy, no snapshot.
            assert stats["clones"] == 2 and stats["snapshots"] == 0 and stats["restores"] == 0
        else:  # Through a snapshot that is released again.
            assert stats["clones"] == 0 and stats["snapshots"] == 1 and stats["restores"] == 2
        with pytest.raises(ValueError, match="n >= 0"):
            backend.clone(sandbox, -1)
        clones[0].close()
        with pytest.raises(SandboxError, match="closed"):
            backend.clone(clones[0], 1)
    assert leftover_processes(before) == []


def test_known_backends_and_unknown_name():
    assert {"inprocess", "fork", "criu", "replay"} <= set(known_backends())
    with pytest.raises(ValueError, match="Unknown sandbox backend 'nope'"):
        make_backend("nope", COUNTER)


@pytest.mark.parametrize("backend_name", LOCAL_BACKENDS)
def test_handles_released_foreign_and_capped(backend_name):
    with (
        make_backend(backend_name, COUNTER, max_snapshots=2) as backend,
        make_backend(backend_name, COUNTER) as other,
    ):
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        first = sandbox.snapshot()
        backend.release(first)
        with pytest.raises(HandleError, match="was released"):
            backend.fork(first, 1)
        with pytest.raises(HandleError, match="was released"):
            sandbox.restore(first)
        with pytest.raises(HandleError, match="was released"):
            backend.release(first)
        foreign = other.new_sandbox()
        foreign.reset(CounterTask("t"))
        with pytest.raises(HandleError, match="belongs to another sandbox backend"):
            backend.fork(foreign.snapshot(), 1)
        with pytest.raises(HandleError, match="Expected a SnapshotHandle"):
            backend.release("not a handle")
        sandbox.snapshot()
        sandbox.snapshot()
        with pytest.raises(SnapshotLimitError, match="max_snapshots=2"):
            sandbox.snapshot()
        assert backend.stats()["held_snapshots"] == 2


def test_evict_oldest_policy():
    with make_backend("fork", COUNTER, max_snapshots=2, snapshot_policy="evict_oldest") as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        handles = []
        for _ in range(3):
            sandbox.step("inc")
            handles.append(sandbox.snapshot())
        stats = backend.stats()
        assert stats["held_snapshots"] == 2 and stats["evictions"] == 1
        with pytest.raises(HandleError, match="evicted"):
            backend.fork(handles[0], 1)
        (copy,) = backend.fork(handles[2], 1)
        assert copy.step("inc").observation.startswith("count=4 ")


def test_options_are_validated():
    with pytest.raises(ValueError, match="snapshot_policy"):
        make_backend("replay", COUNTER, snapshot_policy="lru")
    with pytest.raises(ValueError, match="max_snapshots"):
        make_backend("replay", COUNTER, max_snapshots=0)
    with pytest.raises(ValueError, match="num_workers"):
        SandboxPool(COUNTER, {}, backend="replay", num_workers=0)


# --- Refusals ------------------------------------------------------------------------------------


def test_inprocess_refuses_alfworld_clearly():
    from envs.alfworld import load_tasks

    task = load_tasks(None, "valid_unseen", limit=1)[0]
    with make_backend("inprocess", "alfworld") as backend:
        sandbox = backend.new_sandbox()
        # Refused before any game is loaded: the env class itself cannot be copied.
        with pytest.raises(SnapshotUnsupportedError) as error:
            sandbox.snapshot()
        message = str(error.value)
        assert "envs.alfworld.env.AlfworldEnv" in message
        assert "cannot be pickled or copied" in message
        assert "backend='fork'" in message
        assert task.task_id  # The data is there; the refusal is about the env class.


def test_env_with_child_processes_is_refused_by_fork_and_inprocess():
    with make_backend("fork", "sandbox_shell") as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        assert sandbox.step("hello").observation == "1 hello"
        with pytest.raises(SnapshotUnsupportedError, match=r"child processes \[\d+ \(bash\)\]"):
            sandbox.snapshot()
        with pytest.raises(SnapshotUnsupportedError, match="cannot copy.*child processes"):
            backend.clone(sandbox, 2)
        assert sandbox.step("again").observation == "2 again"  # Refusal is not a fault.
        assert backend.stats()["faults"] == 0 and backend.stats()["live_sandboxes"] == 1
    with make_backend("inprocess", "sandbox_shell") as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        with pytest.raises(SnapshotUnsupportedError, match="ShellCounterEnv.*deepcopy failed"):
            sandbox.snapshot()
        sandbox.close()


def test_replay_restores_state_kept_in_child_processes():
    with make_backend("replay", "sandbox_shell") as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(CounterTask("t"))
        play(sandbox, ["a", "b"])
        handle = sandbox.snapshot()
        (copy,) = backend.fork(handle, 1)
        assert copy.step("c").observation == "3 c"
        assert sandbox.step("x").observation == "3 x"


# --- ALFWorld: snapshot/restore/fork against a fresh replay, per backend -------------------------


@pytest.fixture(scope="module")
def alfworld_reference():
    return alfworld_case()


@pytest.mark.parametrize(
    "backend_name",
    # The replay backend resets ALFWorld once per restore (several seconds each).
    ["fork", pytest.param("replay", marks=pytest.mark.slow)],
)
def test_alfworld_snapshot_restore_fork_match_replay(backend_name, alfworld_reference):
    check_alfworld_parity(backend_name, alfworld_reference)


# --- The pool ------------------------------------------------------------------------------------


def test_pool_api_and_stats():
    before = _descendants()
    with SandboxPool(COUNTER, {"max_steps": 20}, backend="fork", step_timeout_s=10) as pool:
        results = pool.reset_many([CounterTask(f"t{i}", start=i, target=3) for i in range(3)])
        sids = [sid for sid, _, _ in results]
        assert [obs for _, obs, _ in results] == [
            f"count={i} steps=0 trace=0 last='reset'" for i in range(3)
        ]
        steps = pool.step_many([(sid, "inc") for sid in sids])
        assert [s.observation.split()[0] for s in steps] == ["count=1", "count=2", "count=3"]
        assert steps[2].done and steps[2].reward == 1.0 and pool.done(sids[2])
        with pytest.raises(SandboxError, match="episode is over"):
            pool.step_many([(sids[2], "inc")])
        with pytest.raises(SandboxError, match="appears twice"):
            pool.step_many([(sids[0], "inc"), (sids[0], "inc")])
        handle = pool.snapshot(sids[0])
        forks = pool.fork(handle, 3)
        assert len(set(forks) | set(sids)) == 6
        outs = pool.step_many([(sid, a) for sid, a in zip(forks, ["inc", "dec", "double"])])
        assert [o.observation.split()[0] for o in outs] == ["count=2", "count=0", "count=2"]
        stats = pool.stats()
        assert stats["live_sandboxes"] == 6 and stats["held_snapshots"] == 1
        assert stats["snapshots"] == 1 and stats["restores"] == 3 and stats["resets"] == 3
        assert stats["snapshot_bytes"] > 0 and stats["faults"] == 0
        pool.restore(forks[0], handle)
        assert pool.step(forks[0], "inc").observation.startswith("count=2 steps=2")
        pool.release(handle)
        pool.close_sandbox(forks[0])
        pool.close_sandbox(forks[0])  # Idempotent.
        with pytest.raises(SandboxError, match="no live sandbox with id"):
            pool.step(forks[0], "inc")
        assert pool.stats()["held_snapshots"] == 0
    assert leftover_processes(before) == []
    with pytest.raises(SandboxError, match="closed"):
        pool.reset(CounterTask("late"))


def test_held_snapshot_memory_is_reported():
    with SandboxPool(COUNTER, {}, backend="fork") as pool:
        sid, _, _ = pool.reset(CounterTask("t"))
        pool.step(sid, "alloc 32")
        handle = pool.snapshot(sid)
        shared = pool.stats()["snapshot_bytes"]
        assert 0 < shared < (16 << 20)  # Copy-on-write: the 32 MiB are still shared.
        # The live worker drops its 32 MiB: now only the snapshot holds them.
        pool.step(sid, "free")
        assert pool.stats()["snapshot_bytes"] > shared + (30 << 20)
        pool.release(handle)
        assert pool.stats()["snapshot_bytes"] == 0


def test_step_many_runs_workers_in_parallel():
    spin_s = 0.4
    with SandboxPool(COUNTER, {}, backend="fork", num_workers=2) as pool:
        sids = [sid for sid, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
        results = pool.step_many([(sid, f"spin {spin_s}") for sid in sids])
        cpu = [r.info["spin_wall"] for r in results]
    # Each step burned spin_s of CPU in its own worker process; dispatched together, their busy
    # intervals overlap (one after the other, they could not). On an idle 2-core machine the
    # batch takes about spin_s; a loaded machine stretches both intervals alike.
    (start_a, end_a), (start_b, end_b) = cpu
    overlap = min(end_a, end_b) - max(start_a, start_b)
    assert overlap > 0.5 * min(end_a - start_a, end_b - start_b), cpu

    # num_workers caps the requests in flight: with one, the steps run one after the other.
    with SandboxPool(COUNTER, {}, backend="fork", num_workers=1) as pool:
        sids = [sid for sid, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
        results = pool.step_many([(sid, "spin 0.1") for sid in sids])
        (_, end_a), (start_b, _) = [r.info["spin_wall"] for r in results]
    assert start_b >= end_a


def test_pool_faults_are_contained():
    fault_scenario("fork")


def test_reset_fault_raises_and_cleans_up():
    before = _descendants()
    with SandboxPool(COUNTER, {}, backend="fork") as pool:
        with pytest.raises(SandboxFault, match="reset of task 'bad-task' failed: TypeError"):
            pool.reset_many([CounterTask("ok"), "bad-task"])  # type: ignore[list-item]
        assert pool.stats()["live_sandboxes"] == 0
    assert leftover_processes(before) == []


def test_unpicklable_reply_is_a_fault_not_a_hang():
    with SandboxPool(COUNTER, {}, backend="fork") as pool:
        sid, _, _ = pool.reset(CounterTask("t"))
        (result,) = pool.step_many([(sid, "unpicklable")])
        assert result.info["fault"] == "error" and "could not be pickled" in result.info["error"]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _reaped(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether `pid` is gone from /proc (not even a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_killed_zygotes_workers_are_found_kept_and_reaped():
    """SIGKILL of the zygote: its workers re-parent to the backend's keeper (not to PID 1), so
    they stay among our descendants, go on serving their episodes, and are reaped at close; the
    next reset starts a new zygote."""
    before = _descendants()
    with SandboxPool(COUNTER, {}, backend="fork", step_timeout_s=10) as pool:
        sids = [s for s, _, _ in pool.reset_many([CounterTask(f"t{i}") for i in range(3)])]
        handle = pool.snapshot(sids[0])
        sids += pool.fork(handle, 2)
        workers = {pool.pid(sid) for sid in sids}
        backend = pool.backend
        old_zygote, old_keeper = backend._zygote.pid, backend._keeper.pid
        assert backend.process_count() == 6  # Five workers and the frozen copy.
        os.kill(old_zygote, signal.SIGKILL)
        assert procutil.wait_gone([old_zygote], timeout_s=5) == []
        assert all(procutil.pid_alive(pid) for pid in workers)
        assert [_ppid(pool.pid(sid)) for sid in sids[:3]] == [old_keeper] * 3
        assert workers <= _descendants() and backend.process_count() == 6
        results = pool.step_many([(sid, "inc") for sid in sids])
        assert all(r.observation.startswith("count=1 ") and "fault" not in r.info for r in results)
        sid, observation, _ = pool.reset(CounterTask("after"))  # On a new zygote.
        assert observation.startswith("count=0 ") and backend._zygote.pid != old_zygote
        assert backend.process_count() == 7
        # A zygote killed just before a reset (it may still be dying when the spawn is sent).
        os.kill(backend._zygote.pid, signal.SIGKILL)
        assert pool.reset(CounterTask("at once"))[1].startswith("count=0 ")
        assert backend.process_count() == 8 and len(backend._retired) == 2
        orphan = pool.pid(sids[1])
        pool.close_sandbox(sids[1])
        assert _reaped(orphan), "the keeper reaps an orphan the trainer killed"
    assert leftover_processes(before) == []
    assert not procutil.pid_alive(old_keeper)
    zombies = [p for p in procutil.child_pids(os.getpid()) if not procutil.pid_alive(p)]
    assert zombies == [], f"unreaped children: {zombies}"


# --- Dying with the trainer ----------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("kill_zygote", [False, True], ids=["", "zygote-killed-first"])
def test_fork_sandboxes_die_with_the_trainer(sig, kill_zygote):
    returncode = trainer_death_scenario("fork", sig, str(REPO), kill_zygote=kill_zygote)
    assert returncode == -sig  # SIGTERM: the pool cleans up, then dies of the signal.
