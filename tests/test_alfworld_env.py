"""Tests for the ALFWorld data loader and environment, played on the real game files.

The data root comes from $ALFWORLD_DATA (conftest points it at the shared data). Resetting a game
takes seconds, so one env is shared by the module's tests.
"""

import pickle
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import base
from envs.alfworld import (
    NOTHING_HAPPENS,
    SPLITS,
    TASK_TYPES,
    AlfworldEnv,
    AlfworldTask,
    load_tasks,
    normalize_action,
    resolve_data_root,
    task_type_of,
)

PENALTY = 0.1


@pytest.fixture(scope="module")
def tasks():
    return {split: load_tasks(None, split) for split in SPLITS}


@pytest.fixture(scope="module")
def shortest_by_type(tasks):
    """The valid_unseen game with the shortest walkthrough of each type (fastest to play)."""
    by_type = {}
    for task in tasks["valid_unseen"]:
        best = by_type.get(task.task_type)
        if best is None or len(task.walkthrough) < len(best.walkthrough):
            by_type[task.task_type] = task
    return by_type


@pytest.fixture(scope="module")
def env():
    env = AlfworldEnv(max_steps=50, invalid_action_penalty=PENALTY)
    yield env
    env.close()


# --- Data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split, count", [("train", 554), ("valid_seen", 140), ("valid_unseen", 134)]
)
def test_load_tasks_counts_and_fields(tasks, split, count):
    split_tasks = tasks[split]
    assert len(split_tasks) == count
    assert {t.task_type for t in split_tasks} == set(TASK_TYPES)
    ids = [t.task_id for t in split_tasks]
    assert ids == sorted(ids)
    assert len(set(ids)) == count
    for task in split_tasks:
        assert task.split == split
        folder, trial = task.task_id.split("/")[1:]
        assert task.task_id == f"{split}/{folder}/{trial}"
        assert folder.startswith(task.task_type + "-")
        assert task.game_file.endswith(f"{task.task_id}/game.tw-pddl")
        assert task.walkthrough and all(isinstance(a, str) for a in task.walkthrough)


def test_load_tasks_filter_limit_seed(tasks):
    heat = load_tasks(None, "valid_seen", task_types=["pick_heat_then_place_in_recep"])
    assert len(heat) == 16
    assert {t.task_type for t in heat} == {"pick_heat_then_place_in_recep"}

    assert load_tasks(None, "valid_seen", limit=5) == tasks["valid_seen"][:5]
    assert load_tasks(None, "valid_seen", limit=0) == []
    shuffled = load_tasks(None, "valid_seen", seed=3)
    assert shuffled == load_tasks(None, "valid_seen", seed=3)
    assert shuffled != tasks["valid_seen"]
    assert sorted(shuffled, key=lambda t: t.task_id) == tasks["valid_seen"]
    assert load_tasks(None, "valid_seen", limit=7, seed=3) == shuffled[:7]


def test_task_type_of_takes_longest_match():
    assert task_type_of("pick_two_obj_and_place-Apple-None-Fridge-12") == "pick_two_obj_and_place"
    assert task_type_of("pick_and_place_simple-Pen-None-Desk-3") == "pick_and_place_simple"
    # An ALFRED type that ALFWorld's text engine does not play.
    assert task_type_of("pick_and_place_with_movable_recep-Pen-Bowl-Desk-3") is None


def test_load_tasks_rejects_bad_split_and_task_type():
    with pytest.raises(ValueError, match=r"'test_seen'.*valid_unseen"):
        load_tasks(None, "test_seen")
    with pytest.raises(ValueError, match=r"'pick_and_eat'.*pick_two_obj_and_place"):
        load_tasks(None, "train", task_types=["pick_and_eat"])
    with pytest.raises(ValueError, match="wrap it in a list"):
        load_tasks(None, "train", task_types="pick_and_place_simple")


def test_missing_data_root_says_how_to_get_data(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("ALFWORLD_DATA", str(missing))
    with pytest.raises(FileNotFoundError, match="alfworld-download") as error:
        resolve_data_root(None)
    assert str(missing) in str(error.value)
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        load_tasks(None, "train")

    # A folder that exists but is not a data root.
    with pytest.raises(FileNotFoundError, match=r"no json_2\.1\.1.*alfworld-download"):
        resolve_data_root(tmp_path)

    # With ALFWORLD_DATA unset, the default cache folder is tried (and named).
    monkeypatch.delenv("ALFWORLD_DATA")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"\.cache/alfworld.*alfworld-download"):
        resolve_data_root(None)


def test_explicit_root_wins_over_env_var(tmp_path, monkeypatch):
    real_root = resolve_data_root(None)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nowhere"))
    assert resolve_data_root(str(real_root)) == real_root


