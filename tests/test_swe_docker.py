"""The SWE-bench path through Docker for real (envs/swe/docker.py, envs/swe/images.py,
scripts/install_docker.sh).

The fixture tasks (the hand-made `minicalc` leap task, tasks the builder makes from `minicalc`,
and the SWE-bench-schema records of `swebench_fixtures`) get local images in SWE-bench's layout
and are played through containers: their gold patches must be graded resolved and their
unchanged trees not, with the same counts as the local jail. Commands must run with the limits
the executor documents, sandboxes must fork, and no container may be left. The reward-hack
battery runs through Docker in tests/test_swe_hacks.py.

Skipped without Docker unless $BPO_REQUIRE_DOCKER is set (CI sets it). The base image is built
once per machine (debootstrap: one to five minutes on 2 busy cores) and kept; the rest takes
about two minutes, so the module is marked slow.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from swe_docker_fixtures import containers, present, remove_images, require_docker
from swe_fixtures import GOLD_ACTION, leap_task, minicalc_spec, put, write_minicalc
from swebench_fixtures import patched_files, record_task

from envs.base import make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.sandbox import SandboxPool
from envs.swe import swebench
from envs.swe.build import build
from envs.swe.data import load_tasks as swe_load_tasks
from envs.swe.docker import DockerExecutor, DockerUnavailableError
from envs.swe.grading import grade_in_docker, graded_files
from envs.swe.images import SANDBOX_UID, ImageBuilder, default_requirements
from envs.swe.jail import Limits, run_in_jail
from envs.swe.patching import apply_patch, tree_hash
from envs.swe.workspace import Workspace

pytestmark = pytest.mark.slow
_REPO = Path(__file__).resolve().parents[1]
_BUILT: list[str] = []  # Instance images this module built (removed by the last test).
_BEFORE: dict[str, set[str]] = {}  # Every image (layers too) and container at the start.
_LIMITS = Limits(timeout_s=60.0)


@pytest.fixture(scope="module")
def builder():
    require_docker()
    _BEFORE.update(images=_all_images(), containers=set(containers(ours=False)))
    started = time.monotonic()
    builder = ImageBuilder(log=print)
    builder.env_image()  # The base (once per machine) and env layers.
    print(f"base and env images ready in {time.monotonic() - started:.1f} s")
    return builder


@pytest.fixture(scope="module")
def leap(builder, tmp_path_factory):
    task = leap_task(write_minicalc(tmp_path_factory.mktemp("leap") / "minicalc"))
    (task,) = builder.for_tasks([task])
    _BUILT.append(task.image)
    return task


def _all_images() -> set[str]:
    done = subprocess.run(["docker", "images", "-aq", "--no-trunc"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return set(done.stdout.split())


def _env(executor, **kwargs):
    return make_env("swe", max_steps=30, command_timeout_s=20.0, executor=executor, **kwargs)


# The install script and the images ----------------------------------------------------------


def test_install_script_is_idempotent_and_shellcheck_clean():
    require_docker()
    done = subprocess.run(["bash", "scripts/install_docker.sh"], cwd=_REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr
    if shutil.which("shellcheck") is None:
        assert os.environ.get("BPO_REQUIRE_SHELLCHECK") != "1", "shellcheck is not installed"
        pytest.skip("shellcheck is not installed")
    check = subprocess.run(["shellcheck", "scripts/install_docker.sh"], cwd=_REPO,
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout


def test_images_have_swebench_layout_and_are_cached(builder, leap, tmp_path):
    # A second build of the same tree is a lookup.
    started = time.monotonic()
    again = builder.instance_image(dataclasses.replace(leap, image=""))
    cached_s = time.monotonic() - started
    print(f"cached instance image: {cached_s:.2f} s")
    assert again == leap.image and cached_s < 10
    executor = DockerExecutor()
    labels = executor.labels(leap.image)
    script = (
        "cd /testbed && git rev-parse HEAD && git status --porcelain | wc -l && stat -c %u . && "
        "python -c 'import pytest, sys; print(pytest.__version__, sys.version_info >= (3, 11))' "
        "&& ls /sys/class/net"
    )
    done = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user",
                           str(SANDBOX_UID), leap.image, "bash", "-c", script],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    commit, dirty, owner, versions, *nets = done.stdout.split("\n")
    assert commit == labels["base_commit"] and dirty == "0", done.stdout + done.stderr
    assert owner == str(SANDBOX_UID) and labels["harness"] == "1"
    pytest_version = default_requirements()[0].split("==")[1]
    assert versions == f"{pytest_version} True"  # The jail's pytest, installed offline.
    assert [n for n in nets if n] == ["lo"]  # Nothing can be fetched at run time.
    # The copied-out /testbed is the task's tree (its .git left out).
    assert tree_hash(executor.prepare(leap)) == tree_hash(leap.tree)
    # Another tree is another image, on the same cached env; its commit is reproducible.
    other = write_minicalc(tmp_path / "minicalc")
    (other / "README").write_text("changed\n")
    started = time.monotonic()
    changed = builder.instance_image(dataclasses.replace(leap, tree=str(other), image=""))
    _BUILT.append(changed)
    print(f"new instance image on a cached env: {time.monotonic() - started:.2f} s")
    assert changed != leap.image
    assert DockerExecutor().labels(changed)["base_commit"] != labels["base_commit"]


# Commands and their limits ------------------------------------------------------------------


def test_commands_run_in_fresh_containers_with_the_documented_limits(leap):
    executor = DockerExecutor(memory_mb=256, pids=64)
    executor.prepare(leap)
    limits = Limits(timeout_s=5.0, file_mb=4, tmpfs_mb=64)

    def run(command, files=None):
        return executor.run(leap, files or {}, ["bash", "-c", command], limits=limits, env={},
                            capture=True)  # fmt: skip

    result = run("id -u; echo a > new.txt; rm README; mkdir -p d; echo b > d/x; "
                 "echo c >> minicalc/text.py", {"minicalc/calc.py": b"X = 1\n"})  # fmt: skip
    assert result.exit_code == 0 and result.output.split() == [str(SANDBOX_UID)], result
    text = (Path(leap.tree) / "minicalc/text.py").read_bytes() + b"c\n"
    assert result.changes == {"new.txt": b"a\n", "README": None, "d/x": b"b\n",
                              "minicalc/text.py": text}  # fmt: skip
    # The overlay was there, and nothing of the last container survives.
    result = run("cat minicalc/calc.py; ls new.txt README", {"minicalc/calc.py": b"X = 1\n"})
    assert "X = 1" in result.output and "'new.txt': No such file" in result.output
    assert "README" in result.output.split("\n")[-2] and result.changes == {}
    # A folder the overlay makes is the sandbox uid's, like the tree.
    result = run("echo y > pkg/more.txt", {"pkg/new.py": b"Y = 1\n"})
    assert result.exit_code == 0 and result.changes == {"pkg/more.txt": b"y\n"}, result
    result = run("python -c \"import socket; socket.create_connection(('10.1.2.3', 80), 2)\"")
    assert result.exit_code == 1 and "OSError" in result.output, result.output  # No network.
    started = time.monotonic()
    result = run("sleep 60")
    assert result.timed_out and result.exit_code is None, result
    assert time.monotonic() - started < 30
    result = run("head -c 8M /dev/zero > big")
    assert result.signal == "SIGXFSZ" or "File size limit exceeded" in result.output, result
    assert result.ignored == ["big"] and result.changes == {}  # Over capture_kb: not kept.
    result = run("python -c 'b = bytearray(600 << 20); print(len(b))'")  # Over 256 MiB.
    assert result.signal == "SIGKILL" and not result.timed_out, result  # The OOM killer.
    result = run("for i in $(seq 100); do sleep 3 & done; wait")
    assert "fork: retry" in result.output or "Resource temporarily" in result.output, result
    result = run("head -c 30000 /dev/zero | tr '\\0' x")
    assert result.output_bytes == 30000 and "bytes of output left out" in result.output
    assert containers() == []


# Verdicts against the jail ------------------------------------------------------------------


def _gold_actions(task) -> list[str]:
    if task.walkthrough:
        return [a for a in task.walkthrough if a != "submit"]
    return [put(rel, text) for rel, text in sorted(patched_files(task, task.patch).items())]


def _verdict(env, task, actions):
    env.reset(options={"task": task})
    for action in actions:
        result = step(env, action)
        assert not result.info["invalid_action"], result.observation
    result = step(env, "submit")
    return result.reward == 1.0, result.info["tests"]


class _JailExecutor:
    """`grade_in_docker`'s executor with a jail in place of a container (as in
    tests/test_swe_upstream.py): django-style repositories, which the jail's env does not run."""

    def run(self, task, files, argv, *, limits, env, capture=False, pytest_report=False):
        return run_in_jail(task.tree, files, argv, limits=limits, env=env,
                           pytest_report=pytest_report)  # fmt: skip


