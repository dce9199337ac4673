"""launch_tpu.sh against a stand-in `gcloud` on PATH.

The stand-in (tests/fixtures/launch_tpu/gcloud.py) records every call's argv, one JSON line each,
and plays a TPU VM slice: `describe` / `create` / `delete` keep the slice's state in a file; `scp`
copies into each worker's home, and `ssh` runs the command with bash, locally, on every worker at
once, with HOME set to that worker's own folder under tmp_path. So `setup` really clones the
bundle and runs scripts/setup.sh and scripts/tpu_worker.sh there, and `run` really starts a
process whose liveness is checked. The only other stand-ins are on the workers' PATH: `python3`
(whose venv `python` sleeps like a training run when its --config file exists and fails like absl
when it does not; pip only records its arguments) and `curl` (the metadata server's worker number).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The files the launcher and the worker side use, copied into a small repository per test.
SHIPPED = [
    "launch_tpu.sh",
    "scripts/tpu_worker.sh",
    "scripts/setup.sh",
    "requirements.txt",
    "requirements-nodeps.txt",
    "requirements-dev.txt",
    "requirements-tpu-compile.txt",
    "pyproject.toml",
]
FAKES = Path(__file__).resolve().parent / "fixtures" / "launch_tpu"


def _install(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


class Slice:
    """A fake slice, its workers' homes, and the launcher of a small repository."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.repo = tmp / "repo"
        self.homes = tmp / "homes"
        self.state = tmp / "state"
        self.log = tmp / "gcloud_calls.jsonl"
        for d in (self.repo / "scripts", self.repo / "experiments", self.homes, self.state):
            d.mkdir(parents=True, exist_ok=True)
        for rel in SHIPPED:
            (self.repo / rel).write_bytes((REPO / rel).read_bytes())
        (self.repo / "experiments" / "alfworld.py").write_text("def get_config(arg=None): ...\n")
        bin_dir, worker_bin = tmp / "bin", tmp / "worker_bin"
        bin_dir.mkdir()
        worker_bin.mkdir()
        _install(
            bin_dir / "gcloud", f'#!/bin/sh\nexec "{sys.executable}" "{FAKES}/gcloud.py" "$@"\n'
        )
        _install(worker_bin / "python3", (FAKES / "python3.sh").read_text())
        _install(worker_bin / "curl", (FAKES / "curl.sh").read_text())
        self.env = dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            TMPDIR=str(tmp),
            FAKE_GCLOUD_LOG=str(self.log),
            FAKE_TPU_STATE=str(self.state),
            FAKE_TPU_HOMES=str(self.homes),
            FAKE_WORKER_BIN=str(worker_bin),
            GIT_AUTHOR_NAME="t",
            GIT_AUTHOR_EMAIL="t@example.com",
            GIT_COMMITTER_NAME="t",
            GIT_COMMITTER_EMAIL="t@example.com",
        )
        self.git("init", "-q")
        self.commit("initial")

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(self.repo), *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD")

    def make(self, accel: str = "v5p-64", workers: int = 2, state: str = "READY") -> None:
        (self.state / "bpo").write_text(
            json.dumps({"state": state, "type": accel, "workers": workers})
        )

    def launch(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(self.repo / "launch_tpu.sh"), *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def on(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        """The launcher with this slice's --name and --zone."""
        return self.launch("--name", "bpo", "--zone", "us-east5-a", *args, stdin=stdin)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def verbs(self) -> list[str]:
        return [c[3] for c in self.calls()]

    def runs(self, k: int) -> Path:
        return self.homes / f"host{k}" / "bpo_jax" / "runs"

    def stop_leftovers(self) -> None:
        """Ends the process groups this test's runs started and that still run."""
        for pidf in self.homes.glob("host*/bpo_jax/runs/*/host*.pid"):
            if not pidf.with_suffix(".exit").exists():
                try:
                    os.killpg(int(pidf.read_text()), 9)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def parse_only(tmp_path_factory):
    """One slice for the tests that only parse arguments (they must call no gcloud at all)."""
    return Slice(tmp_path_factory.mktemp("parse_only"))


@pytest.fixture
def tpu(tmp_path):
    s = Slice(tmp_path)
    yield s
    s.stop_leftovers()


def _train(config: str = "experiments/alfworld.py") -> list[str]:
    return ["--", f"--config={config}", "--workdir=gs://bucket/run 1"]


# ---- dry run ----------------------------------------------------------------------------------

DRY_RUNS = {
    "create": (["create", "--accelerator-type", "v5p-64", "--spot"], ["describe", "create"]),
    "setup": (["setup"], ["describe", "scp", "ssh"]),
    "run": (
        ["run", "--run-id", "r1", "--env", "ALFWORLD_DATA=/mnt/data/alf world", *_train()],
        ["describe", "ssh"],
    ),
    "logs": (["logs", "--worker", "all", "--lines", "5"], ["ssh"]),
    "status": (["status", "--run-id", "r1"], ["describe", "ssh"]),
    "stop": (["stop", "--run-id", "r1"], ["ssh"]),
    "delete": (["delete"], ["delete"]),
}


@pytest.mark.parametrize("command", sorted(DRY_RUNS))
def test_dry_run_prints_the_commands_it_would_run_and_runs_none(tpu, command):
    args, verbs = DRY_RUNS[command]
    if command != "create":
        tpu.make()
    dry = tpu.on("--project", "proj-1", "--dry-run", *args)
    assert dry.returncode == 0, dry.stderr
    assert tpu.calls() == [], "a dry run called gcloud"
    printed = [w for w in shlex.split(dry.stdout, comments=True) if w != "gcloud"]
    assert [w for w in shlex.split(dry.stdout, comments=True)].count("gcloud") == len(verbs)
    assert "proj-1" in dry.stdout and "--zone=us-east5-a" in printed
    # Pasted into a shell, the printed commands make exactly the calls the real command makes.
    pasted = subprocess.run(["bash"], input=dry.stdout, env=tpu.env, capture_output=True, text=True)
    pasted_calls = tpu.calls()
    assert [c[3] for c in pasted_calls] == verbs, pasted.stderr
    if command == "create":
        (tpu.state / "bpo").unlink()
    tpu.log.unlink()
    tpu.stop_leftovers()
    real = tpu.on("--project", "proj-1", *args, *(["--yes"] if command == "delete" else []))
    real_calls = tpu.calls()

    def same(calls):  # the bundle's local temporary path is the one word that may differ
        return [[re.sub(r"^/.*/(bpo_jax-[0-9a-f]+\.bundle)$", r"\1", w) for w in c] for c in calls]

    assert same(real_calls) == same(pasted_calls), real.stderr
    if command == "delete":
        assert real_calls[0][-1] == "--quiet"


def test_dry_run_of_run_quotes_flags_and_env_for_the_remote_shell(tpu):
    dry = tpu.on("--dry-run", "run", "--run-id", "r1", "--env", "K=a b'c", *_train())
    ssh = [w for w in shlex.split(dry.stdout, comments=True) if w.startswith("--command=")]
    remote = shlex.split(ssh[0].splitlines()[-1])
    assert remote[remote.index("--env") + 1] == "K=a b'c"
    assert remote[remote.index("--") + 1 :] == _train()[1:]


# ---- create and delete ------------------------------------------------------------------------


def test_create_makes_the_slice_then_reuses_it(tpu):
    first = tpu.on("create", "--accelerator-type", "v4-32", "--spot")
    assert first.returncode == 0, first.stderr
    create = tpu.calls()[1]
    assert create[3:5] == ["create", "bpo"]
    assert {"--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"} <= set(create)
    again = tpu.on("create", "--accelerator-type", "v4-32")
    assert again.returncode == 0, again.stderr
    assert tpu.verbs() == ["describe", "create", "describe"]
    assert "reusing slice 'bpo' (v4-32, READY, 2 workers)" in again.stderr


def test_create_refuses_a_slice_of_another_type_or_state(tpu):
    tpu.make(accel="v5p-64")
    other = tpu.on("create", "--accelerator-type", "v6e-64")
    assert other.returncode == 1
    assert "exists as v5p-64, not v6e-64" in other.stderr
    tpu.make(accel="v6e-64", state="PREEMPTED")
    preempted = tpu.on("create", "--accelerator-type", "v6e-64")
    assert preempted.returncode == 1 and "is PREEMPTED, not READY" in preempted.stderr
    assert tpu.verbs() == ["describe", "describe"]


def test_create_does_not_guess_when_describe_fails_otherwise(tpu):
    tpu.env["FAKE_DESCRIBE_ERROR"] = "1"
    out = tpu.on("create", "--accelerator-type", "v5litepod-64")
    assert out.returncode == 1
    assert "PERMISSION_DENIED" in out.stderr and "could not describe slice 'bpo'" in out.stderr
    assert tpu.verbs() == ["describe"]


def test_delete_asks_first(tpu):
    tpu.make()
    no = tpu.on("delete", stdin="n\n")
    assert no.returncode == 1 and "not deleted" in no.stderr
    assert tpu.calls() == []
    yes = tpu.on("delete", stdin="y\n")
    assert yes.returncode == 0, yes.stderr
    assert tpu.verbs() == ["delete"] and not (tpu.state / "bpo").exists()


# ---- argument errors --------------------------------------------------------------------------

NZ = ["--name", "bpo", "--zone", "z"]
ARG_ERRORS = [
    ([], "missing command (one of: create setup run logs status stop delete)"),
    ([*NZ, "launch"], "unknown command 'launch'"),
    (["bpo", "z", "--", "--config=c"], "the old form './launch_tpu.sh NAME ZONE -- FLAGS' is now"),
    (["--zone", "z", "status"], "missing --name"),
    (["--name", "bpo", "status"], "missing --zone"),
    (["--zone", "z", "status", "--name"], "--name needs a value"),
    (["--name", "Bad_Name", "--zone", "z", "status"], "--name 'Bad_Name' is not a valid TPU name"),
    ([*NZ, "status", "--bogus"], "unknown option '--bogus' for status"),
    ([*NZ, "status", "extra"], "unexpected argument 'extra' after command 'status'"),
    ([*NZ, "--dry-run=yes", "status"], "--dry-run takes no value"),
    (
        [*NZ, "run", "--config=experiments/alfworld.py"],
        "'--config=experiments/alfworld.py' looks like a training flag: "
        "put training flags after '--'",
    ),
    ([*NZ, "run", "--workdir", "/w"], "'--workdir' looks like a training flag"),
    ([*NZ, "run"], "run needs training flags after '--'"),
    ([*NZ, "run", "--"], "run needs training flags after '--'"),
    ([*NZ, "run", "--env", "NOVALUE", "--", "--config=c"], "--env needs KEY=VALUE"),
    ([*NZ, "run", "--env", "1X=v", "--", "--config=c"], "got '1X=v'"),
    ([*NZ, "run", "--wait", "soon", "--", "--config=c"], "--wait must be a whole number"),
    ([*NZ, "run", "--run-id", "a/b", "--", "--config=c"], "--run-id 'a/b' must be"),
    ([*NZ, "run", "--spot", "--", "--config=c"], "--spot is an option of 'create', not of 'run'"),
    ([*NZ, "status", "--", "--config=c"], "training flags after '--' are only for 'run'"),
    ([*NZ, "create"], "create needs --accelerator-type (e.g. v5p-64"),
    ([*NZ, "create", "--accelerator-type", "v5p"], "'v5p' is not a TPU type as gcloud names it"),
    ([*NZ, "create", "--accelerator-type", "v9x-8"], "no default runtime for 'v9x-8'"),
    (
        [*NZ, "create", "--accelerator-type", "v5p-8", "--spot", "--preemptible"],
        "choose one of --spot and --preemptible",
    ),
    ([*NZ, "logs", "--worker", "first"], "--worker must be a number or 'all'"),
    ([*NZ, "logs", "--lines", "0"], "--lines must be a positive number"),
    ([*NZ, "stop", "--yes"], "--yes is an option of 'delete', not of 'stop'"),
]


@pytest.mark.parametrize("args,message", ARG_ERRORS, ids=[m[:40] for _, m in ARG_ERRORS])
def test_argument_errors_name_the_problem_and_exit_2(parse_only, args, message):
    parse_only.log.unlink(missing_ok=True)
    out = parse_only.launch(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert out.stderr.startswith("launch_tpu.sh: error: ")
    assert parse_only.calls() == []


def test_help_prints_the_usage(parse_only):
    out = parse_only.launch("--help")
    assert out.returncode == 0
    assert "Usage: ./launch_tpu.sh --name NAME --zone ZONE" in out.stdout
    assert "set -euo" not in out.stdout


# ---- setup, run, logs, status, stop on the fake slice ---------------------------------------


def _read(path: Path) -> str:
    return path.read_text()


def test_setup_run_status_logs_stop_and_a_second_release_keeps_the_first_run(tpu):
    tpu.make(workers=2)
    sha1 = tpu.git("rev-parse", "HEAD")
    setup = tpu.on("setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert f"release {sha1[:12]} ready on all 2 hosts" in setup.stdout
    jax_line = next(
        x for x in _read(tpu.repo / "requirements.txt").splitlines() if x.startswith("jax")
    )
    for k in (0, 1):
        rel = tpu.homes / f"host{k}" / "bpo_jax" / "releases" / sha1
        assert (rel / "experiments" / "alfworld.py").exists()
        assert (tpu.homes / f"host{k}" / "bpo_jax" / "current").resolve() == rel
        pins = re.findall(r"jax\[tpu\]==([0-9.]+)", _read(tpu.homes / f"host{k}" / "pip.log"))
        assert pins and pins[0] in jax_line
        assert not list((tpu.homes / f"host{k}").glob("*.bundle")), "bundle left behind"

    env = ["--env", "ALFWORLD_DATA=/mnt/data/alf world", "--env", "WEBSHOP_DATA=/mnt/ws"]
    run = tpu.on("run", "--run-id", "r1", "--wait", "1", *env, *_train())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "host0: running" in run.stdout and "host1: running" in run.stdout
    assert "run r1: all 2 hosts running" in run.stdout
    logs = [tpu.runs(k) / "r1" / f"host{k}.log" for k in (0, 1)]
    for k, log in enumerate(logs):
        text = _read(log)
        assert "--multihost --config=experiments/alfworld.py --workdir=gs://bucket/run 1" in text
        assert "ALFWORLD_DATA=/mnt/data/alf world" in text
        assert f"cwd {tpu.homes / f'host{k}' / 'bpo_jax' / 'releases' / sha1}" in text
        assert _read(tpu.runs(k) / "r1" / "release").strip() == sha1
    assert (tpu.on("status", "--run-id", "r1")).returncode == 0
    tail = tpu.on("logs", "--worker", "all")  # the last run by default
    assert tail.returncode == 0, tail.stderr
    assert "host0| bpo_jax.main" in tail.stdout and "host1| bpo_jax.main" in tail.stdout
    only1 = tpu.on("logs", "--worker", "1", "--run-id", "r1")
    assert "host1|" in only1.stdout and "host0|" not in only1.stdout

    before = [_read(log) for log in logs]
    reuse = tpu.on("run", "--run-id", "r1", "--wait", "0", *_train())
    assert reuse.returncode == 1
    assert "run r1 already exists on this worker" in reuse.stdout
    assert [_read(log) for log in logs] == before, "a relaunch overwrote a log"

    busy = tpu.on("run", "--run-id", "r2", "--wait", "0", *_train())
    assert busy.returncode == 1
    assert "host0: failed: run r1 is still running here (pid" in busy.stdout
    assert not (tpu.runs(0) / "r2").exists()

    stop = tpu.on("stop", "--run-id", "r1")
    assert stop.returncode == 0, stop.stderr
    assert "host0: stopped (pid" in stop.stdout and "host1: stopped (pid" in stop.stdout
    status = tpu.on("status", "--run-id", "r1")
    assert status.returncode == 1
    assert "host0: stopped (by stop at" in status.stdout
    assert "status of run r1: 0 of 2 hosts running" in status.stderr

    (tpu.repo / "NOTES.md").write_text("second commit\n")
    sha2 = tpu.commit("second")
    assert tpu.on("setup").returncode == 0
    for k in (0, 1):
        releases = tpu.homes / f"host{k}" / "bpo_jax" / "releases"
        assert sorted(p.name for p in releases.iterdir()) == sorted([sha1, sha2])
        assert (releases / sha2 / "NOTES.md").exists()
    assert [_read(log) for log in logs] == before, "a second setup touched the first run's log"
    run2 = tpu.on("run", "--wait", "1", *_train())
    assert run2.returncode == 0, run2.stdout + run2.stderr
    run_ids = sorted(p.name for p in tpu.runs(0).iterdir() if p.is_dir())
    assert len(run_ids) == 2 and "r1" in run_ids
    new = next(r for r in run_ids if r != "r1")
    assert f"-{sha2[:7]}-" in new and _read(tpu.runs(1) / new / "release").strip() == sha2


def test_setup_reports_hosts_that_failed(tpu):
    tpu.make(workers=2)
    tpu.env["FAKE_PIP_FAIL"] = "jax[tpu]"
    setup = tpu.on("setup")
    assert setup.returncode == 1
    assert "host1| ERROR: No matching distribution found for jax[tpu]" in setup.stdout
    assert "host0: failed: pip install jax[tpu]==" in setup.stdout
    assert "setup: 0 of 2 hosts ready" in setup.stderr
    assert not (tpu.homes / "host0" / "bpo_jax" / "current").exists()
    assert not list(tpu.tmp.glob("tmp*/bpo_jax-*.bundle")), "the local bundle was left behind"


def test_run_reports_a_host_that_died_and_exits_nonzero(tpu):
    tpu.make(workers=2)
    assert tpu.on("setup").returncode == 0
    sha = tpu.git("rev-parse", "HEAD")
    # Worker 1's checkout lost its config: its trainer exits at flag parsing, worker 0's runs.
    (tpu.homes / "host1" / "bpo_jax" / "releases" / sha / "experiments" / "alfworld.py").unlink()
    run = tpu.on("run", "--run-id", "half", "--wait", "2", *_train())
    assert run.returncode == 1
    assert "host0: running" in run.stdout
    assert "host1: died (exit 1, run half" in run.stdout
    assert "host1| FATAL Flags parsing error" in run.stdout  # the log's last lines
    assert "run half: 1 of 2 hosts running" in run.stderr
    assert "stop --run-id half" in run.stderr
    status = tpu.on("status")
    assert status.returncode == 1 and "host1: died (exit 1" in status.stdout

    stop = tpu.on("stop")  # the last run: worker 0 stops it, worker 1 says its host died
    assert "host0: stopped (pid" in stop.stdout and "host1: died (exit 1" in stop.stdout

    everywhere = tpu.on("run", "--run-id", "typo", "--wait", "2", *_train("experiments/typo.py"))
    assert everywhere.returncode == 1
    assert "host0: died (exit 1" in everywhere.stdout and "host1: died (exit 1" in everywhere.stdout
    assert "0 of 2 hosts running" in everywhere.stderr


def test_run_needs_the_slice_and_the_release(tpu):
    missing = tpu.on("run", *_train())
    assert missing.returncode == 1
    assert "slice 'bpo' not found in us-east5-a: create it with" in missing.stderr
    assert tpu.verbs() == ["describe"]
    tpu.make(workers=2)
    not_setup = tpu.on("run", "--wait", "0", *_train())
    assert not_setup.returncode == 1
    assert "is not set up here (run: ./launch_tpu.sh setup)" in not_setup.stdout
    assert "0 of 2 hosts running" in not_setup.stderr
    status = tpu.on("status")
    assert status.returncode == 1
    assert "failed: nothing is set up here (run: ./launch_tpu.sh setup)" in status.stdout


def test_shellcheck_is_clean():
    shellcheck = subprocess.run(["which", "shellcheck"], capture_output=True, text=True).stdout
    if not shellcheck.strip():
        # CI sets BPO_REQUIRE_SHELLCHECK=1 (and installs it), so there this cannot skip.
        assert os.environ.get("BPO_REQUIRE_SHELLCHECK") != "1", "shellcheck is not installed"
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    out = subprocess.run(
        ["shellcheck", "launch_tpu.sh", "scripts/tpu_worker.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout
