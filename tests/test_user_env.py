"""A user's own text environment, defined only here, trains with BPO through the fork backend.

`CaveEnv` is a small deterministic game with a tree structure: at each of `depth` forks the agent
goes "left" or "right"; the treasure lies at the end of one path, and the first fork alone
decides whether the explorer gets anything at all (the half of the cave with the treasure pays
0.5 at every dead end). It knows nothing of bpo_jax: it subclasses `envs.base.TextEnv`, defines
its tasks with a `load_tasks` classmethod, and is named by an entry point
("<module>:CaveEnv") or by a gymnasium id registered below. Nothing in bpo_jax/ or envs/ names it.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from helpers import random_tiny_policy, word_tokenizer

from envs import base
from envs.sandbox import SandboxPool

GYM_ID = "bpo_jax_tests/Cave-v0"
_WORD_RE = re.compile(r"\b(left|right)\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class CaveTask(base.Task):
    """Attributes:
    treasure: The path ("left"/"right" per fork) that ends at the treasure.
    """

    treasure: tuple[str, ...] = ("left", "left", "left")


class CaveEnv(base.TextEnv):
    """Forks in a cave; reward 1 at the treasure, 0.5 at a dead end on its side, else 0."""

    task_class = CaveTask
    default_split = "train"

    def __init__(self, max_steps: int = 6, invalid_action_penalty: float = 0.05):
        super().__init__(max_steps, invalid_action_penalty)
        self.path: tuple[str, ...] = ()

    @classmethod
    def load_tasks(cls, data_root, split, task_types=None, *, depth: int = 3, count: int = 4):
        """`count` caves of `depth` forks; the split seeds where the treasures lie."""
        del data_root, task_types
        rng = np.random.default_rng(sum(split.encode()))
        return [
            CaveTask(f"cave/{split}/{i}", tuple(rng.choice(["left", "right"], size=depth)))
            for i in range(count)
        ]

    def _start(self, task: CaveTask) -> tuple[str, dict[str, Any]]:
        self.path = ()
        return self._describe(), {"won": False, "invalid_action": False, "goal": "find gold"}

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        match = _WORD_RE.search(action or "")
        if match is None:
            note = "You hesitate: say left or right. "
            info = {"won": False, "invalid_action": True}
            return note + self._describe(), -self.invalid_action_penalty, False, info
        self.path += (match.group(1).lower(),)
        treasure = self._task.treasure
        if len(self.path) < len(treasure):
            return self._describe(), 0.0, False, {"won": False, "invalid_action": False}
        won = self.path == treasure
        reward = 1.0 if won else 0.5 if self.path[0] == treasure[0] else 0.0
        end = "gold!" if won else "a dead end."
        return (
            f"{self._describe()} You found {end}",
            reward,
            True,
            {"won": won, "invalid_action": False},
        )

    def _describe(self) -> str:
        where = " then ".join(self.path) or "the entrance"
        forks = len(self._task.treasure) - len(self.path)
        return f"You are at {where}. Forks left: {forks}. Paths: left, right."


if GYM_ID not in gymnasium.registry:
    gymnasium.register(id=GYM_ID, entry_point=f"{__name__}:CaveEnv", kwargs={"max_steps": 6})

ENTRY_POINT = f"{CaveEnv.__module__}:CaveEnv"
TASKS = CaveEnv.load_tasks(None, "train")


def _replay(task: CaveTask, actions) -> list[base.StepResult]:
    """A fresh env's results for `actions` (the reference every sandbox is held to)."""
    env = base.make_env(ENTRY_POINT)
    base.reset_to(env, task)
    return [base.step_result(env, a) for a in actions]


def test_the_game_and_the_gymnasium_checker():
    env = gymnasium.make(GYM_ID).unwrapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    assert [str(w.message) for w in caught if "WARN" in str(w.message)] == []
    task = CaveTask("t", ("right", "left"))
    obs, info = env.reset(options={"task": task})
    assert obs == "You are at the entrance. Forks left: 2. Paths: left, right."
    assert env.step("I go Right.")[1:4] == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step("left")
    assert (reward, terminated, truncated, info["won"]) == (1.0, True, False, True)
    env.reset(options={"task": task})
    results = [env.step(a) for a in ("right", "right")]
    assert results[-1][1] == 0.5 and not results[-1][4]["won"]  # The right half pays 0.5.
    env.reset(options={"task": task})
    assert env.step("up")[4]["invalid_action"] and env.step("left")[1:3] == (0.0, False)


def test_names_and_tasks_resolve_without_registration():
    for name in (ENTRY_POINT, GYM_ID):
        assert type(base.make_env(name)) is CaveEnv
        assert base.env_class(name) is CaveEnv
    assert base.load_tasks(ENTRY_POINT, None, "train") == TASKS
    assert len(base.load_tasks(GYM_ID, None, "eval", None, depth=2, count=3)) == 3
    from envs import registry

    assert registry.preload_for(ENTRY_POINT) == (CaveEnv.__module__,)
    with pytest.raises(ValueError, match="does not load"):
        base.make_env(f"{CaveEnv.__module__}:NoSuchEnv")


