"""Tests for the repository-repair environment (envs/swe): builder, jail, tools, snapshots.

The builder and the env run here on `minicalc`, a tiny package written by this file (a test
fixture, not a PyPI package) and packed as a source archive, so these tests need no network.
They need root (the jails use namespaces); the CRIU test also needs a working `criu` and is
skipped without one unless $BPO_REQUIRE_CRIU is set. Building the real PyPI tasks is the slow
test at the end (it downloads with pip).
"""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from swe_fixtures import CALC as _CALC
from swe_fixtures import minicalc_spec

from envs.base import load_tasks, make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.sandbox import SandboxPool, make_backend, procutil
from envs.sandbox.testing import criu_unavailable_reason, leftover_processes
from envs.swe import build as build_module
from envs.swe import tools
from envs.swe.build import BuildError, build
from envs.swe.data import SweTask, load_swebench
from envs.swe.data import load_tasks as swe_load_tasks
from envs.swe.instances import fix_action
from envs.swe.jail import Limits, run_in_jail
from envs.swe.mutate import KINDS, find_mutants
from envs.swe.patching import PatchError, apply_patch, make_patch, tree_hash


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Builds up to 8 tasks from the fixture package once; returns (folder, manifest, spec)."""
    folder = tmp_path_factory.mktemp("swe")
    spec = minicalc_spec(folder)
    manifest = build(folder / "tasks", [spec], per_package=8, jobs=2, max_candidates=40,
                     log=lambda m: None)  # fmt: skip
    return folder / "tasks", manifest, spec


@pytest.fixture(scope="module")
def tasks(built):
    return swe_load_tasks(built[0], "all")


@pytest.fixture
def env():
    env = make_env("swe", max_steps=20, invalid_action_penalty=0.1, command_timeout_s=10.0)
    yield env
    env.close()


def _calc_task(tasks):
    """A task whose bug is in calc.py (so text.py and the tests are pristine)."""
    return next(t for t in tasks if "a/minicalc/calc.py" in t.patch)


# Pieces --------------------------------------------------------------------------------------


def test_tool_grammar():
    call = tools.parse_action("replace minicalc/calc.py:12 x <= y => x < y")
    assert (call.tool, call.path, call.start, call.text, call.new) == (
        "replace", "minicalc/calc.py", 12, "x <= y", "x < y",
    )  # fmt: skip
    view = tools.parse_action("view a.py 3-9")
    assert (view.path, view.start, view.end) == ("a.py", 3, 9)
    view = tools.parse_action("view a.py:3")
    assert (view.path, view.start, view.end) == ("a.py", 3, 3)
    edit = tools.parse_action(r"edit a.py 2-3 if x:\n    return 1")
    assert tools.unescape(edit.text) == "if x:\n    return 1"
    assert tools.parse_action("test tests/test_a.py::test_b -x").args == (
        "tests/test_a.py::test_b", "-x",
    )  # fmt: skip
    assert tools.parse_action("replace a.py:1 drop me =>").new == ""
    for bad, message in [
        (None, "Empty action"),
        ("   ", "Empty action"),
        ("frobnicate the bug", "Unknown tool 'frobnicate'"),
        ("view", "needs a path"),
        ("replace a.py x => y", "needs line numbers"),
        ("replace a.py:3 no arrow here", "OLD => NEW"),
        ("replace a.py:3-4 a => b", "one line"),
        ("edit a.py text", "needs line numbers"),
        ("insert a.py here text", "needs a path and a line number"),
        ("run", "needs an argument"),
        ("view a.py 1-2 extra", "Unexpected text"),
    ]:
        with pytest.raises(tools.ToolSyntaxError, match=message):
            tools.parse_action(bad)
    assert tools.replace_in_line("    if  a <= b:\n", "a <= b", "a < b") == "    if  a < b:\n"
    assert tools.replace_in_line("x = 1\n", "y", "z") is None


def test_patches_roundtrip_and_fail_clearly(tmp_path):
    old = "a\nb\nc\nd\ne\nf\ng\n"
    new = "a\nB\nc\nd\ne\nf\nG\nh\n"
    patch = make_patch({"m.py": (old, new), "n.py": (None, "x\n"), "gone.py": ("y\n", None)})
    files = {"m.py": old, "gone.py": "y\n"}
    assert apply_patch(files.get, patch) == {"m.py": new, "n.py": "x\n", "gone.py": None}
    # Reversing the roles undoes it.
    back = make_patch({"m.py": (new, old)})
    assert apply_patch({"m.py": new}.get, back)["m.py"] == old
    with pytest.raises(PatchError, match="hunk 1 of m.py"):
        apply_patch({"m.py": "something else\n", "gone.py": "y\n"}.get, patch)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "f").write_text("1")
    first = tree_hash(str(tmp_path / "t"))
    (tmp_path / "t" / "f").write_text("2")
    assert tree_hash(str(tmp_path / "t")) != first


def test_mutants_cover_every_kind_and_stay_on_one_line():
    mutants = find_mutants("minicalc/calc.py", _CALC)
    assert {m.kind for m in mutants} == set(KINDS)
    for mutant in mutants:
        mutated = mutant.apply(_CALC)
        changed = [
            (a, b) for a, b in zip(_CALC.splitlines(), mutated.splitlines()) if a != b
        ]  # fmt: skip
        assert len(changed) == 1 and len(mutated.splitlines()) == len(_CALC.splitlines())
        compile(mutated, "calc.py", "exec")
    # Docstrings and code outside functions are never touched.
    assert all(m.line > 2 for m in mutants)
    texts = {(m.original, m.replacement) for m in mutants}
    assert ("<", "<=") in texts and ("and", "or") in texts and ("+", "-") in texts
    assert len({m.mutant_id for m in mutants}) == len(mutants)


def test_fix_action_is_the_shortest_unambiguous_replace():
    assert fix_action("m.py", 4, "    if x <= lo:\n", "    if x < lo:\n") == (
        "replace m.py:4 <= => <"
    )
    # The changed '+' is the second one: the span grows until it is the first match.
    assert fix_action("m.py", 2, "    return a + b + c\n", "    return a + b - c\n") == (
        "replace m.py:2 b + => b -"
    )


# Builder and loader --------------------------------------------------------------------------


def test_build_writes_swebench_instances(built, tasks, monkeypatch):
    folder, manifest, spec = built
    assert manifest["tasks"] == len(tasks) >= 6, manifest
    instances = [json.loads(line) for line in (folder / "instances.jsonl").read_text().splitlines()]
    tree = folder / "trees" / "minicalc-0.1"
    for instance in instances:
        for key in ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS",
                    "PASS_TO_PASS", "test_patch", "patch"):  # fmt: skip
            assert key in instance
        assert instance["base_commit"] == tree_hash(str(tree))
        f2p, p2p = instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"]
        assert f2p and not set(f2p) & set(p2p)
        files = {n.split("::")[0] for n in f2p}
        assert all(n.split("::")[0] in files for n in p2p)
        # The statement names failing tests but never the fix.
        statement = instance["problem_statement"]
        assert f2p[0] in statement
        mutation = instance["mutation"]
        fixed_line = mutation["original"]
        assert f"{mutation['replacement']} => {fixed_line}" not in statement
        # The bug patch and the gold patch are each other's reverse.
        source = (tree / mutation["path"]).read_text()
        read = {mutation["path"]: source}.get
        buggy = apply_patch(read, instance["bug_patch"])[mutation["path"]]
        assert buggy != source
        assert apply_patch({mutation["path"]: buggy}.get, instance["patch"])[mutation["path"]] == (
            source
        )
    assert len({i["instance_id"] for i in instances}) == len(instances)

    # A second build reuses every verdict: no test suite runs, and the instances are the same.
    def no_test_runs(*args, **kwargs):
        raise AssertionError("the second build ran a test suite instead of reading its cache")

    monkeypatch.setattr(build_module, "run_suite", no_test_runs)
    again = build(folder, [spec], per_package=8, jobs=2, max_candidates=40, log=lambda m: None)
    assert again["tasks"] == manifest["tasks"]
    assert (folder / "instances.jsonl").read_text().splitlines() == [
        json.dumps(i) for i in instances
    ]


def test_loader_splits_filters_and_explains_missing_data(built, tmp_path, monkeypatch):
    folder = built[0]
    every = load_tasks("swe", str(folder), "all")
    train = load_tasks("swe", str(folder), "train")
    test = load_tasks("swe", str(folder), "test")
    assert sorted(t.task_id for t in train + test) == sorted(t.task_id for t in every)
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    monkeypatch.setenv("SWE_TASKS_DIR", str(folder))
    assert [t.task_id for t in load_tasks("swe", None, "all", ("minicalc",))] == [
        t.task_id for t in every
    ]
    assert len(swe_load_tasks(None, "all", limit=2, seed=3)) == 2
    with pytest.raises(ValueError, match="Unknown SWE task type"):
        swe_load_tasks(None, "all", ("numpy",))
    with pytest.raises(ValueError, match="Unknown SWE split"):
        swe_load_tasks(None, "valid")
    monkeypatch.setenv("SWE_TASKS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"python -m envs\.swe\.build --out DIR"):
        load_tasks("swe", None, "train")


def test_build_fails_clearly_on_a_bad_archive(tmp_path):
    spec = dataclasses.replace(minicalc_spec(tmp_path), archive=str(tmp_path / "missing.tar.gz"))
    assert (
        "does not exist"
        in build(tmp_path / "out", [spec], log=lambda m: None)["skipped"]["minicalc"]
    )
    pinned = dataclasses.replace(minicalc_spec(tmp_path), sha256="0" * 64)
    with pytest.raises(BuildError, match="not the pinned"):
        build_module.fetch(pinned, tmp_path / "archives")


# Environment ---------------------------------------------------------------------------------


def test_every_walkthrough_resolves_its_task_and_doing_nothing_does_not(tasks, env):
    for task in tasks:
        observation, info = env.reset(options={"task": task})
        assert task.fail_to_pass[0] in observation and info["goal"].startswith("fix minicalc")
        for action in task.walkthrough:
            result = step(env, action)
            assert not result.info["invalid_action"], (action, result.observation)
        assert result.done and result.reward == 1.0 and result.info["won"], result.observation
        assert result.info["tests"]["fail_to_pass_passed"] == len(task.fail_to_pass)
    env.reset(options={"task": tasks[0]})
    result = step(env, "submit")
    assert result.done and result.reward == 0.0 and not result.info["won"]
    assert "Not resolved" in result.observation
    assert result.info["tests"]["fail_to_pass_passed"] < len(tasks[0].fail_to_pass)


def test_gymnasium_env_checker_passes(tasks):
    """check_env on bpo_jax/RepoRepair-v0: reset() without a task draws one of `tasks` with the
    env's seeded generator; a sampled action (random printable text) is an invalid tool call."""
    import warnings

    import gymnasium
    from gymnasium.utils.env_checker import check_env

    env = gymnasium.make("bpo_jax/RepoRepair-v0", max_steps=5, tasks=tasks).unwrapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    assert [str(w.message) for w in caught if "WARN" in str(w.message)] == []
    _, first = env.reset(seed=11)
    _, again = env.reset(seed=11)
    assert first["task_id"] == again["task_id"] and first["task_id"] in {t.task_id for t in tasks}
    *_, info = env.step(env.action_space.sample())
    assert info["invalid_action"] and info["tool"] is None


