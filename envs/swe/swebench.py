"""SWE-bench's own rules: each repository's test command, its log format, and how ids match.

Learnt from upstream's harness (github.com/swe-bench/SWE-bench, `swebench/harness/grading.py`,
`log_parsers/python.py`, `constants/python.py`, `test_spec/python.py`); the code is this
project's own.

- Test ids. Upstream runs pytest with `-rA` and its parsers take, from each short-summary line
  (`PASSED <nodeid>`, `FAILED <nodeid> - <message>`), the first whitespace-separated word after
  the status. A node id with a space in it (a parametrised string such as `'str' object has no
  attribute 'read'`) is therefore recorded cut at its first space, and the dataset's ids were
  made by the same cut: `test_x[file-AttributeError-'str'`. `pytest_key` is that cut (plus the
  two repository-specific rewrites of upstream's parsers); `TestOutcomes` matches a dataset id
  to every node id whose key it is. Tests sharing a key get one status, as upstream's dict
  does: the summary lists passed, skipped, xfailed, xpassed, errors, failed in that order and
  the last line wins, so a failure or error of any of them decides (`combine_outcomes`).
- django and sympy do not use pytest: upstream runs `./tests/runtests.py --verbosity 2
  --settings=test_sqlite --parallel 1 <modules>` (unittest's `test_x (module.Class) ... ok`
  lines) and `bin/test -C --verbose <files>` (sympy's `test_x ok` / `test_x F` lines), on the
  test files `test_patch` touches (`test_directives`), and reads the outcomes from the log
  (`parse_django_log`, `parse_sympy_log`). Their ids are the names those logs print.
- The verdict (`report`): resolved when every FAIL_TO_PASS and PASS_TO_PASS test passed
  (passed or xfailed). One deliberate difference: upstream counts a test it saw skipped as
  neither a success nor a failure (and an instance whose FAIL_TO_PASS tests were all skipped
  as resolved); here a skipped test is not a pass, since code under test can make tests skip.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from envs.swe.patching import patched_paths

__all__ = [
    "LOG_PARSERS",
    "combine_outcomes",
    "parse_django_log",
    "parse_sympy_log",
    "pytest_key",
    "report",
    "runner",
    "test_command",
    "test_directives",
]

# Repositories whose tests upstream runs with their own runner (all others: pytest).
_RUNNERS = {"django/django": "django", "sympy/sympy": "sympy"}
# Files of a test_patch that upstream does not pass to the runner (its NON_TEST_EXTS; "csv"
# has no dot there, so any name ending in csv is left out).
_NON_TEST_ENDINGS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                     ".yaml", ".toml")  # fmt: skip
_DJANGO = ("./tests/runtests.py", "--verbosity", "2", "--settings=test_sqlite", "--parallel", "1")
_DJANGO_SERIAL = ("./tests/runtests.py", "--verbosity", "2")  # Django 1.9.
# The environment upstream's eval_commands export for Django 1.7 to 3.2 (the locale its tests
# expect; for 3.x upstream also runs locale-gen, which the images need already done).
_DJANGO_ENV = {"LANG": "en_US.UTF-8", "LC_ALL": "en_US.UTF-8", "LANGUAGE": "en_US:en"}
# Versions upstream exports it for -> its PYTHONIOENCODING there ("": none).
_DJANGO_ENV_VERSIONS = {
    **dict.fromkeys(("1.7", "1.8", "1.9", "1.10", "1.11", "2.0", "2.1", "2.2"), "utf8"),
    **dict.fromkeys(("3.0", "3.1", "3.2"), ""),
}
_SYMPY = ("bin/test", "-C", "--verbose")
_SYMPY_ENV = {"PYTHONWARNINGS": "ignore::UserWarning,ignore::SyntaxWarning"}
# Repositories whose upstream parser rewrites parametrised ids (parse_log_pytest_options).
_PATH_OPTION_REPOS = frozenset({"pydicom/pydicom", "psf/requests", "pylint-dev/pylint"})
_OPTION_RE = re.compile(r"(.*?)\[(.*)\]")
# Where several node ids share a key, the status of the one upstream's log lists last.
_LAST_WINS = {"passed": 0, "skipped": 1, "xfailed": 2, "error": 3, "failed": 4}


def runner(repo: str) -> str:
    """ "pytest", "django" or "sympy": how upstream runs `repo`'s tests."""
    return _RUNNERS.get(repo, "pytest")


def pytest_key(nodeid: str, repo: str = "") -> str:
    """The id upstream's pytest log parser records for a node id (see the module docstring)."""
    words = nodeid.split()
    key = words[0] if words else nodeid
    if repo == "matplotlib/matplotlib":
        key = key.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3")
    elif repo in _PATH_OPTION_REPOS and (match := _OPTION_RE.search(key)):
        main, option = match.groups()
        if option.startswith("/") and not option.startswith("//") and "*" not in option:
            key = f"{main}[/{option.split('/')[-1]}]"
    return key