def test_fork_pool_snapshots_and_clones_the_user_env():
    """Through the fork server: snapshot, fork, clone and restore all hold the right state."""
    task = TASKS[0]
    other = "right" if task.treasure[0] == "left" else "left"
    with SandboxPool(ENTRY_POINT, {"max_steps": 6}, backend="fork", num_workers=4) as pool:
        (sid, obs, info), _ = pool.reset_many([task, TASKS[1]])
        assert obs.startswith("You are at the entrance") and info["goal"] == "find gold"
        first = pool.step(sid, task.treasure[0])
        assert first.observation == _replay(task, [task.treasure[0]])[0].observation
        handle = pool.snapshot(sid)
        forks = pool.fork(handle, 2)
        clones = pool.clone(sid, 2)
        plans = {
            forks[0]: list(task.treasure[1:]),
            forks[1]: ["sideways", other, other],
            clones[0]: [other, other],
            clones[1]: list(task.treasure[1:]),
            sid: [other, task.treasure[2]],
        }
        got = {s: [] for s in plans}
        for t in range(3):
            requests = [(s, p[t]) for s, p in plans.items() if t < len(p) and not pool.done(s)]
            for (s, _), result in zip(requests, pool.step_many(requests)):
                got[s].append(result)
        for s, actions in plans.items():
            reference = _replay(task, [task.treasure[0], *actions])[1:]
            assert got[s] == reference[: len(got[s])], s
        assert got[forks[0]][-1].reward == 1.0 and got[forks[0]][-1].info["won"]
        assert got[forks[1]][0].info["invalid_action"]
        pool.restore(clones[0], handle)  # Back to one step in, on a finished sandbox.
        assert pool.step(clones[0], task.treasure[1]).observation == got[forks[0]][0].observation
        pool.release(handle)
        stats = pool.stats()
        assert stats["backend"] == "fork" and stats["clones"] == 2 and stats["snapshots"] == 1
        assert stats["held_snapshots"] == 0 and stats["faults"] == 0
        for s in pool.live():
            pool.close_sandbox(s)
        assert pool.live() == []


class EchoEnv(gymnasium.Env):
    """A plain gymnasium env (no TextEnv, no info contract): it echoes actions for two steps."""

    observation_space = gymnasium.spaces.Text(64, min_length=0)
    action_space = gymnasium.spaces.Text(64, min_length=0)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.name, self.t = (options or {})["task"].task_id, 0
        return f"hello {self.name}", {}

    def step(self, action):
        self.t += 1
        return f"{self.name} heard {action}", float(len(action or "")), False, self.t >= 2, {}


def test_a_plain_gymnasium_env_runs_in_the_pool_too():
    """Any gymnasium env over text: done is terminated or truncated, the flag fills the info."""
    name = f"{EchoEnv.__module__}:EchoEnv"
    with SandboxPool(name, {}, backend="fork", num_workers=2) as pool:
        (sid, obs, _), (other, _, _) = pool.reset_many([base.Task("a"), base.Task("b")])
        assert obs == "hello a"
        (copy,) = pool.clone(sid, 1)
        first, second = pool.step_many([(sid, "hi"), (other, "yo")])
        assert (first.observation, first.reward, first.done) == ("a heard hi", 2.0, False)
        assert second.observation == "b heard yo" and first.info == {"truncated": False}
        last, from_copy = pool.step_many([(sid, "bye"), (copy, "hey")])
        assert last.done and last.info == {"truncated": True}
        assert from_copy.observation == "a heard hey" and not from_copy.done


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny decoder with random weights and a tokenizer trained on the cave's words."""
    words = ["left", "right", "You", "are", "at", "the", "entrance", "then", "Forks", "Paths:"]
    tok = word_tokenizer(words, tmp_path_factory.mktemp("tok") / "sp", 300, words_per_line=10)
    return random_tiny_policy(
        tok, embed_scale=4.0, max_new_tokens=4, cache_len=192, temperature=1.0
    )


def test_bpo_forest_on_the_fork_backend(policy):
    """play_forest grows BPO trees over the user env; every path replays on a fresh env."""
    import jax

    from bpo_jax.estimators import tree_advantages
    from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector
    from bpo_jax.rollout.engine import TreeSpec, play_forest, prompt_encoder

    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)
    tasks = TASKS[:2]
    with SandboxPool(GYM_ID, {"max_steps": 6}, backend="fork", num_workers=4) as pool:
        forest = play_forest(
            pool,
            policy,
            prompt_encoder(policy.tokenizer, history_turns=2, max_prompt_tokens=96),
            tasks,
            spec,
            rng=jax.random.key(0),
            selector=make_selector("interval", interval=1),
            lengths=LengthModel(6),
            costs=CostModel(spec.budget_unit),
        )
        assert pool.live() == [] and pool.stats()["held_snapshots"] == 0
        assert pool.stats()["clones"] > 0 and pool.stats()["faults"] == 0
    assert forest.num_branch_points > 0
    assert len(forest.leaves) == len(tasks) * spec.root_group + forest.num_branch_points
    for traj in forest.paths():
        actions = [s.action_text for s in traj.steps]
        reference = _replay(tasks[traj.group], actions)
        assert [s.observation for s in traj.steps] == [r.observation for r in reference]
        assert [s.reward for s in traj.steps] == pytest.approx([r.reward for r in reference])
        assert reference[-1].done  # Every path ran to its end (a leaf or the step limit).
        assert traj.won == reference[-1].info["won"]
        assert traj.truncated == reference[-1].info["truncated"]
    f = forest.to_forest()
    _, advantages = tree_advantages(f.seg_parent, f.seg_child, f.seg_reward, f.num_nodes)
    assert np.all(np.isfinite(np.asarray(advantages)))
