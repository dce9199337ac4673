"""Expert demonstrations played through the sandboxes, as agent text: the games' walkthroughs, or
an environment's searching demonstrator (`bc.demos`).

Each demo is one episode's text in the agent's turn format, paired with the expert's actions,
so behaviour cloning trains on exactly the prompts the agent will see. The demos are cached as
JSON in the run's working directory (a restarted run does not replay them).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath

from bpo_jax.agent import EpisodeText, build_prompt, encode_prompt
from bpo_jax.io import files

# Where behaviour cloning's demonstrations come from (`bc.demos`): the games' own walkthroughs
# (the planner's, which knows the hidden state), or an environment's searching demonstrator,
# which decides from the goal and the observations only (`SEARCH_EXPERTS`).
DEMO_SOURCES = ("walkthrough", "search")

# Environment name -> "module:Class" of its searching demonstrator: built from
# (first_observation, goal), with `act() -> str | None` and `observe(observation)`.
SEARCH_EXPERTS = {"alfworld": "envs.alfworld.search_expert:SearchExpert"}

# Environment name -> "module:function" of `(first_observation, rng) -> (command, reply)`: a
# command the game cannot execute, and its answer (recovery examples, `bc.recovery`).
INADMISSIBLE_ACTIONS = {"alfworld": "envs.alfworld.inadmissible:inadmissible_turn"}

# Environment name -> "module:function" of `(EpisodeText) -> str`: the tiny agent's notes on
# what the episode's texts have shown (`agent.notes`; `bpo_jax.agent.tiny`).
AGENT_NOTES = {"alfworld": "envs.alfworld.memory:notes"}

# The cache file of each source in the run's workdir.
_CACHE_NAMES = {"walkthrough": "expert_demos.json", "search": "search_demos.json"}


class _Walkthrough:
    """A task's walkthrough as an expert: its actions in order, whatever the game answers."""

    def __init__(self, actions: Sequence[str]):
        self._actions = list(actions)
        self._t = 0

    def act(self) -> str | None:
        if self._t >= len(self._actions):
            return None
        self._t += 1
        return self._actions[self._t - 1]

    def observe(self, observation: str) -> None:
        del observation  # A walkthrough does not look.


def _registered(registry: dict[str, str], env_name: str, what: str, instead: str):
    """The object a "module:name" registry entry names for `env_name`, imported on demand."""
    import importlib

    if env_name not in registry:
        raise ValueError(
            f"no {what} for environment {env_name!r}; known: {sorted(registry)} ({instead})."
        )
    module, name = registry[env_name].split(":")
    return getattr(importlib.import_module(module), name)


def inadmissible_turn_fn(env_name: str) -> Callable:
    """`env_name`'s generator of commands the game cannot execute (`INADMISSIBLE_ACTIONS`)."""
    return _registered(
        INADMISSIBLE_ACTIONS, env_name, "generator of inadmissible commands", "set bc.recovery=0"
    )


def notes_fn(env_name: str) -> Callable:
    """`env_name`'s notes for the tiny agent (`AGENT_NOTES`)."""
    return _registered(AGENT_NOTES, env_name, "agent notes", "set agent.notes=False")


def search_expert_class(env_name: str):
    """The searching demonstrator class of `env_name` (`SEARCH_EXPERTS`)."""
    return _registered(
        SEARCH_EXPERTS, env_name, "searching demonstrator", "use bc.demos='walkthrough'"
    )


def play_experts(pool, tasks: Sequence, make_expert: Callable) -> list[dict]:
    """Plays one expert per task through the pool, all tasks stepping together.

    `make_expert(task, first_obs, goal)` builds a task's expert; the episode ends when the game
    does (a win or the step limit) or the expert has no action left. Returns
    [{task_id, first_obs, goal, actions, observations, won}].
    """
    resets = pool.reset_many(list(tasks))
    demos, experts = [], []
    for task, (_, obs, info) in zip(tasks, resets):
        goal = info.get("goal")
        demos.append(
            {
                "task_id": task.task_id,
                "first_obs": obs,
                "goal": goal,
                "actions": [],
                "observations": [],
                "won": False,
            }
        )
        experts.append(make_expert(task, obs, goal))
    sids = [sid for sid, _, _ in resets]
    active = list(range(len(tasks)))
    while active:
        moves = [(i, experts[i].act()) for i in active]
        for i, action in moves:
            if action is None:
                pool.close_sandbox(sids[i])
        moves = [(i, a) for i, a in moves if a is not None]
        still = []
        for (i, action), res in zip(moves, pool.step_many([(sids[i], a) for i, a in moves])):
            demos[i]["actions"].append(action)
            demos[i]["observations"].append(res.observation)
            demos[i]["won"] = bool(res.info.get("won", False))
            experts[i].observe(res.observation)
            if res.done:
                pool.close_sandbox(sids[i])
            else:
                still.append(i)
        active = still
    return demos