def combine_outcomes(outcomes: Iterable[str]) -> str | None:
    """The one status upstream would record for tests that share a key (None: none recorded).

    An xpassed test has no status word upstream recognises, so it is recorded only when it is
    alone (as "xpassed", which is not a pass).
    """
    best, seen_xpass = None, False
    for outcome in outcomes:
        if outcome not in _LAST_WINS:
            seen_xpass = seen_xpass or outcome == "xpassed"
            continue
        if best is None or _LAST_WINS[outcome] > _LAST_WINS[best]:
            best = outcome
    return best if best is not None else ("xpassed" if seen_xpass else None)


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What upstream passes to the test runner: the files `test_patch` touches (not data files).

    django's become module names (`tests/a/test_b.py` -> `a.test_b`), as runtests.py takes them.
    """
    files = [p for p in patched_paths(test_patch) if not p.endswith(_NON_TEST_ENDINGS)]
    if runner(repo) == "django":
        files = [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in files]
    return files


test_directives.__test__ = False  # Not a pytest test, despite the name.


def test_command(repo: str, version: str, test_patch: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of upstream's test run for a django or sympy instance.

    Raises:
        ValueError: For a repository that upstream runs with pytest (graded by the harness).
    """
    kind = runner(repo)
    directives = test_directives(repo, test_patch)
    if kind == "django":
        argv = _DJANGO_SERIAL if version == "1.9" else _DJANGO
        env = {}
        if version in _DJANGO_ENV_VERSIONS:
            env = dict(_DJANGO_ENV)
            if _DJANGO_ENV_VERSIONS[version]:
                env["PYTHONIOENCODING"] = _DJANGO_ENV_VERSIONS[version]
        return [*argv, *directives], env
    if kind == "sympy":
        return [*_SYMPY, *directives], dict(_SYMPY_ENV)
    raise ValueError(f"{repo} runs its tests with pytest; grade it with the harness.")


test_command.__test__ = False


def parse_django_log(log: str) -> dict[str, str]:
    """{test name: outcome} from django's runtests.py output at verbosity 2.

    Lines are `<name> ... ok` (also `OK`), `... skipped '<why>'`, `... FAIL`, `... ERROR`, and
    the `FAIL: <name>` / `ERROR: <name>` headers of the report (which upstream reads up to the
    first space). A test whose output came between its `...` and its `ok` passes on the `ok`
    line that follows.
    """
    statuses: dict[str, str] = {}
    last_name = None
    for raw in log.split("\n"):
        line = raw.strip()
        if "--version is equivalent to version" in line:  # A test whose output spans lines.
            statuses["--version is equivalent to version"] = "passed"
        if " ... " in line:
            last_name = line.split(" ... ")[0]
        for ending in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(ending):
                name = line[: -len(ending)]
                if name.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    name = name.split("...", 1)[1].strip()  # A migration message on its line.
                statuses[name] = "passed"
                break
        if " ... skipped" in line:
            statuses[line.split(" ... skipped")[0]] = "skipped"
        if line.endswith(" ... FAIL"):
            statuses[line[: -len(" ... FAIL")]] = "failed"
        if line.endswith(" ... ERROR"):
            statuses[line[: -len(" ... ERROR")]] = "error"
        for head, outcome in (("FAIL:", "failed"), ("ERROR:", "error")):
            if line.startswith(head) and len(line.split()) > 1:
                statuses[line.split()[1]] = outcome
        if line.startswith("ok") and last_name is not None:
            statuses[last_name] = "passed"
    # Output printed between a name and its `ok` by django itself, which the rule above misses
    # when it is not on lines of its own.
    interrupted = (
        r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
        r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
        r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
    )
    for pattern in interrupted:
        for match in re.finditer(pattern, log, re.MULTILINE):
            statuses[match.group(1)] = "passed"
    return statuses


_SYMPY_FAILURE_RE = re.compile(r"(_*) (.*)\.py:(.*) (_*)")
_SYMPY_MARKS = {"ok": "passed", "F": "failed", "E": "error"}


def parse_sympy_log(log: str) -> dict[str, str]:
    """{test name: outcome} from sympy's `bin/test --verbose` output.

    Each test is a line `test_name ok`, `test_name F` or `test_name E` (after a `path.py[N]`
    line per file); others (`f` expected failure, `s` skipped, `X`, `w`) are not recorded,
    as upstream records none of them. The `____ path.py:test_name ____` headers of the failure
    report mark `path.py:test_name` failed.
    """
    statuses: dict[str, str] = {}
    for match in _SYMPY_FAILURE_RE.findall(log):
        statuses[f"{match[1]}.py:{match[2]}"] = "failed"
    for raw in log.split("\n"):
        line = raw.strip()
        if not line.startswith("test_"):
            continue
        words = line.split()
        if len(words) > 1 and words[-1] in _SYMPY_MARKS:
            statuses[words[0]] = _SYMPY_MARKS[words[-1]]
    return statuses


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "django": parse_django_log,
    "sympy": parse_sympy_log,
}


def report(
    passed: Callable[[str], bool], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
) -> dict[str, Any]:
    """Upstream's report shape: each list's `success` and `failure` ids, and `resolved`.

    Args:
        passed: Whether an id counts as passed (e.g. `TestOutcomes.passed`).
        fail_to_pass, pass_to_pass: The instance's ids.
    """
    out: dict[str, Any] = {}
    for name, ids in (("FAIL_TO_PASS", fail_to_pass), ("PASS_TO_PASS", pass_to_pass)):
        success = [i for i in ids if passed(i)]
        out[name] = {"success": success, "failure": [i for i in ids if not passed(i)]}
    out["resolved"] = bool(fail_to_pass) and not (
        out["FAIL_TO_PASS"]["failure"] or out["PASS_TO_PASS"]["failure"]
    )
    return out


def statuses_to_records(statuses: Mapping[str, str]) -> list[dict[str, str]]:
    """Parsed log statuses as the report plugin's records (one call-phase record each)."""
    return [{"nodeid": n, "when": "call", "outcome": o} for n, o in statuses.items()]