def test_file_tools(tasks, env):
    env.reset(options={"task": _calc_task(tasks)})
    view = step(env, "view minicalc/calc.py 4-6")
    assert view.observation.splitlines()[0] == "minicalc/calc.py (lines 4-6 of 34)"
    assert "    4 def clamp(x, lo, hi):" in view.observation
    assert "minicalc/calc.py" in step(env, "find calc").observation
    hits = step(env, "search def mean minicalc").observation
    assert "minicalc/calc.py:12: def mean(xs):" in hits
    assert step(env, "ls tests").observation == "tests/:\ntest_calc.py\ntest_text.py"
    edited = step(env, r"edit minicalc/text.py 9-10 def shout(s, times=1):\n    return s.upper()")
    assert not edited.info["invalid_action"], edited.observation
    assert "   10     return s.upper()" in edited.observation
    inserted = step(env, "insert minicalc/text.py 0 import os")
    assert "    1 import os" in inserted.observation
    diff = step(env, "diff").observation
    assert "+import os" in diff and '-    return (s.upper() + "!") * times' in diff
    tested = step(env, "test tests/test_text.py")
    assert "FAILED tests/test_text.py::test_shout" in tested.observation
    assert step(env, "help").observation.startswith("view PATH")


def test_bad_input_is_refused_clearly(tasks, env):
    env.reset(options={"task": tasks[0]})
    for action, message in [
        (None, "Invalid action: Empty action"),
        ("please fix it", "Unknown tool 'please'"),
        ("view /etc/passwd", "outside the working copy"),
        ("view ../../../etc/passwd", "outside the working copy"),
        ("view minicalc/../../x", "outside the working copy"),
        ("replace /etc/hosts:1 a => b", "outside the working copy"),
        ("search root /etc", "No line contains 'root /etc'"),
        ("test /etc/x.py", "outside the working copy"),
        ("view nothing.py", "does not exist"),
        ("view minicalc/calc.py 500", "outside minicalc/calc.py, which has 34 lines"),
        ("replace minicalc/calc.py:4 banana => apple", "not on line 4"),
        ("edit minicalc/calc.py 9-3 x", "outside|empty"),
    ]:
        result = step(env, action)
        assert message.split("|")[0] in result.observation or (
            "|" in message and message.split("|")[1] in result.observation
        ), (action, result.observation)
        is_invalid = not message.startswith("No line")
        assert result.info["invalid_action"] is is_invalid and not result.done
        assert result.reward == (-0.1 if is_invalid else 0.0)
    # The jail's own path works as an absolute path.
    assert not step(env, "view /tmp/testbed/minicalc/text.py").info["invalid_action"]


