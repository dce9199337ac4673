"""Repository repair as a gymnasium env (`bpo_jax/RepoRepair-v0`, "swe"): fix a bug with file
tools and jailed test runs.

An episode starts from a task's buggy tree (`SweTask`); the agent acts with the tool grammar of
`envs.swe.tools` and ends it with `submit` (or hits the step limit). Grading runs the task's
FAIL_TO_PASS and PASS_TO_PASS tests with the test files restored to their original content (plus
`test_patch`), as SWE-bench does; the reward is 1.0 when every one of them passes.

Sandboxing: the working copy is a `Workspace` (base tree + in-memory edits). Every command (a
test run, `run COMMAND`, grading) runs in a fresh jail (`envs.swe.jail`): its own mount, PID and
network namespaces, a private tmpfs with a copy of the tree, a chroot that shows only the
system folders and the interpreter read-only, an unprivileged uid, CPU/memory/process/file-size
limits and a wall-clock timeout. Nothing survives the call but the file changes it made, which
go back into the workspace. So between steps the env holds no process and no file of its own:
forking the worker (fork backend), checkpointing it (CRIU), deep-copying it or replaying its
actions all copy the episode exactly, and copies never share files.

Rewards: 1.0 on the step that grades a resolved task, `-invalid_action_penalty` for an invalid
action (unparseable, unknown tool, bad arguments, a path outside the working copy or one that
does not exist, OLD not on the line), else 0. A command that fails, times out or hits a limit is
a valid action; its observation says what happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.base import TextEnv
from envs.swe import tools
from envs.swe.data import SweTask, load_tasks
from envs.swe.filetools import FileTools, ToolError
from envs.swe.grading import (
    agent_definitions,
    describe_findings,
    describe_refused,
    grade_in_docker,
    graded_files,
    graded_outcomes,
    review,
)
from envs.swe.jail import JAIL_ROOT, JailResult, Limits, check_jail, run_harness, run_in_jail
from envs.swe.patching import PatchError, apply_patch
from envs.swe.results import TestOutcomes, normalize_text
from envs.swe.workspace import PathError, Workspace

__all__ = ["SweEnv", "jail_pythonpath", "pytest_command", "pytest_options"]

_EXECUTORS = ("jail", "docker")


def pytest_options(pytest_args: Sequence[str], targets: Sequence[str]) -> list[str]:
    """pytest's options for a run on `targets` (no plugin to load; see `pytest_command`)."""
    return [
        "-p", "no:cacheprovider", "-q", "--tb=short", "-rN", "--color=no",
        *pytest_args, *targets,
    ]  # fmt: skip


def pytest_command(python: str, pytest_args: Sequence[str], targets: Sequence[str]) -> list[str]:
    """The pytest command line for `targets` (with the report plugin loaded).

    The repository's own options (`addopts`, plugins it loads with `-p`) are kept, as SWE-bench
    keeps them; in a jail, plugin autoloading is off (the interpreter's entry-point plugins
    are this project's, not the repository's).
    """
    return [python, "-m", "pytest", "-p", "bpo_swe_report", *pytest_options(pytest_args, targets)]


def jail_pythonpath(pythonpath: Sequence[str]) -> str:
    """PYTHONPATH inside a jail for folders given relative to the repository root."""
    parts = [JAIL_ROOT if p in ("", ".") else f"{JAIL_ROOT}/{p}" for p in pythonpath]
    if JAIL_ROOT not in parts:
        parts.append(JAIL_ROOT)
    return ":".join(parts)


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    keep = max(limit // 2 - 40, 0)
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters left out ...]\n{text[-keep:]}"


