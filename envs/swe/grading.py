"""What a submission is graded on, and which test results the grader believes.

SWE-bench grades a fresh container: the repository at its base commit, the model's patch, then
the task's test files reset and `test_patch` applied. Here the grading tree is built the same
way, but narrower on purpose: from the episode's starting tree (the pristine tree plus the
injected bug) it takes only the agent's changes to the library's source (`library_source`),
and test files, conftest files, the test runner's configuration and anything Python or pytest
loads by name from a folder (`sitecustomize.py`, `usercustomize.py`, `*.pth`, byte code,
extension modules) always come from the pristine tree. The tests then run under the grading
harness (`harness.py`, via `envs.swe.jail.run_harness`) in a fresh jail, and a test counts as
passed only when the harness's signed, complete report says so (`graded_outcomes`).

Before that the agent's changes are read (`review`, `envs.swe.diffcheck`): code that inspects
its callers or the tests, where the pristine library did not, grades the submission 0 with the
finding named; the definitions the agent wrote or changed go to the harness, whose assertion
guard (`assert_guard.py`) trusts neither their comparison methods nor their frame access.

SWE-bench instances run in their Docker images (`grade_in_docker`): pytest repositories with the
report plugin, django and sympy with upstream's own test command, their outcomes read from the
log (`outcomes_from_log`); ids match as upstream matches them (`envs.swe.swebench`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.machinery
from collections.abc import Mapping, Sequence
from typing import Any

from envs.swe import swebench
from envs.swe.data import SweTask
from envs.swe.diffcheck import Finding
from envs.swe.diffcheck import review as _review
from envs.swe.jail import JailResult, Limits
from envs.swe.patching import PatchError, apply_patch, patched_paths
from envs.swe.results import TestOutcomes
from envs.swe.workspace import PathError, Workspace

__all__ = [
    "RUNNER_FILES",
    "agent_definitions",
    "describe_findings",
    "describe_refused",
    "graded_files",
    "grade_in_docker",
    "graded_outcomes",
    "outcomes_from_log",
    "is_test_path",
    "library_source",
    "review",
]

# Configuration that pytest (or Python itself) reads from the tree. pyproject.toml and setup.cfg
# are kept whole: a bug fix has no reason to edit packaging metadata, and both can hold pytest's
# options ([tool.pytest.ini_options], [tool:pytest]).
RUNNER_FILES = frozenset({
    "pytest.ini", ".pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini", "conftest.py",
    "sitecustomize.py", "usercustomize.py",
})  # fmt: skip
_TEST_FOLDERS = frozenset({"tests", "test", "testing"})
_TEST_NAMES = ("test_*.py", "*_test.py")
_LOADED_BY_NAME = (".pth", ".pyc", ".pyo", *importlib.machinery.EXTENSION_SUFFIXES)
_MISSING = object()


def is_test_path(rel: str) -> bool:
    """A test file, a file in a test folder, or test-runner configuration (by path alone)."""
    parts = rel.split("/")
    name = parts[-1]
    if name in RUNNER_FILES or any(p in _TEST_FOLDERS for p in parts[:-1]):
        return True
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _TEST_NAMES)


def library_source(
    rel: str,
    pristine: frozenset[str] | set[str],
    protected: set[str],
    roots: frozenset[str] | set[str] = frozenset({""}),
) -> bool:
    """Whether an agent's change to `rel` is taken into the grading tree.

    Taken: a change to a file of the pristine tree that is not a test, conftest or runner
    configuration, and a new file inside a package folder of the pristine tree (one with an
    `__init__.py`), unless that folder is one of the `roots` on sys.path ("" is the tree's
    root), where a new module could shadow any other by name. Never: anything Python or
    pytest loads by its name or suffix.
    """
    parts = rel.split("/")
    if rel in protected or is_test_path(rel) or "__pycache__" in parts:
        return False
    if parts[-1].endswith(_LOADED_BY_NAME):
        return False
    if rel in pristine:
        return True
    folder = "/".join(parts[:-1])
    return folder not in roots and f"{folder}/__init__.py" in pristine


def graded_files(
    task: SweTask, ws: Workspace
) -> tuple[dict[str, bytes | None], list[str], list[str]]:
    """(overlay to grade, relative to the base tree; the agent's changes taken; those left out).

    Raises:
        RuntimeError: If the task's test_patch does not apply to the pristine test files.
    """
    protected = set(task.test_files())
    if task.test_patch:
        protected.update(patched_paths(task.test_patch))
    pristine = set(ws.all_files(at_start=True))
    roots = {"" if p in ("", ".") else p.strip("/") for p in task.pythonpath} | {""}
    files = {p: c for p, c in ws.start.items() if p not in protected and not is_test_path(p)}
    taken, refused = [], []
    for rel in sorted(set(ws.files) | set(ws.start)):
        now, start = ws.files.get(rel, _MISSING), ws.start.get(rel, _MISSING)
        if now is start or now == start:
            continue
        if not library_source(rel, pristine, protected, roots):
            refused.append(rel)
            continue
        taken.append(rel)
        if now is _MISSING:
            files.pop(rel, None)  # Back to the base tree's version.
        else:
            files[rel] = now
    if task.test_patch:
        base = Workspace(ws.base)
        try:
            patched = apply_patch(lambda p: _read_or_none(base, p), task.test_patch)
        except PatchError as e:
            raise RuntimeError(f"Task {task.task_id}: its test_patch does not apply: {e}") from e
        files.update({p: None if t is None else t.encode() for p, t in patched.items()})
    return files, taken, refused


def graded_outcomes(result: JailResult) -> tuple[TestOutcomes, str | None]:
    """The outcomes to grade by, and why none can be trusted (None when they can).

    With a problem the outcomes are empty: every expected test then counts as not passed.
    """
    if result.error:
        return TestOutcomes(()), f"the grading run could not start: {result.error}"
    end = result.harness_end
    if end is None:
        why = "timed out" if result.timed_out else f"exit status {result.exit_code}"
        return TestOutcomes(()), (
            f"the test harness did not finish its report ({why}); no test counts as passed"
        )
    if end.get("changed"):
        return TestOutcomes(()), (
            "the code under test changed the test harness or builtins ("
            + ", ".join(map(str, end["changed"][:5]))
            + "); no test counts as passed"
        )
    if end.get("late_plugins"):
        return TestOutcomes(()), (
            "a pytest plugin was registered by the code under test ("
            + ", ".join(map(str, end["late_plugins"][:5]))
            + "); no test counts as passed"
        )
    if end.get("agent_plugins"):
        return TestOutcomes(()), (
            "a pytest plugin that the repository's configuration loads is a module the agent "
            "changed (" + ", ".join(map(str, end["agent_plugins"][:5])) + "); no test counts "
            "as passed"
        )
    inspections = [str(r.get("what")) for r in result.report or () if r.get("when") == "inspection"]
    if inspections or end.get("inspections"):
        return TestOutcomes(()), (
            "the code the agent wrote inspected its callers or the tests while they ran ("
            + "; ".join(inspections[:3])
            + "); no test counts as passed"
        )
    return TestOutcomes(result.report), None


def _read_or_none(ws: Workspace, rel: str) -> str | None:
    try:
        return ws.read_text(rel)
    except PathError:
        return None


def review(task: SweTask, ws: Workspace, files: Mapping[str, bytes | None], taken: list[str]):
    """(findings, written definitions by file) of the graded changes (`envs.swe.diffcheck`)."""
    del task  # The same rules for every task.
    start = {rel: ws.base_text(rel) for rel in taken}
    return _review({rel: files.get(rel) for rel in taken}, ws.base, start,
                   ws.all_files(at_start=True))  # fmt: skip


def agent_definitions(root: str, defs: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The harness's `--agent-def` values: `ROOT/PATH::QUALNAME::KIND`."""
    return [f"{root}/{rel}::{name}::{kind}" for rel, names in sorted(defs.items())
            for name, kind in names.items()]  # fmt: skip


def describe_findings(found: Sequence[Finding]) -> str:
    """The problem line of a submission whose diff inspects its callers or the tests."""
    shown = "; ".join(map(str, found[:5])) + (" ..." if len(found) > 5 else "")
    return (f"the patch adds code that inspects its callers or the tests, which the pristine "
            f"library does not: {shown}; graded 0")  # fmt: skip


def describe_refused(refused: list[str]) -> str | None:
    """A line for the grading report about changes that were not graded."""
    if not refused:
        return None
    shown = ", ".join(refused[:8]) + (" ..." if len(refused) > 8 else "")
    return f"Not graded (tests, test configuration or files outside the library): {shown}"


def outcomes_from_log(repo: str, log: str) -> TestOutcomes:
    """The outcomes of a django or sympy run, read from its log as upstream reads it.

    Their ids are the names the log prints (with spaces, for django), matched exactly.
    """
    statuses = swebench.LOG_PARSERS[swebench.runner(repo)](log)
    return TestOutcomes(swebench.statuses_to_records(statuses), key=lambda name: name)


def grade_in_docker(
    docker: Any,
    task: SweTask,
    files: Mapping[str, bytes | None],
    limits: Limits,
    python: str,
    pytest_options: Sequence[str],
    agent_files: Sequence[str] = (),
    agent_defs: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[JailResult, TestOutcomes, str | None]:
    """(result, outcomes, why none can be trusted) of a grading run in the task's image.

    In an image that runs the signed harness (the local images, `envs.swe.images`) pytest runs
    under it and is trusted as in the jail (`graded_outcomes`); in the official images pytest
    runs with the report plugin, and django and sympy with upstream's commands.

    Args:
        docker: The `envs.swe.docker.DockerExecutor`.
        task, files: The task and the overlay to grade (`graded_files`).
        limits: The grading run's limits.
        python: The image's interpreter (pytest repositories).
        pytest_options: pytest's options and targets (pytest repositories).
        agent_files: The changed files taken into the grading tree, relative paths.
        agent_defs: The definitions the agent wrote or changed in them (`review`).
    """
    kind = swebench.runner(task.repo)
    if kind == "pytest" and getattr(docker, "supports_harness", lambda task: False)(task):
        root = docker.root
        paths = [root if p in ("", ".") else f"{root}/{p.strip('/')}" for p in task.pythonpath]
        result = docker.run_harness(
            task, files, pytest_options, limits=limits, python=python,
            pythonpath=paths if root in paths else [*paths, root],
            agent_files=[f"{root}/{p}" for p in agent_files],
            agent_defs=agent_definitions(root, agent_defs or {}),
        )  # fmt: skip
        outcomes, problem = graded_outcomes(result)
        return result, outcomes, problem
    if kind == "pytest":
        argv = [python, "-m", "pytest", "-p", "bpo_swe_report", *pytest_options]
        result = docker.run(task, files, argv, limits=limits, env={}, pytest_report=True)
        outcomes = TestOutcomes(result.report, key=lambda n: swebench.pytest_key(n, task.repo))
    else:
        argv, env = swebench.test_command(task.repo, task.version, task.test_patch)
        # The whole log: outcomes are read from it.
        limits = dataclasses.replace(limits, output_chars=max(limits.output_chars,
                                                              limits.file_mb << 20))  # fmt: skip
        result = docker.run(task, files, argv, limits=limits, env=env)
        outcomes = outcomes_from_log(task.repo, result.output)
    if result.error:
        return result, TestOutcomes(()), f"the grading run could not start: {result.error}"
    return result, outcomes, None
