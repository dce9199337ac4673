"""Each package's test environment: a venv with what the package's own test configuration needs.

The task builder (`envs.swe.build`) runs a package's suite with the package's own pytest options,
as SWE-bench keeps a repository's options, so its environment must hold what those options and
its tests load: the pytest plugins its `addopts` name (`--cov` needs pytest-cov), its
`required_plugins`, the plugins its conftest files list, its test extras and dependency groups
(`test`, `tests`, `testing`), tox's `[testenv]` deps and its runtime dependencies. Those come
from the registry with pip, like the package itself; the package is not installed (its tree is
on PYTHONPATH, so the mutated copy is what the tests import), nor are tools that only run tests
(tox, nox), and pytest is pinned to the harness's version.

`requirements(tree)` reads them from the tree (`pyproject.toml`, `setup.cfg`, a literal
`install_requires` in `setup.py`, `tox.ini`, the pytest configuration files, requirement files
named for tests); `ensure(root, key, reqs)` makes the venv under `root/envs/` once per set of
requirements and returns its `TestEnv`: the interpreter, and the `-p` options that load its
entry-point plugins (the jail turns pytest's plugin autoloading off). A package that needs
nothing but pytest runs in the builder's own interpreter when that has pytest.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import tomllib

__all__ = ["TestEnv", "ensure", "harness_pytest", "requirements"]

_TEST_KEYS = ("test", "tests", "testing")
# Tools that run test suites, not something a test needs in its process.
_RUNNERS = frozenset({"pytest", "tox", "nox", "tox-gh-actions", "coverage-enable-subprocess"})
# Option prefixes of the pytest configuration -> the plugin that defines them.
_OPTION_PLUGINS = {
    "--cov": "pytest-cov", "--no-cov": "pytest-cov", "-n": "pytest-xdist",
    "--numprocesses": "pytest-xdist", "--dist": "pytest-xdist", "--timeout": "pytest-timeout",
    "--benchmark": "pytest-benchmark", "--doctest-plus": "pytest-doctestplus",
    "--doctest-rst": "pytest-doctestplus", "--mypy": "pytest-mypy",
    "--reruns": "pytest-rerunfailures",
    "--hypothesis": "hypothesis", "--asyncio-mode": "pytest-asyncio", "--mpl": "pytest-mpl",
    "--remote-data": "pytest-remotedata", "--randomly": "pytest-randomly", "--html": "pytest-html",
}  # fmt: skip
_INI_PLUGINS = {"asyncio_mode": "pytest-asyncio", "timeout": "pytest-timeout",
                "env": "pytest-env", "mock_use_standalone_module": "pytest-mock"}  # fmt: skip
_REQUIREMENT_FILES = (
    "requirements-test*.txt", "requirements_test*.txt", "test-requirements*.txt",
    "test_requirements*.txt", "requirements/test*.txt", "tests/requirements*.txt",
)  # fmt: skip
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclasses.dataclass(frozen=True)
class TestEnv:
    """A package's test environment.

    Attributes:
        python: Its interpreter.
        requirements: What was installed in it (besides pytest).
        plugin_args: pytest options that load its entry-point plugins (`-p NAME` each).
        folder: The venv ("" when the package needs nothing but pytest, and the builder's own
            interpreter, which has it, runs its tests).
    """

    python: str
    requirements: tuple[str, ...]
    plugin_args: tuple[str, ...]
    folder: str = ""


def harness_pytest() -> str:
    """The pytest requirement of every test env: this interpreter's pytest, else pytest 8 or
    later (the grading harness needs pytest's wrapper hooks)."""
    try:
        import pytest
    except ImportError:
        return "pytest>=8.1"
    return f"pytest=={pytest.__version__}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_lines(text: str, folder: Path, seen: set[Path]) -> list[str]:
    """Requirement specifiers of a requirements file (`-r` followed, options dropped)."""
    out = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            path = (folder / line.split(None, 1)[1].strip()).resolve()
            if path.is_file() and path not in seen:
                seen.add(path)
                out += _requirement_lines(path.read_text(), path.parent, seen)
        elif line and not line.startswith(("#", "-", "{")) and "://" not in line:
            out.append(line)
    return out


def _pyproject(tree: Path) -> tuple[list[str], list[str]]:
    """(requirements, pytest options) from pyproject.toml."""
    path = tree / "pyproject.toml"
    if not path.is_file():
        return [], []
    try:
        data = tomllib.loads(path.read_text(errors="replace"))
    except tomllib.TOMLDecodeError:
        return [], []
    project = data.get("project", {})
    reqs = list(project.get("dependencies", []))
    extras = project.get("optional-dependencies", {})
    groups = data.get("dependency-groups", {})

    def group(name: str, depth: int = 0) -> list[str]:
        out = []
        for item in groups.get(name, []) if depth < 10 else []:
            if isinstance(item, dict):
                out += group(item.get("include-group", ""), depth + 1)
            else:
                out.append(item)
        return out

    for key in _TEST_KEYS:
        reqs += extras.get(key, []) + group(key)
    options, plugins = _ini_options(data.get("tool", {}).get("pytest", {}).get("ini_options", {}))
    return reqs + plugins, options


def _ini_options(section) -> tuple[list[str], list[str]]:
    """(its addopts, the plugins it requires: `required_plugins`, plugin-only keys) of a pytest
    configuration section."""
    addopts = section.get("addopts", "")
    options = shlex.split(addopts) if isinstance(addopts, str) else list(addopts)
    required = section.get("required_plugins", "")
    plugins = required.split() if isinstance(required, str) else list(required)
    return options, plugins + [_INI_PLUGINS[k] for k in section if k in _INI_PLUGINS]


def _ini_files(tree: Path) -> tuple[list[str], list[str]]:
    """(requirements, pytest options) from setup.cfg, tox.ini and pytest.ini."""
    reqs, options = [], []
    for name, pytest_section in (("pytest.ini", "pytest"), (".pytest.ini", "pytest"),
                                 ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):  # fmt: skip
        path = tree / name
        if not path.is_file():
            continue
        parser = configparser.RawConfigParser(strict=False)
        try:
            parser.read_string(path.read_text(errors="replace"))
        except configparser.Error:
            continue
        if parser.has_section(pytest_section):
            more, plugins = _ini_options(dict(parser.items(pytest_section)))
            options += more
            reqs += plugins
        if name == "setup.cfg" and parser.has_section("options"):
            reqs += _requirement_lines(parser.get("options", "install_requires", fallback=""),
                                       tree, set())  # fmt: skip
        if name == "setup.cfg" and parser.has_section("options.extras_require"):
            for key in _TEST_KEYS:
                text = parser.get("options.extras_require", key, fallback="")
                reqs += _requirement_lines(text, tree, set())
        if name == "tox.ini" and parser.has_section("testenv"):
            reqs += _requirement_lines(parser.get("testenv", "deps", fallback=""), tree, set())
    return reqs, options


def _setup_py(tree: Path) -> list[str]:
    """Literal `install_requires` and test `extras_require` of a `setup(...)` call."""
    path = tree / "setup.py"
    if not path.is_file():
        return []
    try:
        module = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return []
    reqs = []
    for node in ast.walk(module):
        if not (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setup"
        ):
            continue
        for keyword in node.keywords:
            try:
                value = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError):
                continue
            if keyword.arg in ("install_requires", "tests_require"):
                reqs += [value] if isinstance(value, str) else list(value)
            elif keyword.arg == "extras_require" and isinstance(value, dict):
                for key in _TEST_KEYS:
                    reqs += list(value.get(key, []))
    return reqs


