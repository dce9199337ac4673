"""Small deterministic environments for testing sandboxes, with knobs to make them misbehave.

- `sandbox_counter` (`CounterEnv`): all state is plain Python (deep-copyable), so every backend
  can snapshot it. Special actions crash, hang, raise or corrupt the worker's channel.
- `sandbox_shell` (`ShellCounterEnv`): the state lives in a child process (a bash loop that
  counts the lines it reads), so only `criu` and `replay` can snapshot it.

Importing this module registers both names with `envs.base.make_env`. Both are `TextEnv`s.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from envs.base import Task, TextEnv, register_env

__all__ = ["CounterEnv", "CounterTask", "ShellCounterEnv", "FAULT_ACTIONS"]

# Actions that make a `CounterEnv` misbehave, for fault-handling tests.
FAULT_ACTIONS = {
    "crash": "the worker dies of a segmentation fault",
    "exit": "the worker exits with status 3",
    "hang": "step sleeps for an hour",
    "raise": "step raises ValueError",
    "garbage": "the worker writes junk bytes to its reply channel, then answers normally",
    "unpicklable": "the step's info holds a lambda",
}


@dataclasses.dataclass(frozen=True)
class CounterTask(Task):
    """Reach `target` from `start` by adding and subtracting.

    Attributes:
        start: Initial count.
        target: The count that wins.
    """

    start: int = 0
    target: int = 5


@register_env("sandbox_counter")
class CounterEnv(TextEnv):
    """A counter: actions "inc", "dec", "add N", "double"; see `FAULT_ACTIONS` for misbehaviour.

    Test helpers: "alloc MB" holds that much more memory ("free" drops it), "spin S" burns S
    seconds of CPU, "listen PORT" keeps a TCP server socket on 127.0.0.1:PORT, "probe PORT"
    reports in `info["port_open"]` whether something listens there, "ghost MB" keeps a deleted
    file of that size open.

    Reward 1.0 on reaching the target (which ends the episode), -0.1 for an unknown action, else
    0. The observation shows the count, the step number and a running hash of all actions, so
    two different histories give different observations. `reset()` without a task plays
    `CounterTask("counter")`.
    """

    task_class = CounterTask

    def __init__(self, max_steps: int = 100, invalid_action_penalty: float = 0.1):
        super().__init__(max_steps, invalid_action_penalty, tasks=[CounterTask("counter")])
        self.count = 0
        self.trace = 0
        self.ballast: list[bytearray] = []  # Memory held on purpose ("alloc MB").
        self.servers: list[socket.socket] = []  # Listening sockets ("listen PORT").
        self.ghosts: list[Any] = []  # Deleted files kept open ("ghost MB").

    def _start(self, task: CounterTask) -> tuple[str, dict[str, Any]]:
        self.count, self.trace = task.start, 0
        self.ballast = []
        self._close_servers()
        return self._observation("reset"), {"won": False, "invalid_action": False}

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        action = (action or "").strip()
        info: dict[str, Any] = {}
        self._misbehave(action, info)
        reward, valid = 0.0, True
        words = action.split()
        if action == "inc":
            self.count += 1
        elif action == "dec":
            self.count -= 1
        elif action == "double":
            self.count *= 2
        elif len(words) == 2 and words[0] == "add" and _is_int(words[1]):
            self.count += int(words[1])
        elif len(words) == 2 and words[0] == "alloc" and words[1].isdigit():
            # Touch every page, so that the memory is really private to this process.
            self.ballast.append(bytearray(b"\x01" * (int(words[1]) << 20)))
        elif action == "free":
            self.ballast = []
        elif len(words) == 2 and words[0] == "ghost" and words[1].isdigit():
            ghost = tempfile.TemporaryFile()  # Open but already deleted.
            ghost.write(b"\x02" * (int(words[1]) << 20))
            ghost.flush()
            self.ghosts.append(ghost)
        elif len(words) == 2 and words[0] == "spin" and _is_float(words[1]):
            started = time.time()
            deadline = time.process_time() + float(words[1])  # Burn CPU, not wall time.
            while time.process_time() < deadline:
                pass
            info["spin_wall"] = (started, time.time())
        elif len(words) == 2 and words[0] == "listen" and words[1].isdigit():
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.bind(("127.0.0.1", int(words[1])))
            server.listen(4)
            self.servers.append(server)
        elif len(words) == 2 and words[0] == "probe" and words[1].isdigit():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.settimeout(2.0)
                info["port_open"] = probe.connect_ex(("127.0.0.1", int(words[1]))) == 0
            self._drain_servers()  # Leave no half-open connection behind (CRIU refuses those).
        elif action not in FAULT_ACTIONS:
            valid = False
            reward = -self.invalid_action_penalty
        self.trace = (self.trace * 31 + sum(action.encode()) + 7) % 1_000_003
        won = self.count == self._task.target
        if won:
            reward = 1.0
        info.update(won=won, invalid_action=not valid)
        return self._observation(action), reward, won, info

    def _close(self) -> None:
        self._close_servers()

    def _drain_servers(self) -> None:
        for server in self.servers:
            server.setblocking(False)
            try:
                while True:
                    server.accept()[0].close()
            except BlockingIOError:
                pass
            server.setblocking(True)

    def _close_servers(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []

    def _observation(self, action: str) -> str:
        return f"count={self.count} steps={self.steps} trace={self.trace} last={action!r}"

    def _misbehave(self, action: str, info: dict[str, Any]) -> None:
        if action == "crash":
            # A segfault, not kill(getpid()): as its PID namespace's init (criu backend) the
            # worker would be immune to a signal it sends itself.
            ctypes.string_at(0)
        elif action == "exit":
            os._exit(3)
        elif action == "hang":
            time.sleep(3600)
        elif action == "raise":
            raise ValueError("CounterEnv was asked to raise")
        elif action == "garbage":
            from envs.sandbox.worker import current_reply_fd

            fd = current_reply_fd()
            if fd is None:
                raise RuntimeError("'garbage' only works inside a sandbox worker process")
            os.write(fd, b"\x00garbage, not a frame\xff" * 4)
        elif action == "unpicklable":
            info["callback"] = lambda: None


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# A bash loop that keeps the count: one line in ("<action>"), one line out ("<n> <action>").
_SHELL_LOOP = 'n=0; while IFS= read -r line; do n=$((n+1)); echo "$n $line"; done'


@register_env("sandbox_shell")
class ShellCounterEnv(TextEnv):
    """The count lives in a bash child process; the env only forwards actions to it.

    Each step sends the action to bash and returns bash's reply ("<lines read> <action>").
    Reward 1.0 and done on the action "finish", or when `max_steps` is reached (truncated).
    """

    def __init__(self, max_steps: int = 100):
        super().__init__(max_steps, tasks=[Task("shell")])
        self._shell: subprocess.Popen | None = None

    def _start(self, task: Task) -> tuple[str, dict[str, Any]]:
        self._stop_shell()
        self._shell = subprocess.Popen(
            ["bash", "-c", _SHELL_LOOP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        return f"shell ready for {task.task_id}", {"won": False, "invalid_action": False}

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        action = " ".join((action or "").split())
        assert self._shell is not None
        assert self._shell.stdin is not None and self._shell.stdout is not None
        self._shell.stdin.write(action + "\n")
        self._shell.stdin.flush()
        observation = self._shell.stdout.readline().strip()
        if not observation:
            raise RuntimeError(f"the shell (pid {self._shell.pid}) exited unexpectedly")
        won = action == "finish"
        return observation, 1.0 if won else 0.0, won, {"won": won, "invalid_action": False}

    def _close(self) -> None:
        self._stop_shell()

    def _stop_shell(self) -> None:
        if self._shell is not None:
            self._shell.kill()
            self._shell.wait()
            for stream in (self._shell.stdin, self._shell.stdout):
                if stream is not None:
                    stream.close()
            self._shell = None


# Helpers for tests ------------------------------------------------------------------------------


def play(sandbox: Any, actions: list[str | None]) -> list[tuple[str, float, bool, dict]]:
    """Steps `sandbox` through `actions`; returns (observation, reward, done, info) per step."""
    return [tuple(sandbox.step(action)) for action in actions]  # type: ignore[misc]


def criu_unavailable_reason() -> str | None:
    """Why the criu backend cannot run here (None if it can)."""
    from envs.sandbox.base import BackendUnavailableError
    from envs.sandbox.criu import check_criu

    try:
        check_criu()
    except BackendUnavailableError as e:
        return str(e)
    return None


def leftover_processes(before: set[int], timeout_s: float = 5.0) -> list[str]:
    """Descendants of this process that were not in `before`, after waiting up to `timeout_s`.

    Returns:
        "pid (name, state)" for each process still there: an empty list means nothing leaked.
    """
    from envs.sandbox import procutil

    deadline = time.monotonic() + timeout_s
    while True:
        extra = [p for p in procutil.descendant_pids(os.getpid()) if p not in before]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    described = []
    for pid in extra:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            state = stat[stat.rindex(")") + 2]
            described.append(f"{pid} ({name}, {state})")
        except OSError:
            continue
    return described


def _expect(error_type: type[BaseException], fn: Any, match: str = "") -> BaseException:
    """Calls `fn()` and checks that it raises `error_type` with `match` in its message."""
    try:
        fn()
    except error_type as e:
        assert match in str(e), f"{match!r} not in {str(e)!r}"
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error_type.__name__}")


# --- Scenarios shared by the tests of several backends (tests/test_sandbox*.py) -----------------


@dataclasses.dataclass(frozen=True)
class AlfworldCase:
    """A short ALFWorld game and reference trajectories from a fresh env (the replay reference).

    Attributes:
        task: The game.
        prefix: Actions played before the snapshot.
        branch_a: The walkthrough's remaining actions (they win: the last step is done, reward 1).
        branch_b: Different actions from the same state ("go to" elsewhere, look, inventory).
        ref_prefix, ref_a, ref_b: (observation, reward, done, info) per step of each.
    """

    task: Any
    prefix: list[str]
    branch_a: list[str]
    branch_b: list[str]
    ref_prefix: list[tuple]
    ref_a: list[tuple]
    ref_b: list[tuple]


@functools.lru_cache(maxsize=1)
def alfworld_case() -> AlfworldCase:
    """Builds the `AlfworldCase` (two resets of one game, about 10 s; cached)."""
    from envs.alfworld import AlfworldEnv, load_tasks
    from envs.base import reset_to, step_result

    tasks = [t for t in load_tasks(None, "valid_unseen") if len(t.walkthrough) >= 5]
    task = min(tasks, key=lambda t: (len(t.walkthrough), t.task_id))
    prefix, branch_a = list(task.walkthrough[:2]), list(task.walkthrough[2:])
    with AlfworldEnv(max_steps=50) as env:
        reset_to(env, task)
        ref_prefix = [tuple(step_result(env, a)) for a in prefix]
        moves = [c for c in ref_prefix[-1][3]["admissible_commands"] if c.startswith("go to")]
        branch_b = [next(m for m in moves if m != branch_a[0]), "look", "inventory"]
        ref_a = [tuple(step_result(env, a)) for a in branch_a]
        reset_to(env, task)
        for a in prefix:
            step_result(env, a)
        ref_b = [tuple(step_result(env, a)) for a in branch_b]
    assert ref_a[-1][2] and ref_a[-1][1] == 1.0, "the walkthrough should win the game"
    return AlfworldCase(task, prefix, branch_a, branch_b, ref_prefix, ref_a, ref_b)


def check_alfworld_parity(backend_name: str, case: AlfworldCase, **options: Any) -> None:
    """Snapshot at step t, continue, restore, replay; two forks diverge; a clone of the live
    sandbox and the sandbox diverge; all match the reference.

    Observations, rewards, done flags and info dicts must equal the fresh-env reference exactly.
    """
    from envs.sandbox.backend import make_backend
    from envs.sandbox.base import HandleError

    with make_backend(backend_name, "alfworld", {"max_steps": 50}, **options) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(case.task)
        assert play(sandbox, case.prefix) == case.ref_prefix
        handle = sandbox.snapshot()
        assert play(sandbox, case.branch_a[:2]) == case.ref_a[:2]
        sandbox.restore(handle)
        assert play(sandbox, case.branch_a) == case.ref_a
        first, second = backend.fork(handle, 2)
        got_a, got_b = [], []
        for a, b in zip(case.branch_a, case.branch_b):  # Interleaved: independent copies.
            got_a.append(tuple(first.step(a)))
            got_b.append(tuple(second.step(b)))
        assert got_a == case.ref_a[: len(got_a)]
        assert got_b == case.ref_b[: len(got_b)]
        assert got_a[0][0] != got_b[0][0]
        sandbox.restore(handle)
        (clone,) = backend.clone(sandbox, 1)  # A live copy; the original goes on unchanged.
        assert clone.steps == sandbox.steps == len(case.prefix)
        got_a, got_b = [], []
        for a, b in zip(case.branch_a, case.branch_b):
            got_a.append(tuple(sandbox.step(a)))
            got_b.append(tuple(clone.step(b)))
        assert got_a == case.ref_a[: len(got_a)]
        assert got_b == case.ref_b[: len(got_b)]
        backend.release(handle)
        _expect(HandleError, lambda: backend.fork(handle, 1), "was released")


def fault_scenario(backend_name: str, **options: Any) -> None:
    """Kill -9, hang, raise, garbage in one pool: each faulted sandbox ends truncated with the
    reason in its info, the others and later resets work, and no process is left behind."""
    from envs.sandbox import procutil
    from envs.sandbox.base import SandboxError
    from envs.sandbox.pool import SandboxPool

    before = set(procutil.descendant_pids(os.getpid()))
    with SandboxPool(
        "sandbox_counter", {}, backend=backend_name, step_timeout_s=1.5, num_workers=8, **options
    ) as pool:
        sids = [sid for sid, _, _ in pool.reset_many([CounterTask(f"t{i}") for i in range(5)])]
        pool.step_many([(sid, "inc") for sid in sids])
        handle = pool.snapshot(sids[0])
        os.kill(pool.pid(sids[1]), signal.SIGKILL)  # Dies mid-episode, between two steps.
        start = time.perf_counter()
        results = pool.step_many(
            [(sids[0], "inc"), (sids[1], "inc"), (sids[2], "hang"), (sids[3], "raise")]
            + [(sids[4], "garbage")]
        )
        elapsed = time.perf_counter() - start
        assert elapsed < 6.0, f"one timeout for the whole batch, not one per request: {elapsed}"
        assert results[0].observation.startswith("count=2 ") and not results[0].done
        expected = {1: "crash", 2: "timeout", 3: "error", 4: "garbage"}
        for i, kind in expected.items():
            result = results[i]
            assert result.observation == "" and result.reward == 0.0 and result.done, result
            assert result.info["truncated"] and result.info["fault"] == kind, result.info
            assert result.info["invalid_action"] is False, result.info
        assert "did not answer 'step' in 1.5 s" in results[2].info["error"]
        assert "ValueError: CounterEnv was asked to raise" in results[3].info["error"]
        assert "sent garbage" in results[4].info["error"]
        stats = pool.stats()
        assert stats["faults"] == 4 and stats["live_sandboxes"] == 1, stats
        assert stats["faults_by_kind"] == {"crash": 1, "timeout": 1, "error": 1, "garbage": 1}
        assert [f["sid"] for f in pool.faults()] == sids[1:]
        for sid in sids[1:]:
            _expect(SandboxError, lambda sid=sid: pool.step(sid, "inc"), "no live sandbox")
        # The pool keeps working: a fresh sandbox, forks of an old snapshot, a crash while forked.
        sid, observation, _ = pool.reset(CounterTask("fresh", start=7))
        assert observation.startswith("count=7 ")
        forked = pool.fork(handle, 2)
        outs = pool.step_many([(forked[0], "inc"), (forked[1], "crash"), (sid, "inc")])
        assert outs[0].observation.startswith("count=2 ")
        assert outs[1].info["fault"] == "crash"
        assert outs[2].observation.startswith("count=8 ")
        assert pool.stats()["faults"] == 5
    assert leftover_processes(before) == []
    zombies = [p for p in procutil.child_pids(os.getpid()) if not procutil.pid_alive(p)]
    assert zombies == [], f"unreaped children: {zombies}"


_TRAINER_SCRIPT = """
import os, sys, time
from envs.sandbox import SandboxPool, procutil
from envs.sandbox.testing import CounterTask
pool = SandboxPool("sandbox_counter", {}, backend=sys.argv[1], step_timeout_s=600)
sids = [s for s, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
pool.fork(pool.snapshot(sids[0]), 2)
if sys.argv[2] == "kill-zygote":  # Its workers are orphans of the backend's keeper now.
    zygote = pool.backend._zygote.pid
    os.kill(zygote, 9)
    assert procutil.wait_gone([zygote], timeout_s=5) == []
pool._sandboxes[sids[1]].start_step("hang")  # Busy when the trainer dies.
time.sleep(0.3)
print(" ".join(map(str, procutil.descendant_pids(os.getpid()))), flush=True)
time.sleep(120)
"""


def trainer_death_scenario(
    backend_name: str, sig: int, repo: str, kill_zygote: bool = False
) -> int:
    """Starts a trainer process with sandboxes (one of them busy), sends it `sig`, and checks
    that every process it started goes away. Returns the trainer's exit code.

    `kill_zygote` (fork backend): the trainer SIGKILLs its zygote first, so that the workers
    are orphans when it dies."""
    from envs.sandbox import procutil

    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER_SCRIPT, backend_name, "kill-zygote" if kill_zygote else ""],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) >= 4, f"expected the trainer's sandbox processes, got {line!r}"
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    left = procutil.wait_gone(pids, timeout_s=10)
    assert left == [], f"processes outlived their trainer: {left}"
    return proc.returncode
