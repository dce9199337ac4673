"""Expert demonstrations: the walkthroughs played through the sandboxes, as agent text.

Each demo is one episode's text in the agent's turn format, paired with the expert's actions,
so behaviour cloning trains on exactly the prompts the agent will see. The demos are cached as
JSON in the run's working directory (a restarted run does not replay them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from etils import epath

from bpo_jax import files
from bpo_jax.agent import EpisodeText, build_prompt, encode_prompt


def play_walkthroughs(pool, tasks: Sequence) -> list[dict]:
    """Plays every task's walkthrough; returns [{task_id, first_obs, goal, actions, obs, won}]."""
    resets = pool.reset_many(list(tasks))
    demos = []
    for task, (_, obs, info) in zip(tasks, resets):
        demos.append(
            {
                "task_id": task.task_id,
                "first_obs": obs,
                "goal": info.get("goal"),
                "actions": [],
                "observations": [],
                "won": False,
            }
        )
    sids = [sid for sid, _, _ in resets]
    active = list(range(len(tasks)))
    t = 0
    while active:
        still = []
        requests = [(sids[i], tasks[i].walkthrough[t]) for i in active]
        for i, res in zip(active, pool.step_many(requests)):
            demos[i]["actions"].append(tasks[i].walkthrough[t])
            demos[i]["observations"].append(res.observation)
            if res.done or t + 1 >= len(tasks[i].walkthrough):
                demos[i]["won"] = bool(res.info.get("won", False))
                pool.close_sandbox(sids[i])
            else:
                still.append(i)
        active = still
        t += 1
    return demos


def load_or_play(path: epath.Path, pool, tasks: Sequence) -> list[dict]:
    if path.exists():
        demos = json.loads(path.read_text())
        if [d["task_id"] for d in demos] == [t.task_id for t in tasks]:
            return demos
    demos = play_walkthroughs(pool, tasks)
    files.write_text(path, json.dumps(demos))
    return demos


def _episodes(demo: dict):
    """Yields (EpisodeText before step t, expert action t) for every step of a demo."""
    ep = EpisodeText.start(demo["first_obs"], goal=demo["goal"])
    for action, obs in zip(demo["actions"], demo["observations"]):
        yield ep, action
        ep.record(action, obs)


def corpus(demos: Sequence[dict], history_turns: int) -> list[str]:
    """Text for training a tokenizer: every prompt and action the expert episodes produce."""
    texts = []
    for demo in demos:
        for ep, action in _episodes(demo):
            texts.append("".join(build_prompt(ep, history_turns)) + " " + action)
    return texts


def bc_examples(demos: Sequence[dict], tokenizer, history_turns: int, max_prompt_tokens: int):
    """(sequence, action_start) pairs: prompt tokens then the expert action and a stop token."""
    out = []
    for demo in demos:
        if not demo["won"]:
            continue  # Only clone walkthroughs that actually win.
        for ep, action in _episodes(demo):
            prompt = encode_prompt(tokenizer, ep, history_turns, max_prompt_tokens)
            act = tokenizer.encode(" " + action) + [tokenizer.eos_id]
            out.append((prompt + act, len(prompt)))
    return out