def _conftest_plugins(tree: Path) -> list[str]:
    """Distributions of the modules conftest files name in `pytest_plugins` (by convention
    `pytest_foo` is pytest-foo)."""
    out = []
    for path in tree.rglob("conftest.py"):
        try:
            module = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in module.body:
            targets = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
            if "pytest_plugins" in targets:
                try:
                    value = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError):
                    continue
                names = [value] if isinstance(value, str) else list(value)
                out += [n.split(".")[0].replace("_", "-") for n in names if n.startswith("pytest_")]
    return out


def requirements(tree: str | Path, name: str, pytest_args: Sequence[str] = ()) -> tuple[str, ...]:
    """What the package `name` at `tree` needs to run its tests, as pip requirements (sorted,
    one per distribution; pytest, test runners and the package itself left out)."""
    tree = Path(tree)
    reqs, options = _pyproject(tree)
    more, ini = _ini_files(tree)
    reqs += more + _setup_py(tree) + _conftest_plugins(tree)
    for pattern in _REQUIREMENT_FILES:
        for path in sorted(tree.glob(pattern)):
            reqs += _requirement_lines(path.read_text(errors="replace"), path.parent, {path})
    for option in [*options, *ini, *pytest_args]:
        flag = option.split("=", 1)[0]
        plugin = _OPTION_PLUGINS.get(flag) or next(
            (
                p
                for f, p in _OPTION_PLUGINS.items()
                if f.startswith("--") and flag.startswith(f + "-")
            ),
            None,
        )
        if plugin:
            reqs.append(plugin)
    chosen: dict[str, str] = {}
    for req in reqs:
        match = _NAME.match(req)
        if not match:
            continue
        key = _canonical(match.group(1))
        if key in _RUNNERS or key == _canonical(name):
            continue
        # Keep the first specifier of a distribution, unless a later one says more.
        if key not in chosen or len(req.strip()) > len(chosen[key]):
            chosen[key] = req.strip()
    return tuple(sorted(chosen.values(), key=str.lower))


