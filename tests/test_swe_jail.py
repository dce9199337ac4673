"""The jail's root-side file operations never follow a path that a jailed command could change.

The jail's process 1 runs as root outside the chroot, where `/etc` is the host's. A command owns
the tree (`/tmp/testbed`, in the jail's sticky /tmp), so it can rename the tree or any folder in
it and leave a symlink to `/`, `/etc` or `/proc/1/root` behind. These tests do that at the tree's
root and inside it, and check that no host file comes back (as a changed file, a report or a
`view`), that the overlay is never written through a symlink, and that the repository's own
symlinks still work. Needs root (the jails use namespaces), like tests/test_swe.py.
"""

import ast
import json
import os
import sys
from pathlib import Path

import pytest
from swe_fixtures import leap_task, write_minicalc

from envs.base import make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.swe import jail
from envs.swe.jail import Limits, run_in_jail

_LIMITS = Limits(timeout_s=10)
_SWAP = "mv /tmp/testbed /tmp/old && ln -s {target} /tmp/testbed"
# (command, path to view afterwards): links at the tree's root and inside it.
_LINKS = {
    "tree -> /etc": (_SWAP.format(target="/etc"), "passwd"),
    "tree -> /": (_SWAP.format(target="/"), "etc/passwd"),
    "tree -> /proc/1/root": (_SWAP.format(target="/proc/1/root"), "etc/passwd"),
    # The worker's own root, as the jail's process 1 sees it (a lucky guess of its host pid).
    "tree -> /proc/WORKER/root": (_SWAP.format(target="/proc/{pid}/root"), "etc/passwd"),
    "package -> /etc": ("rm -rf minicalc && ln -s /etc minicalc", "minicalc/passwd"),
    "deep link -> /": ("mkdir -p deep/er && ln -s / deep/er/host", "deep/er/host/etc/passwd"),
    "link -> /proc/1/root": ("ln -s /proc/1/root host", "host/etc/passwd"),
}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return leap_task(write_minicalc(tmp_path_factory.mktemp("jail") / "minicalc"))


@pytest.fixture(scope="module")
def env():
    env = make_env("swe", max_steps=50, command_timeout_s=10.0)
    yield env
    env.close()


@pytest.mark.parametrize("case", sorted(_LINKS))
def test_a_swapped_or_linked_path_shows_no_host_file(env, task, case):
    command, view = _LINKS[case]
    command = command.format(pid=os.getpid())
    host_passwd = Path("/etc/passwd").read_text()
    env.reset(options={"task": task})
    ran = step(env, f"run {command}")
    assert "[exit status 0]" in ran.observation, ran.observation
    assert "passwd" not in ran.observation and "shadow" not in ran.observation, ran.observation
    files = env.workspace.files
    assert not [p for p in files if p.rsplit("/", 1)[-1] in ("passwd", "shadow", "hostname")]
    assert all(content is None or content != host_passwd.encode() for content in files.values())
    shown = step(env, f"view {view} 1-3")
    assert shown.info["invalid_action"] and "does not exist" in shown.observation, shown.observation
    assert host_passwd.splitlines()[0] not in shown.observation
    if case.startswith("package"):
        # The folder's files are gone (deleted), the link itself is not kept.
        assert files["minicalc/calc.py"] is None
        assert "Not kept (too large or not regular files): minicalc" in ran.observation
    # The episode goes on normally on its own working copy.
    assert "is_leap" in step(env, "search def is_leap").observation or case.startswith("package")


def test_a_renamed_tree_is_still_read_where_it_went(tmp_path):
    (tmp_path / "a.txt").write_text("base\n")
    command = "mv /tmp/testbed /tmp/old && echo new > /tmp/old/b.txt && ln -s /etc /tmp/testbed"
    result = run_in_jail(str(tmp_path), {}, ["bash", "-c", command], limits=_LIMITS, capture=True)
    assert result.exit_code == 0, result.output
    assert result.changes == {"b.txt": b"new\n"} and result.ignored == []


