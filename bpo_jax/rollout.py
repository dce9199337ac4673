"""Playing episodes: the policy acts in sandboxes, and every step is recorded for learning.

Independent-group topology (GRPO, RLOO): each task is reset once, snapshotted, and forked into
`group_size` sandboxes that then play on independently; resets cost seconds and forks
milliseconds, and every algorithm gets the same treatment, so the comparison stays fair. All
live sandboxes advance in lockstep: one batched policy call per turn, one parallel
`step_many` across the pool's worker processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bpo_jax.agent import EpisodeText, encode_prompt, parse_action


@dataclasses.dataclass
class ComputeStats:
    """What a batch of rollouts cost (the currency of matched-compute comparisons)."""

    generated_tokens: int = 0
    prefilled_tokens: int = 0
    env_steps: int = 0
    resets: int = 0
    snapshots: int = 0
    restores: int = 0

    def add(self, other: ComputeStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self, prefix: str = "") -> dict[str, int]:
        return {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass
class StepRecord:
    """One agent step: the prompt it saw, the tokens it generated and what came of them."""

    prompt_ids: list[int]
    action_ids: list[int]  # Generated tokens, including the stop token when one was produced.
    logprobs: np.ndarray  # [len(action_ids)] under the sampling distribution.
    entropies: np.ndarray  # [len(action_ids)]
    action_text: str | None  # Parsed action (None: nothing parseable).
    observation: str  # What the environment answered.
    reward: float


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group: int  # Index of the task within the batch (rollouts of one task share it).
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    won: bool = False
    truncated: bool = False
    error: str | None = None  # A sandbox fault that ended the episode, if any.

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


def play(
    pool,
    policy,
    tasks: Sequence,
    group_size: int,
    *,
    rng,
    greedy: bool,
    history_turns: int,
    max_prompt_tokens: int,
    progress_bar=None,
) -> tuple[list[Trajectory], ComputeStats]:
    """Plays `group_size` episodes of each task to the end, in lockstep.

    Args:
      pool: an `envs.sandbox.SandboxPool`.
      policy: a `bpo_jax.policy.Policy` (tokenizer + sampler + parameters).
      tasks: the tasks; trajectory i * group_size + j is rollout j of task i.
      group_size: rollouts per task (forks of one reset when > 1).
      rng: a JAX PRNG key; each turn folds in the turn index.
      greedy: argmax actions (evaluation) instead of sampling.
      history_turns, max_prompt_tokens: the prompt format's budget (see bpo_jax.agent).
      progress_bar: optional tqdm bar advanced by finished episodes.

    Returns:
      The trajectories and the compute they used.
    """
    import jax  # Local: keeps this module importable without initialising JAX.

    stats = ComputeStats()
    resets = pool.reset_many(list(tasks))
    stats.resets += len(resets)
    sids: list[int] = []
    episodes: list[EpisodeText] = []
    trajs: list[Trajectory] = []
    for gi, (task, (sid, obs, info)) in enumerate(zip(tasks, resets)):
        if group_size > 1:
            handle = pool.snapshot(sid)
            stats.snapshots += 1
            forks = pool.fork(handle, group_size)
            stats.restores += group_size
            pool.release(handle)
            pool.close_sandbox(sid)
        else:
            forks = [sid]
        for fsid in forks:
            sids.append(fsid)
            ep = EpisodeText.start(obs, goal=info.get("goal"))
            episodes.append(ep)
            trajs.append(Trajectory(task_id=task.task_id, group=gi))

    active = list(range(len(trajs)))
    turn = 0
    try:
        while active:
            prompts = [
                encode_prompt(policy.tokenizer, episodes[i], history_turns, max_prompt_tokens)
                for i in active
            ]
            samples, cost = policy.act(prompts, jax.random.fold_in(rng, turn), greedy=greedy)
            stats.generated_tokens += cost["generated_tokens"]
            stats.prefilled_tokens += cost["prefilled_tokens"]
            actions = [parse_action(s.text) for s in samples]
            results = pool.step_many([(sids[i], a) for i, a in zip(active, actions)])
            stats.env_steps += len(active)
            still = []
            for i, prompt, sample, action, res in zip(active, prompts, samples, actions, results):
                t = trajs[i]
                t.steps.append(
                    StepRecord(
                        prompt_ids=prompt,
                        action_ids=sample.token_ids,
                        logprobs=sample.logprobs,
                        entropies=sample.entropies,
                        action_text=action,
                        observation=res.observation,
                        reward=float(res.reward),
                    )
                )
                episodes[i].record(action or "", res.observation)
                if res.done:
                    t.won = bool(res.info.get("won", False))
                    t.truncated = bool(res.info.get("truncated", False))
                    t.error = res.info.get("error")
                    pool.close_sandbox(sids[i])
                    if progress_bar is not None:
                        progress_bar.update(1)
                else:
                    still.append(i)
            active = still
            turn += 1
    finally:
        for i in active:
            pool.close_sandbox(sids[i])
    return trajs, stats


def success_rate(trajs: Sequence[Trajectory]) -> float:
    return float(np.mean([t.won for t in trajs])) if trajs else 0.0
