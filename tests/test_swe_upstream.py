"""SWE-bench grading as upstream's harness grades (envs/swe/swebench.py, grading.py, data.py).

The records of `swebench_fixtures` (official schema, small repositories written by the tests)
each reproduce a case in which the grader disagreed with upstream's harness
(github.com/swe-bench/SWE-bench, `swebench/harness`); each test says what upstream decides and
why, and checks that the grader now decides the same. Gold patches are played through the env
(jail executor) where the repository uses pytest; the django-style repository runs upstream's
test command in a jail and is graded from its log, and sympy's format is graded from a log
excerpt. Needs root (the jails use namespaces), like tests/test_swe.py. About half a minute.
"""

import dataclasses
import json

import pytest
from swe_fixtures import put
from swebench_fixtures import (
    MINIWRAP_FILES,
    SYMPY_LOG_BUGGY,
    SYMPY_LOG_GOLD,
    TEXTVEC_FIXED,
    TEXTVEC_TRUNCATED,
    patched_files,
    record_task,
    records,
)

from envs.base import make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.swe import swebench
from envs.swe.data import instance_to_task, load_swebench, task_to_instance
from envs.swe.env import jail_pythonpath, pytest_options
from envs.swe.grading import grade_in_docker, graded_files, graded_outcomes, outcomes_from_log
from envs.swe.jail import JAIL_ROOT, Limits, run_harness, run_in_jail
from envs.swe.results import TestOutcomes
from envs.swe.workspace import Workspace

_LIMITS = Limits(timeout_s=60.0)


@pytest.fixture(scope="module")
def env():
    env = make_env("swe", max_steps=30, command_timeout_s=10.0)
    yield env
    env.close()


def _play_patch(env, task, patch):
    """Plays `patch` with the env's tools (each changed file written whole), then submits."""
    env.reset(options={"task": task})
    for rel, text in sorted(patched_files(task, patch).items()):
        result = step(env, put(rel, text))
        assert not result.info["invalid_action"], result.observation
    return step(env, "submit")


def _overlay(task, patch):
    """The grading overlay (`graded_files`) of a submission that applies `patch`."""
    ws = Workspace(task.tree)
    ws.apply_changes(
        {p: t.encode() for p, t in patched_files(task, patch).items()} if patch else {}
    )
    files, taken, _ = graded_files(task, ws)
    return files, taken


class _JailExecutor:
    """`grade_in_docker`'s executor with a jail in place of a container (this machine has no
    Docker): the same command, environment and overlay, run on the task's tree."""

    def run(self, task, files, argv, *, limits, env, capture=False, pytest_report=False):
        return run_in_jail(task.tree, files, argv, limits=limits, env=env,
                           pytest_report=pytest_report)  # fmt: skip


# Test ids: upstream's cut at the first space ------------------------------------------------


def test_pytest_key_is_upstreams_cut_and_shared_keys_combine_as_its_log():
    nodeid = "t.py::test_e[file-AttributeError-'str' object has no attribute 'read']"
    assert swebench.pytest_key(nodeid) == "t.py::test_e[file-AttributeError-'str'"
    assert swebench.pytest_key("t.py::test_a[1-2]") == "t.py::test_a[1-2]"
    # Repository-specific rewrites of upstream's parsers.
    assert (
        swebench.pytest_key("t.py::test_p[/a/b/c.py]", "pylint-dev/pylint") == "t.py::test_p[/c.py]"
    )
    assert swebench.pytest_key("t.py::test_p[/a/b/c.py]") == "t.py::test_p[/a/b/c.py]"
    assert (swebench.pytest_key("t.py::test_m[MouseButton.LEFT]", "matplotlib/matplotlib")
            == "t.py::test_m[1]")  # fmt: skip

    def outcomes(*pairs):
        return TestOutcomes([{"nodeid": n, "when": "call", "outcome": o} for n, o in pairs])

    a, b = "t.py::test_e[x-'str' one]", "t.py::test_e[x-'str' two]"
    key = "t.py::test_e[x-'str'"
    # Upstream's -rA summary lists passed, skipped, xfailed, xpassed, errors, failed, and its
    # dict keeps the last line of a key: one failure among the tests sharing it decides.
    assert outcomes((a, "passed"), (b, "passed")).passed(key)
    assert not outcomes((a, "passed"), (b, "failed")).passed(key)
    assert outcomes((a, "failed"), (b, "passed")).outcome(key) == "failed"
    assert outcomes((a, "passed"), (b, "skipped")).outcome(key) == "skipped"
    assert outcomes((a, "passed"), (b, "xfailed")).passed(key)
    # XPASS is no status word upstream reads: the other test's status stands.
    assert outcomes((a, "xpassed"), (b, "passed")).passed(key)
    assert not outcomes(
        (a, "xpassed"),
    ).passed(key)
    # A full node id (the builder's synthetic tasks) still matches itself exactly.
    assert outcomes((a, "passed"), (b, "failed")).passed(a)
    assert (
        outcomes(
            (a, "passed"),
        ).outcome("t.py::test_e[y")
        is None
    )


