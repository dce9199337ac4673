"""The task builder from a fresh clone (envs/swe/build.py, envs/swe/testenv.py).

Each package's tests run in its own test environment, which holds what the package's test
configuration needs (its pytest plugins, test extras, tox deps), installed from the registry;
a package that cannot be built is reported and skipped, and the others' tasks are written.
The slow test runs the builder the way a fresh clone does: from a new venv holding only the
project's runtime, on semver (its `.pytest.ini` loads pytest-cov), downloading from PyPI.
Needs root (the jails use namespaces), like tests/test_swe.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from swe_fixtures import minicalc_spec

from envs.base import make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.swe import build as build_module
from envs.swe.build import main
from envs.swe.data import load_tasks
from envs.swe.testenv import requirements

_REPO = Path(__file__).resolve().parents[1]


def _write(tree: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    return tree


def test_requirements_come_from_the_packages_own_test_configuration(tmp_path):
    tree = _write(tmp_path / "pkg", {
        "pyproject.toml": (
            '[project]\nname = "pkg"\ndependencies = ["attrs>=22"]\n'
            '[project.optional-dependencies]\ntest = ["hypothesis"]\ndocs = ["sphinx"]\n'
            '[dependency-groups]\ntesting = [{include-group = "base"}, "tox", "pytest<9"]\n'
            'base = ["pytest-mock"]\n'
            '[tool.pytest.ini_options]\naddopts = "--cov=pkg -n 2"\n'
            'required_plugins = ["pytest-env"]\n'
        ),
        "setup.cfg": "[options]\ninstall_requires =\n    six\n[options.extras_require]\ntests =\n"
                     "    freezegun\n",
        "tox.ini": "[testenv]\ndeps =\n    pytest\n    -r requirements-test.txt\n"
                   "[pytest]\ntimeout = 10\n",
        "requirements-test.txt": "responses==0.25  # pinned\n",
        "tests/conftest.py": 'pytest_plugins = ["pytest_asyncio.plugin", "tests.helpers"]\n',
        "setup.py": "from setuptools import setup\nsetup(name='pkg', tests_require=['mock'])\n",
    })  # fmt: skip
    assert requirements(tree, "pkg") == (
        "attrs>=22", "freezegun", "hypothesis", "mock", "pytest-asyncio", "pytest-cov",
        "pytest-env", "pytest-mock", "pytest-timeout", "pytest-xdist", "responses==0.25", "six",
    )  # fmt: skip
    # pytest itself is pinned by the builder, tox only runs tests, sphinx is not a test extra.
    assert requirements(_write(tmp_path / "bare", {"setup.py": "import x\n"}), "bare") == ()


def _spec(folder: Path, name: str, tests: str | None = None) -> dict:
    return dataclasses.asdict(minicalc_spec(folder, name, tests))


def test_a_package_that_cannot_be_built_is_skipped_and_the_others_kept(tmp_path, monkeypatch):
    good = _spec(tmp_path, "minicalc")
    failing = _spec(tmp_path, "broken", "def test_x():\n    assert False\n")
    missing = dict(_spec(tmp_path, "gone"), archive=str(tmp_path / "gone-0.1.tar.gz.missing"))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps([failing, good, missing]))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--spec", str(spec_file), "--per-package", "2", "--jobs", "2",
            "--max-candidates", "8"]  # fmt: skip
    assert main(argv) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["skipped"]) == ["broken", "gone"]
    assert "the pristine test suite passed only 2 tests" in manifest["skipped"]["broken"]
    assert "does not exist" in manifest["skipped"]["gone"]
    tasks = load_tasks(out, "all")
    assert len(tasks) == manifest["tasks"] == 2 and {t.task_type for t in tasks} == {"minicalc"}
    # The next run resumes: the built package's verdicts come from the cache.
    monkeypatch.setattr(build_module, "run_suite", lambda *a, **k: pytest.fail("not cached"))
    spec_file.write_text(json.dumps([good]))
    assert main(argv) == 0
    assert [t.task_id for t in load_tasks(out, "all")] == [t.task_id for t in tasks]


@pytest.mark.slow
def test_build_from_a_fresh_venv_installs_what_the_pytest_config_needs(tmp_path):
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True)
    python = str(fresh / "bin" / "python")
    runtime = subprocess.run([python, "-m", "pip", "install", "-q", "gymnasium>=1.0,<2"],
                             capture_output=True, text=True)  # fmt: skip
    assert runtime.returncode == 0, runtime.stderr
    # The builder's interpreter has neither pytest nor pytest-cov, which semver's options load.
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode == 1
    out = tmp_path / "tasks"
    done = subprocess.run(
        [python, "-m", "envs.swe.build", "--out", str(out), "--packages", "semver",
         "--per-package", "2", "--max-candidates", "10", "--jobs", "2"],
        cwd=_REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {} and manifest["packages"]["semver"]["tasks"] == 2, manifest
    assert any(
        r.startswith("pytest-cov") for r in manifest["packages"]["semver"]["test_requirements"]
    )
    assert "--cov=semver" in (out / "trees" / "semver-3.1.2" / ".pytest.ini").read_text()
    tasks = load_tasks(out, "all")
    assert all("pytest_cov" in t.pytest_args and t.python.startswith(str(out)) for t in tasks)
    env = make_env("swe", max_steps=10)
    for task in tasks:
        env.reset(options={"task": task})
        for action in task.walkthrough:
            result = step(env, action)
        assert result.reward == 1.0, (task.task_id, result.observation)