def _entry_point_plugins(python: str) -> tuple[str, ...]:
    script = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted({e.name for e in m.entry_points(group='pytest11')})))"
    )
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"listing the pytest plugins of {python} failed: {done.stderr[-800:]}")
    return tuple(json.loads(done.stdout))


def ensure(
    root: str | Path,
    key: str,
    reqs: Iterable[str],
    offline: bool = False,
    log: Callable[[str], None] = lambda message: None,
) -> TestEnv:
    """The test env for `reqs` under `root/envs/` (made once: a venv, then pip from the registry).

    Args:
        root: The build folder.
        key: A readable prefix of the env's folder name (the package and version).
        reqs: What to install besides pytest (`requirements`).
        offline: Refuse to make a missing env (it needs the registry).
        log: Progress messages.

    Raises:
        RuntimeError: If the venv cannot be made or pip cannot install the requirements (the
            message has pip's output).
    """
    reqs = tuple(reqs)
    pin = harness_pytest()
    if not reqs and "==" in pin:
        return TestEnv(sys.executable, (), ())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    digest = hashlib.sha256(json.dumps([version, pin, *reqs]).encode()).hexdigest()[:10]
    folder = Path(root) / "envs" / f"{key}-{digest}"
    done_file = folder / "bpo-testenv.json"
    if not done_file.is_file() and offline:
        raise RuntimeError(
            f"no test environment {folder} yet, and offline builds do not install one (it "
            "needs the package registry): build once without --offline"
        )
    if not done_file.is_file():
        # Made at its final path (a venv's scripts name their folder); the record file is
        # written last, so a half-made env is made again.
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        log(f"{key}: test environment with {pin} {' '.join(reqs)}".rstrip())
        python = str(folder / "bin" / "python")
        try:
            subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True,
                           capture_output=True, timeout=600)  # fmt: skip
            pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                   pin, *reqs]  # fmt: skip
            installed = subprocess.run(pip, capture_output=True, text=True, timeout=1800)
            if installed.returncode != 0:
                raise RuntimeError(
                    f"pip install {pin} {' '.join(reqs)} failed (exit status "
                    f"{installed.returncode}): {(installed.stdout + installed.stderr)[-1500:]}"
                )
            plugins = _entry_point_plugins(python)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"making the test environment {folder} failed: {e}") from e
        done_file.write_text(json.dumps({"requirements": list(reqs), "pytest": pin,
                                         "plugins": list(plugins)}))  # fmt: skip
    record = json.loads(done_file.read_text())
    args = tuple(a for name in record["plugins"] for a in ("-p", name))
    return TestEnv(str(folder / "bin" / "python"), tuple(record["requirements"]), args,
                   str(folder))  # fmt: skip