def _jail_processes() -> list[int]:
    """Our descendants that run as a jail uid (there must be none between commands).

    A jail's processes cannot leave our process tree: orphans re-parent to the jail's process 1,
    and when that exits the kernel kills the rest of its PID namespace.
    """
    found = []
    for pid in procutil.descendant_pids(os.getpid()):
        try:
            if os.stat(f"/proc/{pid}").st_uid >= 1 << 30:
                found.append(pid)
        except OSError:
            continue
    return found


def test_hostile_commands_are_contained(tasks):
    env = make_env("swe", max_steps=50, command_timeout_s=4.0, memory_mb=512)
    env.reset(options={"task": tasks[0]})
    before = set(procutil.descendant_pids(os.getpid()))
    marker = Path("/tmp/bpo-swe-escape-marker")
    marker.unlink(missing_ok=True)
    cases = [
        ("run :(){ :|:& };: ; sleep 30", "timed out after 4 s"),
        ("run python -c 'x = bytearray(8 << 30)'", "MemoryError"),
        (
            """run python -c 'exec("b = []\\nwhile True: b.append(bytearray(1 << 26))")'""",
            "MemoryError",
        ),
        (
            "run python -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 3)'",
            "Network is unreachable",
        ),
        ("run yes 'a fairly long line of output'", "file-size limit"),
        ("run sleep 600", "timed out after 4 s"),
        ("run sleep 600 & echo started", "started"),
        (f"run touch {marker}; touch /usr/bpo-x; cat /etc/shadow", "Permission denied"),
        ("run ls /home /root/.ssh", "No such file or directory"),
    ]
    for action, expected in cases:
        started = time.monotonic()
        result = step(env, action)
        assert expected in result.observation, (action, result.observation[-600:])
        assert time.monotonic() - started < 30, action
        assert not result.done and not result.info["invalid_action"]
        # The sandbox keeps working, and nothing of the command is left on the host.
        assert "def clamp" in step(env, "view minicalc/calc.py").observation
        assert _jail_processes() == [], action
        assert leftover_processes(before, timeout_s=2.0) == [], action
    assert not marker.exists() and not os.path.exists("/usr/bpo-x")
    assert "Read-only file system" in step(env, "run touch /usr/bpo-x").observation