class SweEnv(TextEnv, FileTools):
    """One repository-repair episode at a time; see the module docstring.

    Info keys besides the common ones (`envs.base`): `action`, `tool`.
    `reset` adds `goal`, `task_id`, `task_type`; a step that grades adds `tests` (how many of
    the FAIL_TO_PASS and PASS_TO_PASS tests pass), `submitted`, and `defences`: what the grader's
    defences against reward hacks found (`findings` of the diff check, the harness's
    `refused_comparisons` and `inspections`, and the `problem` that voided the run, if any).

    Example:
        env = SweEnv(max_steps=30)
        observation, info = env.reset(options={"task": task})
        for action in task.walkthrough:
            observation, reward, terminated, truncated, info = env.step(action)

    `reset()` without a task draws one of the `test` tasks (from `$SWE_TASKS_DIR`), or of the
    constructor's `tasks`.
    """

    task_class = SweTask
    load_tasks = staticmethod(load_tasks)  # (data_root, split, task_types, **options)
    default_split = "test"

    def __init__(
        self,
        max_steps: int = 30,
        invalid_action_penalty: float = 0.0,
        *,
        executor: str = "jail",
        python: str = "",
        command_timeout_s: float = 20.0,
        test_timeout_s: float = 40.0,
        cpu_time_s: int = 60,
        memory_mb: int = 2048,
        max_processes: int = 64,
        max_file_mb: int = 16,
        tmpfs_mb: int = 256,
        observation_chars: int = 3000,
        view_lines: int = 40,
        max_view_lines: int = 100,
        max_hits: int = 20,
        docker: dict[str, Any] | None = None,
        tasks: Sequence[SweTask] | None = None,
    ):
        """Creates the env.

        Args:
            max_steps: Episode length limit; the step that reaches it grades the working copy
                and ends the episode (`truncated` unless it was resolved).
            invalid_action_penalty: Non-negative amount subtracted for an invalid action.
            executor: "jail" (local namespaces; needs root) or "docker" (the task's SWE-bench
                image, or for a task with a tree its local image, `envs.swe.images`).
            python: Interpreter for tests and `run` (default: the worker's own) of tasks without
                a test environment of their own (`SweTask.python`).
            command_timeout_s: Wall-clock limit of `run` and `test`.
            test_timeout_s: Wall-clock limit of grading.
            cpu_time_s, memory_mb, max_processes, max_file_mb, tmpfs_mb: Jail limits (see
                `envs.swe.jail.Limits`).
            observation_chars: Longest observation (longer ones keep their head and tail).
            view_lines: Lines `view` shows without a range; `max_view_lines` with one.
            max_hits: Most lines `search` (and twice as many paths `find`) shows.
            docker: Options of the Docker executor (see `envs.swe.docker.DockerExecutor`).
            tasks: What `reset()` without a task draws from (default: the `test` split).

        Raises:
            ValueError: For an out-of-range argument.
            envs.swe.jail.JailUnavailableError: If executor="jail" cannot run here.
            envs.swe.docker.DockerUnavailableError: If executor="docker" and Docker is missing.
        """
        super().__init__(max_steps, invalid_action_penalty, tasks)
        if executor not in _EXECUTORS:
            raise ValueError(f"executor must be one of {_EXECUTORS}, got {executor!r}.")
        for name, value in (
            ("observation_chars", observation_chars),
            ("view_lines", view_lines),
            ("max_view_lines", max_view_lines),
            ("max_hits", max_hits),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        self.observation_chars = observation_chars
        self.view_lines = view_lines
        self.max_view_lines = max_view_lines
        self.max_hits = max_hits
        common = dict(
            cpu_s=int(cpu_time_s),
            memory_mb=int(memory_mb),
            processes=int(max_processes),
            file_mb=int(max_file_mb),
            tmpfs_mb=int(tmpfs_mb),
        )
        self.command_limits = Limits(timeout_s=float(command_timeout_s), **common)
        self.test_limits = Limits(timeout_s=float(test_timeout_s), **common)
        self.executor = executor
        if executor == "jail":
            import sys

            check_jail()
            self.python = python or sys.executable
            self._docker = None
        else:
            from envs.swe.docker import DockerExecutor

            self._docker = DockerExecutor(**(docker or {}))
            self.python = python or "python"

        self._ws: Workspace | None = None

    @property
    def workspace(self) -> Workspace | None:
        """The episode's working copy (for tests and tools that inspect it)."""
        return self._ws

    # Episode ------------------------------------------------------------------------------------

    def _start(self, task: SweTask) -> tuple[str, dict[str, Any]]:
        """Starts an episode on the task's buggy tree.

        Returns:
            The problem statement followed by the tool list, and the info dict.

        Raises:
            FileNotFoundError: If the task's tree is missing (rebuild the tasks).
            ValueError: If the task's bug patch does not apply to its tree.
        """
        if self._docker is not None:
            base = self._docker.prepare(task)
        else:
            if not task.tree:
                raise FileNotFoundError(
                    f"Task {task.task_id} has no local tree: SWE-bench instances run in their "
                    "Docker images; use executor='docker' on a machine with Docker."
                )
            base = task.tree
        ws = Workspace(base)
        if task.bug_patch:
            try:
                bug = apply_patch(lambda p: _read_or_none(ws, p), task.bug_patch)
            except PatchError as e:
                raise ValueError(
                    f"Task {task.task_id}: its bug patch does not apply to {base}: {e}. "
                    "Rebuild the tasks."
                ) from e
            ws = Workspace(base, {p: None if t is None else t.encode() for p, t in bug.items()})
        self._ws = ws
        observation = f"{task.problem_statement.strip()}\n\n{tools.SHORT_HELP}"
        info = self._info(won=False, invalid=False, action=None, tool=None)
        info.update(goal=self.goal(task), task_id=task.task_id, task_type=task.task_type)
        return _shorten(observation, self.observation_chars), info

    @staticmethod
    def goal(task: SweTask) -> str:
        """One line that says what to do (the agent's `<task>` text)."""
        names = list(dict.fromkeys(n.split("::")[-1].split("[")[0] for n in task.fail_to_pass))
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"fix {task.task_type} so that {', '.join(names[:3])}{more} pass"

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """Runs one tool call; see the class docstring for rewards and info."""
        invalid, submitted, tool = False, False, None
        try:
            call = tools.parse_action(action)
            tool = call.tool
            if call.tool == "submit":
                submitted = True
                observation = "Submitted."
            else:
                observation = self._run_tool(call)
        except (tools.ToolSyntaxError, PathError, ToolError) as e:
            invalid, observation = True, f"Invalid action: {e}"
        info_extra: dict[str, Any] = {}
        won = False
        if submitted or self.last_step:
            won, report, counts, defences = self._grade()
            prefix = "" if submitted else f"{observation}\n\nStep limit reached. "
            observation = prefix + report
            info_extra = {"tests": counts, "submitted": submitted, "defences": defences}
        if won:
            reward = 1.0
        elif invalid and self.invalid_action_penalty:
            reward = -self.invalid_action_penalty
        else:
            reward = 0.0
        text = (action or "").strip() or None
        info = self._info(won=won, invalid=invalid, action=text, tool=tool)
        info.update(info_extra)
        observation = _shorten(observation, self.observation_chars)
        return observation, reward, submitted or won, info

    def _close(self) -> None:
        """Ends the episode. Safe to call more than once; the env holds no process or file."""
        self._ws = None

    def _info(self, *, won, invalid, action, tool) -> dict[str, Any]:
        return {
            "won": won,
            "invalid_action": invalid,
            "action": action,
            "tool": tool,
        }

    # Tools --------------------------------------------------------------------------------------

    def _run_tool(self, call: tools.ToolCall) -> str:
        return getattr(self, f"_tool_{call.tool}")(call)

    def _tool_test(self, call: tools.ToolCall) -> str:
        ws, task = self._ws, self._task
        assert ws is not None and task is not None
        targets = list(call.args) or list(task.fail_to_pass)
        for target in targets:
            if not target.startswith("-"):
                ws.resolve(target.split("::", 1)[0])
        command = pytest_command(self._python(), task.pytest_args, targets)
        result = self._execute(command, ws.overlay(), self.command_limits, report=True)
        return self._describe_test_run(result)

    def _describe_test_run(self, result: JailResult) -> str:
        if result.error:
            return f"The test run could not start: {result.error}"
        outcomes = TestOutcomes(result.report)
        head = ""
        if result.timed_out:
            head = (
                f"The test run timed out after {self.command_limits.timeout_s:g} s and was "
                "killed; results so far:\n"
            )
        if not outcomes.outcomes and not outcomes.collect_errors:
            tail = normalize_text(result.output.strip())[-1500:]
            return f"{head}pytest ran no test (exit status {result.exit_code}):\n{tail}"
        return head + outcomes.describe()

    def _tool_run(self, call: tools.ToolCall) -> str:
        ws = self._ws
        assert ws is not None
        result = self._execute(["bash", "-c", call.text], ws.overlay(), self.command_limits,
                               report=False, capture=True)  # fmt: skip
        if result.error:
            return f"The command could not start: {result.error}"
        ws.apply_changes(result.changes)
        status = self._status_line(result, self.command_limits)
        output = result.output if result.output.strip() else "(no output)"
        notes = [status]
        if result.changes:
            changed = sorted(result.changes)
            notes.append(
                "Changed files: " + ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else "")
            )
        if result.ignored:
            notes.append(
                "Not kept (too large or not regular files): " + ", ".join(result.ignored[:5])
            )
        budget = max(self.observation_chars - 300, 200)
        return _shorten(output.rstrip(), budget) + "\n" + "\n".join(notes)

    @staticmethod
    def _status_line(result: JailResult, limits: Limits) -> str:
        if result.timed_out:
            return (
                f"[timed out after {limits.timeout_s:g} s; the command and every process it "
                "started were killed]"
            )
        if result.signal == "SIGXFSZ":
            return f"[killed: it wrote more than the {limits.file_mb} MiB file-size limit]"
        if result.signal == "SIGXCPU" or result.signal == "SIGKILL" and result.elapsed_s < 1:
            return f"[killed by {result.signal}]"
        if result.signal:
            return f"[killed by {result.signal}]"
        note = ""
        if result.output_bytes >= limits.file_mb << 20:
            note = f"; output stopped at the {limits.file_mb} MiB limit"
        return f"[exit status {result.exit_code}{note}]"

    # Commands and grading -----------------------------------------------------------------------

    def _python(self) -> str:
        """The interpreter of commands: in a jail the task's test environment's, if it has one
        (its pytest plugins and test requirements), else the env's."""
        task = self._task
        if self._docker is None and task is not None and task.python:
            return task.python
        return self.python

    def _execute(self, argv, files, limits, *, report=False, capture=False) -> JailResult:
        task, ws = self._task, self._ws
        assert task is not None and ws is not None
        env = {"PYTHONPATH": jail_pythonpath(task.pythonpath)}
        if self._docker is not None:
            return self._docker.run(
                task, files, argv, limits=limits, env=env, capture=capture, pytest_report=report
            )
        return run_in_jail(
            ws.base, files, argv, limits=limits, env=env, capture=capture,
            pytest_report=report, python=self._python(),
        )  # fmt: skip

    def _grade(self) -> tuple[bool, str, dict[str, int], dict[str, Any]]:
        """Grades the agent's library changes on pristine tests (see `envs.swe.grading`)."""
        task, ws = self._task, self._ws
        assert task is not None and ws is not None
        files, taken, refused = graded_files(task, ws)
        found, defs = review(task, ws, files, taken)
        options = pytest_options(task.pytest_args, task.test_files())
        if found:  # Not run: its tests could not be trusted.
            result, outcomes, problem = JailResult(), TestOutcomes(()), describe_findings(found)
        elif self._docker is not None:
            result, outcomes, problem = grade_in_docker(
                self._docker, task, files, self.test_limits, self.python, options, taken, defs
            )
        else:
            result = run_harness(
                ws.base, files, options, limits=self.test_limits, python=self._python(),
                pythonpath=jail_pythonpath(task.pythonpath).split(":"),
                agent_files=[f"{JAIL_ROOT}/{p}" for p in taken],
                agent_defs=agent_definitions(JAIL_ROOT, defs),
            )  # fmt: skip
            outcomes, problem = graded_outcomes(result)
        f2p = [n for n in task.fail_to_pass if outcomes.passed(n)]
        p2p = [n for n in task.pass_to_pass if outcomes.passed(n)]
        counts = {
            "fail_to_pass_passed": len(f2p),
            "fail_to_pass_total": len(task.fail_to_pass),
            "pass_to_pass_passed": len(p2p),
            "pass_to_pass_total": len(task.pass_to_pass),
        }
        won = len(f2p) == len(task.fail_to_pass) and len(p2p) == len(task.pass_to_pass)
        lines = [
            f"FAIL_TO_PASS: {len(f2p)}/{len(task.fail_to_pass)} pass; "
            f"PASS_TO_PASS: {len(p2p)}/{len(task.pass_to_pass)} pass."
        ]
        if problem:
            lines.append(problem[0].upper() + problem[1:] + ".")
        elif result.timed_out:
            lines.append(f"The grading run timed out after {self.test_limits.timeout_s:g} s.")
        if note := describe_refused(refused):
            lines.append(note)
        missing = [n for n in (*task.fail_to_pass, *task.pass_to_pass) if not outcomes.passed(n)]
        missing = [] if problem else missing  # The problem line says why none passed.
        for nodeid in missing[:5]:
            state = outcomes.outcome(nodeid) or "not run"
            message = outcomes.messages.get(nodeid, "")
            lines.append(f"{state.upper()} {nodeid}" + (f" - {message[:200]}" if message else ""))
        if len(missing) > 5:
            lines.append(f"... and {len(missing) - 5} more.")
        lines.append("Resolved." if won else "Not resolved.")
        end = result.harness_end or {}
        defences = {
            "findings": [str(f) for f in found],
            "refused_comparisons": int(end.get("refused") or 0),
            "inspections": int(end.get("inspections") or 0),
            "problem": problem,
        }
        return won, "\n".join(lines), counts, defences


def _read_or_none(ws: Workspace, rel: str) -> str | None:
    try:
        return ws.read_text(rel)
    except PathError:
        return None