def _harness_outcomes(task, patch):
    files, taken = _overlay(task, patch)
    result = run_harness(
        task.tree, files, pytest_options(task.pytest_args, task.test_files()), limits=_LIMITS,
        pythonpath=jail_pythonpath(task.pythonpath).split(":"),
        agent_files=[f"{JAIL_ROOT}/{p}" for p in taken],
    )  # fmt: skip
    outcomes, problem = graded_outcomes(result)
    assert problem is None, (problem, result.output[-2000:])
    return result, outcomes


def test_truncated_parametrised_ids_match_as_upstream(env, tmp_path):
    # scikit-learn-15100's case. Upstream runs `pytest -rA` and records `PASSED <id>` lines up to
    # the first space, which is how the dataset wrote these two PASS_TO_PASS ids; so with the gold
    # patch every id of the record is PASSED in its status map: resolved.
    task = record_task(tmp_path, "textvec")
    assert set(TEXTVEC_TRUNCATED) <= set(task.pass_to_pass)
    result = _play_patch(env, task, task.patch)
    assert result.reward == 1.0 and result.info["won"], result.observation
    assert result.info["tests"]["pass_to_pass_passed"] == 3
    # Before: the node ids the harness reported were matched exactly, and none equals a cut id.
    run, outcomes = _harness_outcomes(task, task.patch)
    exact = TestOutcomes(run.report, key=lambda nodeid: nodeid)
    assert [i for i in task.pass_to_pass if not exact.passed(i)] == list(TEXTVEC_TRUNCATED)
    assert swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)["resolved"]
    # The Docker executor's pytest grading (report plugin; here in a jail) matches them too.
    options = pytest_options(task.pytest_args, task.test_files())
    gold = _overlay(task, task.patch)[0]
    run, outcomes, problem = grade_in_docker(
        _JailExecutor(), task, gold, _LIMITS, "python", options
    )
    assert problem is None and len(run.report) >= 5, run.output[-2000:]
    assert swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)["resolved"]
    # A fix that breaks one of the cut-id tests: upstream's FAILED line for it: not resolved.
    env.reset(options={"task": task})
    broken = TEXTVEC_FIXED.replace("return doc.read().split()", 'raise TypeError("no file")')
    step(env, put("textvec/text.py", broken))
    result = step(env, "submit")
    assert result.reward == 0.0 and result.info["tests"]["pass_to_pass_passed"] == 2
    assert f"FAILED {TEXTVEC_TRUNCATED[0]}" in result.observation, result.observation
    # Doing nothing: test_strip_accents still fails (upstream: FAILED, not resolved).
    result = _play_patch(env, task, "")
    assert result.reward == 0.0 and result.info["tests"]["fail_to_pass_passed"] == 0


def test_repository_plugins_loaded_by_its_config_are_kept(env, tmp_path):
    # pytest-dev/pytest's case: its addopts load `-p pytester`, which its tests need. Upstream runs
    # the repository's config as it is, so the gold patch passes both FAIL_TO_PASS tests: resolved.
    task = record_task(tmp_path, "miniwrap")
    result = _play_patch(env, task, task.patch)
    assert result.reward == 1.0, result.observation
    # Before: `-o addopts=` dropped the plugin and the pytester test could not get its fixture.
    cleared = dataclasses.replace(task, pytest_args=("-o", "addopts="))
    result = _play_patch(env, cleared, task.patch)
    assert result.reward == 0.0 and result.info["tests"]["fail_to_pass_passed"] == 1
    assert "fixture 'pytester' not found" in result.observation, result.observation
    assert _play_patch(env, task, "").reward == 0.0