def test_commands_change_the_working_copy(tasks, env):
    env.reset(options={"task": _calc_task(tasks)})
    out = step(env, "run echo 'NOTE = 1' >> minicalc/text.py && rm README && echo done > new.txt")
    assert "Changed files: README, minicalc/text.py, new.txt" in out.observation
    assert "NOTE = 1" in step(env, "view minicalc/text.py").observation
    assert "does not exist" in step(env, "view README").observation
    assert step(env, "view new.txt").observation.endswith("1 done")
    assert "cat: README: No such file" in step(env, "run cat README").observation


def test_jail_limits_are_checked():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="below tmpfs_mb"):
        Limits(file_mb=64, tmpfs_mb=32)


def test_jail_runs_a_tree_with_overlay(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.txt").write_text("base\n")
    result = run_in_jail(
        str(tmp_path), {"pkg/b.txt": b"overlay\n", "pkg/a.txt": None},
        ["bash", "-c", "ls pkg; cat pkg/b.txt; id -u; pwd; echo x > pkg/c.txt"],
        limits=Limits(timeout_s=10), capture=True,
    )  # fmt: skip
    lines = result.output.split()
    assert lines[:3] == ["b.txt", "overlay", lines[2]] and int(lines[2]) >= 1 << 30
    assert "/tmp/testbed" in lines
    assert result.changes == {"pkg/c.txt": b"x\n"} and result.exit_code == 0
    assert (tmp_path / "pkg" / "a.txt").read_text() == "base\n"  # The base is never written.


_HOG = """python - <<'EOF'
import os, time
# Each child touches 150 MiB, says so on `ready` (one byte: its index), then holds the memory
# until the parent closes `release`. The parent waits until every child has said ready or died:
# then every live child holds its memory at once, whatever order the scheduler ran them in. (A
# child can say ready and be killed later, when another one's touching overflows the cgroup: it
# is counted once, by index; counting the bytes counted it twice and released the holders while
# a child was still touching.) The deadline only guards against a hang.
ready_r, ready_w = os.pipe()
release_r, release_w = os.pipe()
os.set_blocking(ready_r, False)
children = []
for k in range(6):
    pid = os.fork()
    if pid == 0:
        os.close(release_w)
        block = bytearray(150 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(ready_w, bytes([k]))
        os.read(release_r, 1)
        os._exit(0)
    children.append(pid)
statuses, ready, start = {}, set(), time.monotonic()
while len(ready | set(statuses)) < len(children) and time.monotonic() < start + 100:
    try:
        ready.update(children[k] for k in os.read(ready_r, 64))
    except BlockingIOError:
        pass
    for p in children:
        if p not in statuses:
            done, status = os.waitpid(p, os.WNOHANG)
            if done:
                statuses[p] = os.waitstatus_to_exitcode(status)
    time.sleep(0.01)
os.close(release_w)
for p in children:
    if p not in statuses:
        statuses[p] = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
print("statuses", sorted(statuses.values()), "seconds", round(time.monotonic() - start, 1))
EOF"""


def test_jail_caps_memory_of_all_processes_together(tmp_path):
    # Six processes holding 150 MiB each at once, under a 300 MiB limit: each alone fits its
    # RLIMIT_AS, so only the per-jail memory cgroup (where cgroup v1 is writable, as here) stops
    # them, and at most one of them fits beside the shell and the parent.
    result = run_in_jail(str(tmp_path), {}, ["bash", "-c", _HOG],
                         limits=Limits(timeout_s=120, memory_mb=300))  # fmt: skip
    statuses = [int(s) for s in result.output.split("[", 1)[1].split("]")[0].split(",")]
    if "memory" in result.cgroups:
        assert statuses.count(-9) >= 5, result.output  # Killed by the cgroup's OOM killer.
    else:
        assert statuses == [0] * 6, result.output
    assert _jail_processes() == []


# Snapshots -----------------------------------------------------------------------------------


def _branch_scenario(backend: str, task: SweTask, **options):
    """Snapshot mid-episode, fork two copies that edit different files; returns observations."""
    with SandboxPool("swe", {"max_steps": 30}, backend=backend, num_workers=2, **options) as pool:
        sid, _, _ = pool.reset(task)
        seen = [
            pool.step(sid, "insert minicalc/text.py 0 # edited before the snapshot").observation
        ]
        handle = pool.snapshot(sid)
        a, b = pool.fork(handle, 2)
        seen += [r.observation for r in pool.step_many([
            (a, "insert minicalc/calc.py 0 A = 'fork a'"),
            (b, "insert tests/test_text.py 0 B = 'fork b'"),
            (sid, "run echo original > minicalc/orig.txt"),
        ])]  # fmt: skip
        seen += [r.observation for r in pool.step_many([(a, "diff"), (b, "diff"), (sid, "diff")])]
        seen += [r.observation for r in pool.step_many([(a, "test"), (b, "run ls minicalc")])]
        pool.release(handle)
    return seen


def test_fork_backend_forks_are_independent_and_match_replay(tasks):
    task = tasks[0]
    before = set(procutil.descendant_pids(os.getpid()))
    fork = _branch_scenario("fork", task)
    diff_a, diff_b, diff_orig = fork[4:7]
    assert "+A = 'fork a'" in diff_a and "fork b" not in diff_a and "orig.txt" not in diff_a
    assert "+B = 'fork b'" in diff_b and "fork a" not in diff_b
    assert "+original" in diff_orig and "fork" not in diff_orig
    for diff in (diff_a, diff_b, diff_orig):
        assert "+# edited before the snapshot" in diff  # Every copy keeps the shared prefix.
    assert "orig.txt" not in fork[8]  # Fork b does not see the original's new file.
    assert leftover_processes(before) == []
    assert fork == _branch_scenario("replay", task)


def test_fork_backend_latency(tasks):
    with SandboxPool("swe", {"max_steps": 50}, backend="fork", num_workers=2) as pool:
        sid, _, _ = pool.reset(tasks[0])
        started = time.monotonic()
        for _ in range(10):
            pool.step(sid, "view minicalc/calc.py 1-10")
        step_s = (time.monotonic() - started) / 10
        handle = pool.snapshot(sid)
        started = time.monotonic()
        copies = pool.fork(handle, 4)
        fork_s = (time.monotonic() - started) / 4
        assert all(not r.done for r in pool.step_many([(c, "diff") for c in copies]))
    # Loose bounds (the machine is shared); the README reports measured figures.
    assert step_s < 2.0 and fork_s < 2.0, (step_s, fork_s)


def test_criu_backend_checkpoints_the_episode(tasks):
    reason = criu_unavailable_reason()
    if reason is not None:
        if os.environ.get("BPO_REQUIRE_CRIU"):
            pytest.fail(f"$BPO_REQUIRE_CRIU is set but the criu backend cannot run: {reason}")
        pytest.skip(f"criu backend unavailable: {reason}")
    assert _branch_scenario("criu", tasks[0]) == _branch_scenario("replay", tasks[0])


def test_inprocess_backend_copies_the_workspace(tasks):
    with make_backend("inprocess", "swe", {"max_steps": 10}) as backend:
        sandbox = backend.new_sandbox()
        sandbox.reset(tasks[0])
        handle = sandbox.snapshot()
        sandbox.step("insert minicalc/text.py 0 X = 1")
        (copy,) = backend.fork(handle, 1)
        assert copy.step("diff").observation == "No changes yet."


# SWE-bench and Docker ------------------------------------------------------------------------


def test_swebench_instances_load_and_docker_says_it_is_missing(tmp_path):
    instance = {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "problem_statement": "Modeling's separability_matrix does not compute correctly...",
        "hints_text": "",
        "version": "4.3",
        "FAIL_TO_PASS": json.dumps(["astropy/modeling/tests/test_separable.py::test_a"]),
        "PASS_TO_PASS": json.dumps([]),
        "test_patch": "",
        "patch": "",
    }
    path = tmp_path / "verified.jsonl"
    path.write_text(json.dumps(instance) + "\n")
    (task,) = load_tasks("swe", str(path), "all", source="swebench")
    assert task.fail_to_pass == ("astropy/modeling/tests/test_separable.py::test_a",)
    assert task.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert task.source == "swebench" and task.task_type == "astropy"
    assert load_swebench(tmp_path)[0] == task
    from envs.swe.docker import DockerUnavailableError

    # Where the Docker CLI is missing, the executor says so and how to run SWE-bench (where it
    # is there, tests/test_swe_docker.py runs it).
    with pytest.raises(DockerUnavailableError, match="this machine has no Docker"):
        make_env("swe", executor="docker", docker={"docker": "no-such-docker-cli"})
    env = make_env("swe")
    with pytest.raises(FileNotFoundError, match="executor='docker'"):
        env.reset(options={"task": task})


# Real packages (network: pip download from PyPI) -------------------------------------------


@pytest.mark.slow
def test_build_real_packages(tmp_path):
    from envs.swe.packages import PACKAGES

    specs = [PACKAGES[name] for name in ("inflection", "parse", "cachetools")]
    manifest = build(tmp_path, specs, per_package=3, jobs=2, max_candidates=20)
    assert manifest["tasks"] >= 6 and all(p["tasks"] >= 1 for p in manifest["packages"].values())
    env = make_env("swe", max_steps=10)
    for task in swe_load_tasks(tmp_path, "all"):
        env.reset(options={"task": task})
        for action in task.walkthrough:
            result = step(env, action)
        assert result.reward == 1.0, (task.task_id, result.observation)


@pytest.mark.slow
def test_swebench_cpu_experiment_trains(built, tmp_path):
    """The `cpu` variant of experiments/swebench.py runs end to end on the fixture tasks."""
    from bpo_jax.experiment import load_experiment
    from bpo_jax.train import train_and_evaluate

    path = Path(__file__).resolve().parents[1] / "experiments" / "swebench.py"
    cfg = load_experiment(path).get_config("cpu")
    cfg.env.data_root = str(built[0])
    cfg.env.train_split = cfg.env.eval_split = "all"
    cfg.env.num_train_tasks = 2
    cfg.env.max_steps = 3
    cfg.eval.num_tasks = 2
    cfg.bc.steps = 4
    cfg.bc.batch_size = 8
    cfg.train.iterations = 1
    cfg.train.tasks_per_iter = 1
    cfg.train.group_size = 2
    cfg.train.minibatch_size = 8
    cfg.agent.max_prompt_tokens = 192
    cfg.agent.max_action_tokens = 32
    cfg.model.max_seq_len = 256
    cfg.checkpoint.every = 1
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 1
    demos = json.loads((tmp_path / "expert_demos.json").read_text())
    assert len(demos) == 2 and all(d["won"] for d in demos)
