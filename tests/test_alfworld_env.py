"""Tests for the ALFWorld data loader and environment, played on the real game files.

The data root comes from $ALFWORLD_DATA (conftest points it at the shared data). Resetting a game
takes seconds, so one env is shared by the module's tests. The parity tests at the end play the
same games through alfworld's own wrappers, as `AlfredTWEnv.init_env` builds them.
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

FORMAT_PENALTY = 0.1  # For step(None).
INADMISSIBLE_PENALTY = 0.05  # For a command the game does not execute (0 by default).
WELCOME = "-= Welcome to TextWorld, ALFRED! =-\n\n"


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
    env = AlfworldEnv(
        max_steps=50,
        invalid_action_penalty=FORMAT_PENALTY,
        inadmissible_action_penalty=INADMISSIBLE_PENALTY,
    )
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

    # The game's first observation as it gives it, welcome header included.
    assert observation.startswith(WELCOME + "You are in the middle of a room.")
    assert info["goal"].startswith("Your task is to: ")
    assert observation.rstrip().endswith(info["goal"])
    assert info["task_type"] == task_type and info["task_id"] == task.task_id
    assert info["extra.gamefile"] == task.game_file and "extra.expert_plan" not in info
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


def test_invalid_actions_get_their_own_penalty_then_walkthrough_still_wins(env, shortest_by_type):
    # The last walkthrough test played this game, so this reset skips the reload.
    task = shortest_by_type["pick_two_obj_and_place"]
    env.reset(options={"task": task})
    first = task.walkthrough[0]
    # Each is sent to the game, which does not execute it; the sloppy spellings of the first
    # walkthrough command included (the official game compares the stripped string exactly).
    inadmissible = ["asdf qwerty", "", "go to the moon", "   ", "go to desk 99"]
    inadmissible += [first.capitalize() + ".", first.upper(), first.replace(" ", "  ")]
    for step, action in enumerate(inadmissible, start=1):
        observation, reward, terminated, truncated, info = env.step(action)
        assert observation == NOTHING_HAPPENS, action
        assert reward == -INADMISSIBLE_PENALTY and not terminated and not truncated, action
        assert info["invalid_action"] and not info["invalid_format"], action
        assert info["action"] == action and not info["won"] and info["steps"] == step
    # No action at all (unparseable output) is the format penalty; nothing reaches the game.
    observation, reward, _, _, info = env.step(None)
    assert (observation, reward) == (NOTHING_HAPPENS, -FORMAT_PENALTY)
    assert info["invalid_action"] and info["invalid_format"] and info["action"] is None

    # Surrounding whitespace is what textworld itself strips: the command is executed.
    for action in task.walkthrough:
        observation, reward, terminated, truncated, info = env.step(f"  {action} ")
        assert not info["invalid_action"], (action, observation)
    assert reward == 1.0 and terminated and info["won"]
    assert info["steps"] == len(inadmissible) + 1 + len(task.walkthrough)


def test_normalize_actions_option_accepts_sloppy_spelling(shortest_by_type):
    env = AlfworldEnv(normalize_actions=True, strip_welcome=True)
    try:
        task = shortest_by_type["look_at_obj_in_light"]
        observation, _ = env.reset(options={"task": task})
        assert observation.startswith("You are in the middle of a room.")
        for action in task.walkthrough:
            sloppy = f"  {action.upper().replace(' ', '  ')}. "
            observation, reward, terminated, _, info = env.step(sloppy)
            assert not info["invalid_action"] and info["action"] == action, observation
        assert reward == 1.0 and terminated and info["won"]
    finally:
        env.close()


def test_expert_plan_option_is_a_winning_plan(shortest_by_type):
    env = AlfworldEnv(expert_plan=True)
    try:
        task = shortest_by_type["pick_and_place_simple"]
        _, info = env.reset(options={"task": task})
        assert info["extra.expert_plan"] and all(
            a in info["admissible_commands"] for a in info["extra.expert_plan"][:1]
        )
        terminated, steps = False, 0
        while not terminated:
            plan = info["extra.expert_plan"]
            assert plan, f"no plan left after {steps} steps"
            _, reward, terminated, truncated, info = env.step(plan[0])
            steps += 1
            assert not info["invalid_action"] and not truncated
        assert reward == 1.0 and info["won"] and steps <= len(task.walkthrough) + 2
    finally:
        env.close()


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
        # Scored as the game scores it: an inadmissible command costs nothing by default.
        assert observation == NOTHING_HAPPENS and reward == 0.0
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
        ({"invalid_format_penalty": -1.0}, "invalid_action_penalty"),
        ({"inadmissible_action_penalty": -0.1}, "inadmissible_action_penalty"),
        ({"inadmissible_action_penalty": float("nan")}, "inadmissible_action_penalty"),
        ({"invalid_action_penalty": 0.1, "invalid_format_penalty": 0.2}, "name the same"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlfworldEnv(**kwargs)


def test_trainer_penalty_name_is_the_format_penalty():
    env = AlfworldEnv(invalid_action_penalty=0.1)
    assert env.invalid_format_penalty == 0.1 and env.inadmissible_action_penalty == 0.0
    assert (
        AlfworldEnv(invalid_format_penalty=0.2, invalid_action_penalty=0.2).invalid_format_penalty
        == 0.2
    )
    assert AlfworldEnv().invalid_format_penalty == 0.0


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


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_gymnasium_env_checker_passes():
    """check_env through gymnasium.make: reset without options draws a valid_seen game with
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
        assert first["task_id"].startswith("valid_seen/")  # verl-agent's evaluation default.
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


