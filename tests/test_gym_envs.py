"""The gymnasium face of the environments: ids, spaces, the checker, names and the info contract.

ALFWorld's and the repository-repair env's checker tests live with their data
(test_alfworld_env.py, test_swe.py); WebShop's and the tabular MDP's run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import base, registry
from envs.tabular import TabularEnv, TabularTask

REPO = Path(__file__).resolve().parents[1]
WEBSHOP_DATA = REPO.parent / "shared" / "data" / "webshop"
WEBSHOP_FIXTURE = REPO / "tests" / "fixtures" / "webshop" / "items_shuffle_fixture.json"


def checker_complaints(env) -> list[str]:
    """Runs gymnasium's check_env (it raises on a failure) and returns what it warned about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    return [str(w.message) for w in caught if "WARN" in str(w.message)]


def test_ids_are_registered_on_import_without_loading_the_envs():
    code = (
        "import sys, envs, gymnasium\n"
        "ids = sorted(i for i in gymnasium.registry if i.startswith('bpo_jax/'))\n"
        "print(ids, 'envs.alfworld.env' in sys.modules, 'envs.webshop.env' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout.strip()
    expected = [
        "bpo_jax/ALFWorld-v0",
        "bpo_jax/RepoRepair-v0",
        "bpo_jax/TabularTree-v0",
        "bpo_jax/WebShop-v0",
    ]
    assert out == f"{expected} False False"


def test_text_space_holds_any_unicode_text_within_its_length():
    space = base.TextEnv.action_space
    assert isinstance(space, gymnasium.spaces.Text) and space.max_length == base.ACTION_MAX_CHARS
    for text in ["", "go to desk 1", "click[größe: 42 ½]", "emoji 🦜 and 中文\n\ttabs", "\x00"]:
        assert text in space, text
    assert "x" * (base.ACTION_MAX_CHARS + 1) not in space
    assert None not in space and b"bytes" not in space and 3 not in space
    space.seed(0)
    samples = [space.sample() for _ in range(5)]
    assert all(s in space for s in samples) and len(set(samples)) == 5
    assert base.TextEnv.observation_space.max_length == base.OBSERVATION_MAX_CHARS
    # Each env samples from its own copy, so seeding one env's space leaves the others alone.
    first, second = TabularEnv(), TabularEnv()
    assert first.action_space == second.action_space == space
    assert first.action_space is not second.action_space is not space


def test_tabular_env_passes_the_checker():
    env = gymnasium.make("bpo_jax/TabularTree-v0", instance="first_action_decides").unwrapped
    assert checker_complaints(env) == []
    obs, info = env.reset(seed=1)  # No task: the initial state of the env's own MDP.
    assert info["state"] == 0 and info["task_id"].startswith("tabular/default/")
    obs, reward, terminated, truncated, info = env.step("a0")
    assert (terminated, truncated, info["invalid_action"], info["steps"]) == (
        False,
        False,
        False,
        1,
    )
    for _ in range(env.mdp.horizon - 1):
        *_, terminated, truncated, info = env.step("a0")
    assert terminated and not truncated and info["won"]
    with pytest.raises(ValueError, match="unknown options"):
        env.reset(options={"start": 3})


def test_webshop_env_passes_the_checker(tmp_path):
    tasks = base.load_tasks(
        "bpo_jax/WebShop-v0",
        str(WEBSHOP_DATA),
        "test",
        split_sizes=(20, 20),
        products_file=str(WEBSHOP_FIXTURE),
        cache_dir=str(tmp_path),
    )
    env = gymnasium.make("bpo_jax/WebShop-v0", tasks=tasks).unwrapped
    assert checker_complaints(env) == []
    _, first = env.reset(seed=3)
    _, again = env.reset(seed=3)
    assert first["task_id"] == again["task_id"] and first["task_id"] in {t.task_id for t in tasks}
    *_, info = env.step(env.action_space.sample())
    assert info["invalid_action"] and info["page"] == "search"


def test_step_limit_truncates_through_the_flag_and_the_info():
    env = TabularEnv(max_steps=2)
    env.reset()
    assert env.step("nonsense")[2:4] == (False, False)
    result = base.step_result(env, "a1")  # How the sandbox layer reports it.
    assert result.done and result.info["truncated"]
    env.reset()
    env.step("nonsense")
    obs, reward, terminated, truncated, info = env.step("a1")
    assert (terminated, truncated, info["truncated"], info["steps"]) == (False, True, True, 2)
    assert env.done
    with pytest.raises(RuntimeError, match="after the episode of tabular/default/.* ended"):
        env.step("a0")


def test_make_env_and_load_tasks_take_every_kind_of_name():
    names = ["tabular", "bpo_jax/TabularTree-v0", "envs.tabular.env:TabularEnv"]
    for name in names:
        env = base.make_env(name, max_steps=5, seed=3)
        assert type(env) is TabularEnv and env.max_steps == 5 and "seed=3" in env.mdp.name
        tasks = base.load_tasks(name, None, "train", None, seed=3)
        assert [type(t) for t in tasks] == [TabularTask]
    # A spec's own kwargs sit under the caller's, and max_episode_steps becomes a TimeLimit.
    gymnasium.register(
        id="bpo_jax_tests/ShortTabular-v0",
        entry_point="envs.tabular.env:TabularEnv",
        kwargs={"horizon": 5},
        max_episode_steps=2,
    )
    try:
        env = base.make_env("bpo_jax_tests/ShortTabular-v0", num_actions=2)
        assert isinstance(env, gymnasium.wrappers.TimeLimit)
        assert env.unwrapped.mdp.horizon == 5 and env.unwrapped.mdp.num_actions == 2
        env.reset()
        assert env.step("a0")[3] is False and env.step("a0")[3] is True
    finally:
        del gymnasium.registry["bpo_jax_tests/ShortTabular-v0"]
    with pytest.raises(ValueError, match=r"Unknown environment 'nethack'.*entry point"):
        base.make_env("nethack")
    with pytest.raises(ValueError, match="does not load"):
        base.make_env("envs.tabular.env:NoSuchEnv")
    with pytest.raises(ValueError, match="no task loader"):
        base.load_tasks("gymnasium.envs.classic_control.cartpole:CartPoleEnv", None, "train")
    with pytest.raises(ValueError, match="not short names"):
        base.register_env("bpo_jax/Mine-v0")


def test_workers_preload_what_the_env_class_declares():
    assert registry.preload_for("alfworld") == (
        "envs.alfworld.env",
        "textworld",
        "alfworld.agents.environment.alfred_tw_env",
    )
    assert registry.preload_for("bpo_jax/WebShop-v0") == ("envs.webshop.env",)
    import envs.sandbox.testing  # noqa: F401 - registers the sandbox test envs' short names.

    assert registry.preload_for("sandbox_counter") == ("envs.sandbox.testing",)


def test_the_info_contract_is_enforced():
    class Forgetful(base.TextEnv):
        def _start(self, task):
            return "hello", {"won": False}  # No invalid_action.

    with pytest.raises(KeyError, match=r"Forgetful left \['invalid_action'\] out"):
        Forgetful(tasks=[base.Task("t")]).reset()
    with pytest.raises(ValueError, match="has no default_split"):
        Forgetful().reset()
    with pytest.raises(ValueError, match="max_steps"):
        Forgetful(max_steps=0)
    with pytest.raises(ValueError, match="invalid_action_penalty"):
        Forgetful(invalid_action_penalty=-0.5)
    with pytest.raises(RuntimeError, match="before reset"):
        Forgetful().step("x")