_FORCE_PASS_PLUGIN = "def pytest_pyfunc_call(pyfuncitem):\n    return True\n"


def test_a_config_plugin_the_agent_changed_is_refused(env, tmp_path):
    # Keeping the repository's `-p` plugins lets a plugin be a library module: one the agent
    # changes is code that decides outcomes, so the run is not believed.
    task = record_task(tmp_path, "miniwrap")
    (tmp_path / "miniwrap/miniwrap/plugin.py").write_text('"""Test helpers of miniwrap."""\n')
    (tmp_path / "miniwrap/pyproject.toml").write_text(
        MINIWRAP_FILES["pyproject.toml"].replace("-p pytester", "-p pytester -p miniwrap.plugin")
    )
    env.reset(options={"task": task})
    step(env, put("miniwrap/plugin.py", _FORCE_PASS_PLUGIN))
    result = step(env, "submit")
    assert result.reward == 0.0, result.observation
    assert "is a module the agent changed (/tmp/testbed/miniwrap/plugin.py)" in result.observation
    assert _play_patch(env, task, task.patch).reward == 1.0  # The plugin left as it was.


# django and sympy: their own runners and log formats ----------------------------------------


def test_test_commands_and_directives_are_upstreams(tmp_path):
    r = records()
    argv, environ = swebench.test_command("django/django", "5.0", r["minidj"]["test_patch"])
    assert argv == ["./tests/runtests.py", "--verbosity", "2", "--settings=test_sqlite",
                    "--parallel", "1", "utils_tests.test_text"] and environ == {}  # fmt: skip
    argv, environ = swebench.test_command("django/django", "1.9", r["minidj"]["test_patch"])
    assert argv == ["./tests/runtests.py", "--verbosity", "2", "utils_tests.test_text"]
    assert environ["LANG"] == "en_US.UTF-8" and environ["PYTHONIOENCODING"] == "utf8"
    # sympy: the test files of test_patch, data files (upstream's NON_TEST_EXTS) left out.
    argv, environ = swebench.test_command("sympy/sympy", "1.5", r["sympy"]["test_patch"])
    assert argv == ["bin/test", "-C", "--verbose", "sympy/printing/tests/test_latex.py"]
    assert environ == {"PYTHONWARNINGS": "ignore::UserWarning,ignore::SyntaxWarning"}
    with pytest.raises(ValueError, match="runs its tests with pytest"):
        swebench.test_command("scikit-learn/scikit-learn", "0.22", r["textvec"]["test_patch"])
    assert instance_to_task(r["minidj"]).test_files() == ["tests/utils_tests/test_text.py"]


_DJANGO_LOG = """\
Testing against Django installed in '/testbed/django'
Importing application admin_views
Found 7 test(s).
System check identified no issues (0 silenced).
test_callable (admin_views.tests.AdminViewBasicTest) ... ok
test_changelist (admin_views.tests.AdminViewBasicTest) ... FAIL
test_broken (admin_views.tests.AdminViewBasicTest) ... ERROR
test_sqlite_only (admin_views.tests.AdminViewBasicTest) ... skipped 'Database has feature(s) x'
test_logged (admin_views.tests.AdminViewBasicTest) ... Internal Server Error: /test_admin/admin/
Traceback (most recent call last):
  File "/testbed/django/core/handlers/exception.py", line 47, in inner
ValueError: logged, not raised
ok
test_new_style (admin_views.tests.NewStyleTests.test_new_style) ... ok
test_known_bug (admin_views.tests.AdminViewBasicTest) ... expected failure

======================================================================
FAIL: test_changelist (admin_views.tests.AdminViewBasicTest)
----------------------------------------------------------------------
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 7 tests in 0.321s

FAILED (failures=1, errors=1, skipped=1, expected failures=1)
"""


def test_django_log_parser_reads_upstreams_statuses():
    cls = "(admin_views.tests.AdminViewBasicTest)"
    assert swebench.parse_django_log(_DJANGO_LOG) == {
        f"test_callable {cls}": "passed",
        f"test_changelist {cls}": "failed",
        f"test_broken {cls}": "error",
        f"test_sqlite_only {cls}": "skipped",
        f"test_logged {cls}": "passed",  # Its `ok` came lines after its name.
        "test_new_style (admin_views.tests.NewStyleTests.test_new_style)": "passed",
        # upstream reads a FAIL: header up to the first space; "expected failure" it does not
        # read at all (so such a test counts as failed).
        "test_changelist": "failed",
    }