# --- Parity with alfworld's own wrappers ---------------------------------------------------------


def _official_env(game_file: str, max_steps: int):
    """One game through the env `AlfredTWEnv(config, "eval_...").init_env(1)` builds.

    `AlfredTWEnv` itself lists games by their `traj_data.json`, which the game-only data leaves
    out, so its `init_env` is reproduced on the chosen game: the same wrappers (no domain
    randomisation on an evaluation split), requested infos and step limit, through textworld's
    gym registration (synchronous, so that the test needs no worker process).
    """
    import textworld
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    request_infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env_id = textworld.gym.register_games(
        [game_file],
        request_infos,
        batch_size=1,
        asynchronous=False,
        max_episode_steps=max_steps,
        wrappers=[AlfredDemangler(shuffle=False), AlfredInfos],
    )
    return textworld.gym.make(env_id)


# Spellings of an admissible command that the official game does not execute; one per command
# in turn, then the command padded with whitespace (which textworld strips, so it runs).
_REJECTED_SPELLINGS = (
    lambda c: c.capitalize() + ".",  # 'Go to shelf 3.'
    str.upper,
    lambda c: c.replace(" ", "  "),
    lambda c: c + ".",
)


def _probes(walkthrough) -> list[str]:
    actions = []
    for i, command in enumerate(walkthrough):
        actions += [_REJECTED_SPELLINGS[i % len(_REJECTED_SPELLINGS)](command), f"  {command}\t"]
    return actions


@pytest.fixture(scope="module")
def parity_games(tasks):
    """Two games of each validation split, of four task types, with short walkthroughs."""
    chosen = []
    for split, types in [
        ("valid_seen", ("pick_heat_then_place_in_recep", "look_at_obj_in_light")),
        ("valid_unseen", ("pick_clean_then_place_in_recep", "pick_two_obj_and_place")),
    ]:
        for task_type in types:
            of_type = [t for t in tasks[split] if t.task_type == task_type]
            chosen.append(min(of_type, key=lambda t: (len(t.walkthrough), t.task_id)))
    return chosen


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_parity_with_official_wrappers(parity_games):
    """Observations (the first included), admissible commands, rewards, won and done agree step
    by step; every probe spelling the official game rejects is rejected here too."""
    ours = AlfworldEnv(max_steps=50)
    try:
        for task in parity_games:
            official = _official_env(task.game_file, max_steps=50)
            try:
                (obs,), infos = official.reset()
                observation, info = ours.reset(options={"task": task})
                assert observation == obs and obs.startswith(WELCOME), task.task_id
                assert info["admissible_commands"] == infos["admissible_commands"][0]
                assert info["extra.gamefile"] == infos["extra.gamefile"][0] == task.game_file
                assert info["won"] is infos["won"][0] is False
                score, rejected, done = 0, 0, False
                for action in _probes(task.walkthrough):
                    (obs,), (new_score,), (done,), infos = official.step([action])
                    observation, reward, terminated, truncated, info = ours.step(action)
                    where = (task.task_id, info["steps"], action)
                    assert observation == obs, where
                    assert reward == new_score - score, where  # Upstream's score is a total.
                    assert (terminated or truncated) is done, where
                    assert info["won"] is infos["won"][0], where
                    assert info["admissible_commands"] == infos["admissible_commands"][0], where
                    executed = obs != NOTHING_HAPPENS
                    assert info["invalid_action"] is not executed, where
                    assert executed is action.startswith("  "), where
                    rejected += not executed
                    score = new_score
                assert done and info["won"] and score == 1, task.task_id
                assert rejected == len(task.walkthrough), task.task_id
            finally:
                official.close()
    finally:
        ours.close()


def test_step_limit_parity_with_official_wrappers(parity_games):
    """A game played with commands that change nothing ends at step 50 in both, not won."""
    task = parity_games[1]
    official = _official_env(task.game_file, max_steps=50)
    ours = AlfworldEnv(max_steps=50)
    try:
        official.reset()
        ours.reset(options={"task": task})
        for step in range(1, 51):
            action = ("look", "inventory", "Look.", "go to the moon")[step % 4]
            (obs,), (score,), (done,), infos = official.step([action])
            observation, reward, terminated, truncated, info = ours.step(action)
            assert (observation, reward, info["won"]) == (obs, float(score), infos["won"][0])
            assert (terminated, truncated) == (False, done), step
            assert done is (step == 50)
    finally:
        official.close()
        ours.close()