def _log_verdict(executor, task, patch):
    ws = Workspace(task.tree)
    if patch:
        ws.apply_changes({p: t.encode() for p, t in apply_patch(
            lambda rel: (Path(task.tree) / rel).read_text(), patch).items()})  # fmt: skip
    files, taken, _ = graded_files(task, ws)
    result, outcomes, problem = grade_in_docker(executor, task, files, _LIMITS, "python", (),
                                                taken)  # fmt: skip
    assert problem is None, result
    return swebench.report(outcomes.passed, task.fail_to_pass, task.pass_to_pass)["resolved"]


def test_fixture_tasks_get_the_same_verdicts_as_in_the_jail(builder, leap, tmp_path):
    started = time.monotonic()
    build(tmp_path / "built", [minicalc_spec(tmp_path)], per_package=3, jobs=2,
          max_candidates=16, log=lambda m: None)  # fmt: skip
    print(f"built the minicalc tasks in {time.monotonic() - started:.0f} s")
    tasks = [leap, *swe_load_tasks(tmp_path / "built", "all")]
    tasks += [record_task(tmp_path, name) for name in ("textvec", "miniwrap")]
    assert len(tasks) >= 5
    local = builder.for_tasks([dataclasses.replace(t, image="") for t in tasks])
    _BUILT.extend(t.image for t in local)
    jail, docker = _env("jail"), _env("docker")
    table = []
    for task, in_docker in zip(tasks, local, strict=True):
        gold = _gold_actions(task)
        for label, actions in (("gold", gold), ("unchanged", [])):
            started = time.monotonic()
            by_jail = _verdict(jail, task, actions)
            jail_s = time.monotonic() - started
            started = time.monotonic()
            by_docker = _verdict(docker, in_docker, actions)
            docker_s = time.monotonic() - started
            table.append((task.task_id, label, by_jail[0], by_docker[0], jail_s, docker_s))
            assert by_docker == by_jail, (task.task_id, label, by_jail, by_docker)
            assert by_jail[0] is (label == "gold"), (task.task_id, label, by_jail)
    # The django-style record: upstream's runner and log, in a container and in a jail.
    minidj = record_task(tmp_path, "minidj")
    (minidj_local,) = builder.for_tasks([dataclasses.replace(minidj, image="")])
    _BUILT.append(minidj_local.image)
    executor = DockerExecutor()
    executor.prepare(minidj_local)
    for label, patch in (("gold", minidj.patch), ("unchanged", "")):
        by_jail = _log_verdict(_JailExecutor(), minidj, patch)
        by_docker = _log_verdict(executor, minidj_local, patch)
        table.append((minidj.task_id, label, by_jail, by_docker, 0.0, 0.0))
        assert by_jail is by_docker is (label == "gold"), (label, by_jail, by_docker)
    assert _verdict(docker, minidj_local, _gold_actions(minidj))[0]
    assert not _verdict(docker, minidj_local, [])[0]
    for task_id, label, by_jail, by_docker, jail_s, docker_s in table:
        print(f"verdict {task_id:44s} {label:9s} jail={by_jail!s:5s} docker={by_docker!s:5s} "
              f"{jail_s:.1f} s / {docker_s:.1f} s")  # fmt: skip
    jail.close()
    docker.close()
    assert containers() == []