@pytest.fixture
def host_folder(tmp_path):
    """A host folder, and a path to it for the jail's process 1 (whose /tmp is the tmpfs): through
    this process's root in /proc (its /proc is the host's)."""
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "victim.txt").write_text("host file\n")
    record = {"nodeid": "host-secret", "when": "call", "outcome": "passed"}
    (folder / "report.jsonl").write_text(json.dumps(record) + "\n")
    return folder, f"/proc/{os.getpid()}/root{folder}"


def test_the_overlay_is_never_written_through_a_symlink_of_the_base(tmp_path, host_folder):
    folder, seen_by_init = host_folder
    base = tmp_path / "base"
    base.mkdir()
    (base / "escape").symlink_to(seen_by_init)
    overlay = {"escape/evil.txt": b"written as root\n", "escape/victim.txt": None, "ok.txt": b"k"}
    result = run_in_jail(str(base), overlay, ["cat", "ok.txt"], limits=_LIMITS)
    assert result.output == "k" and result.exit_code == 0
    assert [r.split(":")[0] for r in result.refused] == ["escape/evil.txt"]
    assert not (folder / "evil.txt").exists()
    assert (folder / "victim.txt").read_text() == "host file\n"


@pytest.mark.parametrize(
    "command",
    [
        "mv /tmp/.report /tmp/moved && ln -s {host} /tmp/.report",
        "ln -s {host}/report.jsonl /tmp/.report/report.jsonl",
    ],
    ids=["report folder swapped", "report file linked"],
)
def test_the_report_is_not_read_through_a_link(tmp_path, host_folder, command):
    _, seen_by_init = host_folder
    argv = ["bash", "-c", command.format(host=seen_by_init)]
    result = run_in_jail(str(tmp_path), {}, argv, limits=_LIMITS, pytest_report=True)
    assert result.exit_code == 0, result.output
    assert result.report is None


def test_repository_symlinks_still_behave(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (tmp_path / "pkg" / "alias.py").symlink_to("mod.py")
    (tmp_path / "docs").symlink_to("pkg")
    command = (
        "cat pkg/alias.py docs/mod.py && python -c 'import pkg.alias as a; print(a.VALUE)' && "
        "echo 'MORE = 2' >> pkg/alias.py && ln -s mod.py pkg/new_link.py && mkfifo pipe"
    )
    result = run_in_jail(str(tmp_path), {}, ["bash", "-c", command], limits=_LIMITS, capture=True)
    assert result.output.split() == ["VALUE", "=", "1", "VALUE", "=", "1", "1"], result.output
    # The write through the link changed its target; new links and FIFOs are not brought back.
    assert result.changes == {"pkg/mod.py": b"VALUE = 1\nMORE = 2\n"}
    assert sorted(result.ignored) == ["pipe", "pkg/new_link.py"]
    assert (tmp_path / "pkg" / "mod.py").read_text() == "VALUE = 1\n"


def test_the_report_plugin_keeps_to_the_official_images_python(tmp_path):
    # harness.py is also the report plugin of the official images (Python 3.6 and later), and
    # in that role it writes each outcome to $BPO_SWE_REPORT.
    source = Path(jail.__file__).with_name("harness.py").read_text()
    ast.parse(source, feature_version=(3, 6))
    (tmp_path / "test_x.py").write_text(
        "def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 0\n"
    )
    argv = [sys.executable, "-m", "pytest", "-p", "bpo_swe_report", "-q", "test_x.py"]
    result = run_in_jail(str(tmp_path), {}, argv, limits=_LIMITS, pytest_report=True)
    assert [(r["nodeid"], r["outcome"]) for r in result.report if r["when"] == "call"] == [
        ("test_x.py::test_ok", "passed"), ("test_x.py::test_bad", "failed"),
    ], result.output  # fmt: skip