# --- Environment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_walkthrough_wins(env, shortest_by_type, task_type):
    task = shortest_by_type[task_type]
    observation, info = env.reset(options={"task": task})

    assert "Welcome to TextWorld" not in observation
    assert observation.startswith("You are in the middle of a room.")
    assert info["goal"].startswith("Your task is to: ")
    assert observation.endswith(info["goal"])
    assert info["task_type"] == task_type and info["task_id"] == task.task_id
    assert not info["won"] and not info["truncated"] and info["steps"] == 0
    assert not info["invalid_action"]
    assert "look" in info["admissible_commands"]

    *moves, last = task.walkthrough
    for step, action in enumerate(moves, start=1):
        observation, reward, terminated, truncated, info = env.step(action)
        assert reward == 0.0 and not terminated and not truncated, (action, observation)
        assert not info["invalid_action"] and info["steps"] == step
    observation, reward, terminated, truncated, info = env.step(last)
    assert (reward, terminated, truncated, info["won"], info["truncated"]) == (
        1.0,
        True,
        False,
        True,
        False,
    )
    assert observation and observation != NOTHING_HAPPENS

    with pytest.raises(RuntimeError, match="after the episode.*ended"):
        env.step("look")


def test_garbage_actions_are_penalised_then_walkthrough_still_wins(env, shortest_by_type):
    # The last walkthrough test played this game, so this reset skips the reload.
    task = shortest_by_type["pick_two_obj_and_place"]
    env.reset(options={"task": task})
    garbage = ["asdf qwerty", "", None, "go to the moon", "   ", "go to desk 99"]
    for step, action in enumerate(garbage, start=1):
        observation, reward, terminated, truncated, info = env.step(action)
        assert observation == NOTHING_HAPPENS, action
        assert reward == -PENALTY and not terminated and not truncated, action
        assert info["invalid_action"] and not info["won"] and info["steps"] == step

    # Sloppy casing, spacing and a final period still name the same admissible command.
    for action in task.walkthrough:
        observation, reward, terminated, truncated, info = env.step(
            f"  {action.upper().replace(' ', '  ')}. "
        )
        assert not info["invalid_action"], (action, observation)
    assert reward == 1.0 and terminated and info["won"]
    assert info["steps"] == len(garbage) + len(task.walkthrough)


def test_max_steps_truncates():
    env = AlfworldEnv(max_steps=3)
    try:
        task = load_tasks(None, "valid_unseen", limit=1)[0]
        env.reset(options={"task": task})
        for _ in range(2):
            assert env.step("look")[2:4] == (False, False)
        observation, reward, terminated, truncated, info = env.step("asdf")
        assert truncated and not terminated and info["truncated"] and not info["won"]
        assert info["invalid_action"]
        assert observation == NOTHING_HAPPENS and reward == pytest.approx(-0.1)
        with pytest.raises(RuntimeError, match="reset"):
            env.step("look")

        # A new episode starts from scratch.
        _, info = env.reset(options={"task": task})
        assert info["steps"] == 0 and not info["truncated"]
        assert env.step("look")[2:4] == (False, False)
    finally:
        env.close()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")


def test_step_before_reset_and_bad_reset_argument():
    env = AlfworldEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look")
    with pytest.raises(TypeError, match="AlfworldTask"):
        env.reset(options={"task": base.Task(task_id="x")})
    with pytest.raises(ValueError, match="unknown options.*'game'"):
        env.reset(options={"game": "x"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"invalid_action_penalty": -1.0}, "invalid_action_penalty"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlfworldEnv(**kwargs)


def test_env_cannot_be_pickled():
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(AlfworldEnv())


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("go to desk 1", "go to desk 1"),
        ("  Go  to\tDesk 1. ", "go to desk 1"),
        ("LOOK..", "look"),
        ("", ""),
        (None, ""),
    ],
)
def test_normalize_action(raw, expected):
    assert normalize_action(raw) == expected


# --- Protocol and registry -----------------------------------------------------------------------


def test_make_env_and_protocol():
    for name in ("alfworld", "bpo_jax/ALFWorld-v0", "envs.alfworld.env:AlfworldEnv"):
        env = base.make_env(name, max_steps=7)
        assert type(env) is AlfworldEnv and env.max_steps == 7, name
        assert isinstance(env, gymnasium.Env) and isinstance(env, base.TextEnv)
    assert base.env_class("alfworld").preload_modules == (
        "textworld",
        "alfworld.agents.environment.alfred_tw_env",
    )
    assert isinstance(
        AlfworldTask("t", game_file="g", split="train", task_type="x", walkthrough=()), base.Task
    )
    with pytest.raises(ValueError, match=r"'nethack'.*'alfworld'"):
        base.make_env("nethack")


def test_gymnasium_env_checker_passes():
    """check_env through gymnasium.make: reset without options draws a valid_unseen game with
    the env's seeded generator; a sampled action (random printable text) is an invalid one."""
    env = gymnasium.make("bpo_jax/ALFWorld-v0", max_steps=5).unwrapped
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env)
        complaints = [str(w.message) for w in caught if "WARN" in str(w.message)]
        assert complaints == []
        _, first = env.reset(seed=7)
        _, again = env.reset(seed=7)
        assert first["task_id"] == again["task_id"]
        assert first["task_id"].startswith("valid_unseen/")
    finally:
        env.close()


def test_register_env_rejects_a_taken_name(monkeypatch):
    from envs import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @base.register_env("dummy")
    class Dummy:
        pass

    assert base.register_env("dummy")(Dummy) is Dummy  # Re-registering the same class is fine.
    assert "dummy" in base.known_envs()
    with pytest.raises(ValueError, match="already registered"):

        @base.register_env("dummy")
        class Other:
            pass