def _upstream_style(image: str) -> str:
    """A copy of a local image that runs as the official SWE-bench images run: as root, with the
    report plugin in the test process (its labels say: no uid to drop to, no harness)."""
    name = image.replace("/sweb.eval.", "/sweb.upstream-style.")
    if present([name]):
        return name
    cid = subprocess.run(["docker", "create", image], capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    try:
        subprocess.run(["docker", "commit", "--change",
                        'LABEL org.bpo.swe.harness="" org.bpo.swe.uid=""', cid, name],
                       capture_output=True, check=True)  # fmt: skip
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    _BUILT.append(name)
    return name


def test_the_official_images_way_grades_alike(builder, leap, tmp_path):
    # Root, the report plugin and upstream's id matching (pytest_key with the repository), as
    # for SWE-bench's own images; the verdicts are the jail's.
    textvec = record_task(tmp_path, "textvec")
    (local,) = builder.for_tasks([dataclasses.replace(textvec, image="")])
    _BUILT.append(local.image)
    jail, docker = _env("jail"), _env("docker")
    for task, image in ((leap, leap.image), (textvec, local.image)):
        upstream = dataclasses.replace(task, image=_upstream_style(image))
        assert not DockerExecutor().supports_harness(upstream)
        for label, actions in (("gold", _gold_actions(task)), ("unchanged", [])):
            by_jail, by_docker = _verdict(jail, task, actions), _verdict(docker, upstream, actions)
            assert by_docker == by_jail and by_jail[0] is (label == "gold"), (label, by_docker)
    env = _env("docker")
    env.reset(options={"task": dataclasses.replace(leap, image=_upstream_style(leap.image))})
    assert step(env, "run id -u").observation.split()[0] == "0"  # Root, as upstream.
    for closing in (jail, docker, env):
        closing.close()
    # An official image that is not here, with pulling off: a clear error, no pull.
    missing = dataclasses.replace(leap, image="swebench/sweb.eval.x86_64.none_1776_none-1:latest")
    with pytest.raises(DockerUnavailableError, match="is not present and pull=False"):
        DockerExecutor(pull=False).prepare(missing)
    assert containers() == []


# Latency and forks --------------------------------------------------------------------------


def test_step_and_test_latency_against_the_jail(leap):
    timings = {}
    for executor in ("jail", "docker"):
        env = _env(executor)
        env.reset(options={"task": leap})
        for name, action in (("run", "run true"), ("test", "test"), ("view", "view README")):
            started = time.monotonic()
            for _ in range(3):
                result = step(env, action)
                assert not result.info["invalid_action"], result.observation
            timings[executor, name] = (time.monotonic() - started) / 3
        step(env, GOLD_ACTION)
        started = time.monotonic()
        assert step(env, "submit").reward == 1.0
        timings[executor, "submit"] = time.monotonic() - started
        env.close()
    for (executor, name), seconds in sorted(timings.items()):
        print(f"latency {executor:6s} {name:6s} {seconds:.2f} s")
    # Loose bounds (the machine is shared); the README reports measured figures.
    assert timings["docker", "run"] < 15 and timings["docker", "submit"] < 30, timings
    assert containers() == []


def test_docker_backed_sandboxes_fork(leap):
    options = {"max_steps": 30, "executor": "docker", "command_timeout_s": 20.0}
    with SandboxPool("swe", options, backend="fork", num_workers=2) as pool:
        sid, _, _ = pool.reset(leap)
        pool.step(sid, "insert minicalc/text.py 0 # edited before the snapshot")
        handle = pool.snapshot(sid)
        started = time.monotonic()
        a, b = pool.fork(handle, 2)
        fork_s = (time.monotonic() - started) / 2
        ran = pool.step_many([(a, "run echo A > minicalc/a.txt"), (b, GOLD_ACTION)])
        assert all(not r.done for r in ran), [r.observation for r in ran]
        diff_a, diff_b = (r.observation for r in pool.step_many([(a, "diff"), (b, "diff")]))
        assert "+A" in diff_a and "400 == 0" not in diff_a, diff_a
        assert "a.txt" not in diff_b and "+    return year % 4 == 0" in diff_b, diff_b
        assert "+# edited before the snapshot" in diff_a and "+# edited before" in diff_b
        graded = pool.step_many([(a, "submit"), (b, "submit")])
        assert [r.reward for r in graded] == [0.0, 1.0], [r.observation for r in graded]
        pool.release(handle)
    print(f"fork of a Docker-backed sandbox: {fork_s * 1000:.1f} ms")
    assert fork_s < 2.0
    assert containers() == []


def test_no_container_is_left_and_the_instance_images_are_removed(builder):
    remove_images(_BUILT)
    assert present(_BUILT) == []
    assert containers() == [] and set(containers(ours=False)) == _BEFORE["containers"]
    # Only the cached base and env layers may be new (on a machine that had none).
    cache = {builder.image_id(builder.base_image()), builder.image_id(builder.env_image())}
    new = _all_images() - _BEFORE["images"] - cache
    assert new == set(), new
    print(f"containers left: {len(containers())}; images left besides the cache: {len(new)}")
