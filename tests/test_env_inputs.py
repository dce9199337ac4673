"""Bad input at the envs' edges: empty data folders, hostile action strings, huge tool arguments.

An env answers any `str` an agent could send (lone surrogates, NUL, megabytes) as an invalid
action at a bounded cost, in process and through a sandbox worker; a loader that finds no data
says where it looked.
"""

import json
import os
import random
import shlex
import time

import pytest

from envs.base import ACTION_MAX_CHARS, action_refusal, make_env
from envs.sandbox import wire
from envs.sandbox.pool import SandboxPool
from envs.sandbox.testing import CounterEnv, CounterTask
from envs.swe.tools import parse_action, shell_words

HOSTILE = {
    "lone surrogate": ("inc\ud800", "lone surrogate (U+D800 at 3)"),
    "lone low surrogate": ("\udcffinc", "lone surrogate (U+DCFF at 0)"),
    "NUL": ("in\x00c", "NUL character (at 2)"),
    "10 MB": ("inc " * (10 << 18), f"at most {ACTION_MAX_CHARS:,} are read"),
    "bytes": (b"inc", "got bytes"),
}


def test_action_refusal_accepts_text_and_names_what_is_wrong():
    for ok in ["inc", "", "héllo wörld \U0001f34e", "x" * ACTION_MAX_CHARS, "tab\there"]:
        assert action_refusal(ok) is None, ok
    for name, (action, message) in HOSTILE.items():
        refusal = action_refusal(action)
        assert refusal is not None and message in refusal, (name, refusal)
    assert "10,485,760 characters" in action_refusal("inc " * (10 << 18))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_text_env_answers_hostile_actions_as_invalid(name):
    action, message = HOSTILE[name]
    env = CounterEnv(max_steps=3)
    env.reset(options={"task": CounterTask("t", start=0, target=2)})
    start = time.perf_counter()
    observation, reward, terminated, truncated, info = env.step(action)
    assert time.perf_counter() - start < 0.5
    assert observation.startswith("Invalid action: ") and message in observation
    assert reward == -0.1 and not terminated and not truncated
    assert info["invalid_action"] and not info["won"] and message in info["refused"]
    assert info["steps"] == 1 and env.count == 0  # The env never saw it, but the step counts.
    assert env.step("inc")[0].startswith("count=1 steps=2 ")
    assert env.step("\x00")[3]  # The step limit cuts a refused step off like any other.


def test_tabular_env_refuses_the_same_way():
    env = make_env("bpo_jax/TabularTree-v0")
    env.reset(seed=0)
    _, reward, _, _, info = env.step("a\ud800")
    assert info["invalid_action"] and "lone surrogate" in info["refused"]
    assert reward == -env.invalid_action_penalty


def test_hostile_actions_cross_the_fork_pool_as_invalid_actions():
    """No fault, no UnicodeEncodeError on the worker's pipe: each is an ordinary invalid step."""
    with SandboxPool("sandbox_counter", {}, backend="fork", step_timeout_s=20) as pool:
        names = sorted(HOSTILE)
        sids = [s for s, _, _ in pool.reset_many([CounterTask(n) for n in names])]
        results = pool.step_many([(sid, HOSTILE[n][0]) for sid, n in zip(sids, names)])
        for name, result in zip(names, results):
            assert "fault" not in result.info, (name, result.info)
            assert result.info["invalid_action"] and not result.done, name
            assert HOSTILE[name][1] in result.info["refused"], name
        (after,) = pool.step_many([(sids[0], "inc")])
        assert after.observation.startswith("count=1 steps=2 ")
        assert pool.stats()["faults"] == 0


def test_lone_surrogates_and_nul_cross_the_wire_unchanged():
    """Text an env returns (an observation with a lone surrogate, say) survives the pipe."""
    reply = ("ok", ("out \ud800\udcff \x00 end", 0.0, False, {"note": "\udfff"}))
    read_fd, write_fd = os.pipe()
    try:
        wire.write_all(write_fd, wire.encode(reply))
        assert wire.recv_blocking(wire.FrameReader(read_fd)) == reply
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_empty_alfworld_split_says_no_games_found(tmp_path):
    from envs.alfworld.data import load_tasks

    split = tmp_path / "json_2.1.1" / "valid_seen"
    split.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no games found under .*valid_seen"):
        load_tasks(tmp_path, "valid_seen")
    # A task folder with trials but no game file is no data either.
    (split / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_1").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no games found"):
        load_tasks(tmp_path, "valid_seen")


def test_empty_swe_instances_say_no_tasks_found(tmp_path):
    from envs.swe.data import INSTANCES_FILE, load_swebench, load_tasks

    (tmp_path / INSTANCES_FILE).write_text("\n")
    with pytest.raises(FileNotFoundError, match="no tasks found under"):
        load_tasks(tmp_path, "all")
    empty = tmp_path / "verified.json"
    empty.write_text(json.dumps([]))
    with pytest.raises(FileNotFoundError, match="no SWE-bench instances found in"):
        load_swebench(empty)


def test_shell_words_is_shlex_split():
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\t", "'", '"', "\\", "é", "x y", "$", "::", "["]
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            want = shlex.split(text)
        except ValueError:
            with pytest.raises(ValueError):
                shell_words(text)
            continue
        assert shell_words(text) == want, text
    assert shell_words("""tests/t.py::test_a[x y] 'a b' "c \\" d" e\\ f ''""") == [
        "tests/t.py::test_a[x", "y]", "a b", 'c " d', "e f", ""]  # fmt: skip


def test_test_tool_parses_a_megabyte_in_linear_time():
    # shlex.split took 26 s on 1 MB; a linear splitter takes well under a second per MB.
    n = 1 << 17
    for arguments, want in [
        ("a" * (1 << 20), ("a" * (1 << 20),)),
        ("'a b' " * n, ("a b",) * n),
        ('x"y\\"z" ' * n, ('xy"z',) * n),
    ]:
        start = time.perf_counter()
        call = parse_action("test " + arguments)
        assert time.perf_counter() - start < 5.0
        assert call.tool == "test" and call.args == want