def play_walkthroughs(pool, tasks: Sequence) -> list[dict]:
    """Plays every task's walkthrough; returns [{task_id, first_obs, goal, actions, obs, won}]."""
    return play_experts(pool, tasks, lambda task, obs, goal: _Walkthrough(task.walkthrough))


def play_search(pool, tasks: Sequence, env_name: str) -> list[dict]:
    """Plays `env_name`'s searching demonstrator on every task (same records as walkthroughs).

    The expert is built from the first observation and the goal only, never from the task:
    what it does in a game is a function of the text that game shows it.
    """
    cls = search_expert_class(env_name)
    return play_experts(pool, tasks, lambda task, obs, goal: cls(obs, goal))


def demos_path(workdir, source: str) -> epath.Path:
    """The cache file of `source`'s demos in a run's workdir."""
    return files.as_path(workdir) / _CACHE_NAMES[source]


def load_or_play(
    path: epath.Path, pool, tasks: Sequence, source: str = "walkthrough", env_name: str = ""
) -> list[dict]:
    """The demos cached at `path` if they cover exactly `tasks`, else plays and caches them."""
    if path.exists():
        demos = json.loads(path.read_text())
        if [d["task_id"] for d in demos] == [t.task_id for t in tasks]:
            return demos
    if source == "walkthrough":
        demos = play_walkthroughs(pool, tasks)
    elif source == "search":
        demos = play_search(pool, tasks, env_name)
    else:
        raise ValueError(f"unknown demo source {source!r}; expected one of {list(DEMO_SOURCES)}.")
    files.write_text(path, json.dumps(demos))
    return demos


def _episodes(demo: dict):
    """Yields (EpisodeText before step t, expert action t) for every step of a demo."""
    ep = EpisodeText.start(demo["first_obs"], goal=demo["goal"])
    for action, obs in zip(demo["actions"], demo["observations"]):
        yield ep, action
        ep.record(action, obs)


def corpus(demos: Sequence[dict], history_turns: int, notes: Callable | None = None) -> list[str]:
    """Text for training a tokenizer: every prompt and action the expert episodes produce."""
    texts = []
    for demo in demos:
        for ep, action in _episodes(demo):
            texts.append("".join(build_prompt(ep, history_turns, notes)) + " " + action)
    return texts


def bc_examples(
    demos: Sequence[dict],
    tokenizer,
    history_turns: int,
    max_prompt_tokens: int,
    *,
    recovery: float = 0.0,
    wrong_turn: Callable | None = None,
    seed: int = 0,
    notes: Callable | None = None,
):
    """(sequence, action_start) pairs: prompt tokens then the expert action and a stop token.

    With `recovery` > 0, each step of a winning demo is, with that probability, cloned a second
    time after one or two (even odds) turns of `wrong_turn(first_obs, rng) -> (command, reply)`,
    a command the game cannot execute, appended to the history, with the expert's own action as
    the label: the game's state is unchanged by such a command, so that is the expert's action
    there. The draws are seeded by `seed` and the demo's index (the same examples every time).
    `notes`: the tiny agent's notes (`bpo_jax.agent.tiny`), as the agent will write them.
    """
    if recovery and wrong_turn is None:
        raise ValueError("bc_examples: recovery > 0 needs wrong_turn (inadmissible_turn_fn).")
    out = []

    def example(ep, action):
        prompt = encode_prompt(tokenizer, ep, history_turns, max_prompt_tokens, notes=notes)
        act = tokenizer.encode(" " + action) + [tokenizer.eos_id]
        return prompt + act, len(prompt)

    for index, demo in enumerate(demos):
        if not demo["won"]:
            continue  # Only clone walkthroughs that actually win.
        rng = np.random.default_rng([seed, index])
        for ep, action in _episodes(demo):
            out.append(example(ep, action))
            if recovery and rng.random() < recovery:
                detour = copy.deepcopy(ep)
                for _ in range(1 + int(rng.random() < 0.5)):
                    command, reply = wrong_turn(demo["first_obs"], rng)
                    detour.record(command, reply)
                out.append(example(detour, action))
    return out