def test_django_repo_is_graded_by_its_runner_and_log(tmp_path):
    # upstream runs `./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1
    # utils_tests.test_text` (the module test_patch touches) and reads `name (module.Class.name)
    # ... ok` lines: with the gold patch the FAIL_TO_PASS test and the three PASS_TO_PASS tests
    # are ok (test_noisy's `ok` on a later line), so resolved; without it, the new test FAILs.
    task = record_task(tmp_path, "minidj")
    gold = _overlay(task, task.patch)[0]
    result, outcomes, problem = grade_in_docker(_JailExecutor(), task, gold, _LIMITS, "python", ())
    assert problem is None and result.exit_code == 0, result.output
    verdict = swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)
    assert verdict["resolved"], (verdict, result.output)
    skipped = "test_skipped (utils_tests.test_text.TestUtilsText.test_skipped)"
    assert outcomes.outcome(skipped) == "skipped"
    nothing = _overlay(task, "")[0]
    result, outcomes, problem = grade_in_docker(
        _JailExecutor(), task, nothing, _LIMITS, "python", ()
    )
    verdict = swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)
    assert not verdict["resolved"] and verdict["FAIL_TO_PASS"]["failure"] == list(task.fail_to_pass)
    assert (
        outcomes.outcome(task.fail_to_pass[0]) == "failed"
        and not verdict["PASS_TO_PASS"]["failure"]
    )
    # Before: graded by pytest on "files" named by these ids, no test ran.
    assert not TestOutcomes(None).passed(task.pass_to_pass[0])


def test_sympy_log_is_graded_as_upstream_reads_it():
    # upstream reads `test_name ok|F|E` lines of `bin/test -C --verbose` and marks the
    # `path.py:test_name` headers of the failure report failed. The gold log has the record's
    # tests ok: resolved. In the buggy one test_latex_subs is F: not resolved.
    task = instance_to_task(records()["sympy"])
    statuses = swebench.parse_sympy_log(SYMPY_LOG_BUGGY)
    assert statuses == {
        "test_printmethod": "passed",
        "test_latex_basic": "passed",
        "test_latex_subs": "failed",
        "sympy/printing/tests/test_latex.py:test_latex_subs": "failed",
    }  # test_latex_symbols ends in its file's [FAIL] mark, which upstream does not read.
    for log, resolved in ((SYMPY_LOG_GOLD, True), (SYMPY_LOG_BUGGY, False)):
        outcomes = outcomes_from_log(task.repo, log)
        verdict = swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)
        assert verdict["resolved"] is resolved, verdict


# Loading: every field kept, no empty FAIL_TO_PASS -------------------------------------------


def test_records_round_trip_every_field(tmp_path):
    path = tmp_path / "records.jsonl"
    kept = [r for name, r in records().items() if name != "no_fail_to_pass"]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tasks = load_swebench(path)
    for record, task in zip(kept, tasks, strict=True):
        back = task_to_instance(task)
        expected = dict(record, FAIL_TO_PASS=json.loads(record["FAIL_TO_PASS"]),
                        PASS_TO_PASS=json.loads(record["PASS_TO_PASS"]))  # fmt: skip
        assert back == expected
        assert task.created_at == record["created_at"]
        assert task.environment_setup_commit == record["environment_setup_commit"]
        assert task.extra == {"difficulty": record["difficulty"]}
        assert instance_to_task(back) == task


def test_an_instance_without_fail_to_pass_is_refused_at_load(tmp_path):
    # Upstream computes the FAIL_TO_PASS rate as 1 when there are no such tests, so any patch
    # that keeps PASS_TO_PASS passing (an empty one included) is resolved without a test of the
    # fix being run. Here the instance is refused when it is loaded.
    record = records()["no_fail_to_pass"]
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"{record['instance_id']}: FAIL_TO_PASS is empty"):
        load_swebench(path)
    for empty in ([], "[]", "", None):
        with pytest.raises(ValueError, match="FAIL_TO_PASS is empty"):
            instance_to_task(dict(record, FAIL_TO_PASS=empty))
    assert not swebench.report(lambda i: True, [], ["a"])["resolved"]
