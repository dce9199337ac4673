"""Playing episodes as forests: independent groups and BPO trees, all sandboxes in lockstep.

One engine serves every topology (DESIGN.md, "Data flow"):
- independent (GRPO, RLOO, PPO; evaluation): each task is reset once and cloned
  (`SandboxPool.clone`) into `root_group` sandboxes that play on independently (resets cost
  seconds, forks milliseconds, and every algorithm gets the same treatment);
- BPO: the same root group of K0 >= 2 backbones, plus branch points chosen online. At a branch
  point the sandbox is cloned *before* the step, K - 1 more actions are sampled from the same
  prompt by duplicating its KV-cache rows (the prompt is prefilled once), each runs in a clone of
  the sandbox, and the backbone's own action is the K-th child. Children may branch again up
  to `max_depth` nested branch points and `branch_budget` branch points per backbone, while the
  task's compute budget lasts.

Roles: `loop.LockstepLoop` plays every live path of a batch in lockstep, turn by turn, its tasks
in pipelined cohorts, and owns the sandboxes and the policy calls; `forest_builder.ForestBuilder`
the segments, nodes and leaves; `planner.BranchPlanner` the branch rule, branch budgets and
spending; `posthoc` the biased post-hoc ablation. This module holds the forest's shape
(`TreeSpec`) and the entry points (`play_forest`, `play`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from bpo_jax.agent import EpisodeText, TinyAgent
from bpo_jax.rollout.branching import (
    BRANCH_SCHEDULES,
    BUDGET_MODES,
    BUDGET_UNITS,
    BranchSelector,
    CostModel,
    LengthModel,
)
from bpo_jax.rollout.forest import ComputeStats, RolloutForest, StepRecord, Trajectory
from bpo_jax.rollout.loop import LockstepLoop
from bpo_jax.rollout.planner import BranchPlanner
from bpo_jax.rollout.posthoc import posthoc_branches

__all__ = [
    "ComputeStats",
    "StepRecord",
    "TreeSpec",
    "Trajectory",
    "play",
    "play_forest",
    "success_rate",
]


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The shape of the forest one task grows.

    Attributes:
      root_group: K0, episodes started from the task's initial state (a group's size for the
        independent topology; BPO needs >= 2, or its earliest steps have no siblings).
      num_branches: K, children of a branch point (the backbone's own action + K - 1 forks).
      branch_budget: branch points per backbone over its whole subtree; 0 = independent.
      max_depth: nested branch points on any root-to-leaf path (the root not counted).
      budget: per-task compute budget in `budget_unit` (inf = unlimited); branching stops when
        the expected cost of a new branch no longer fits.
      budget_episodes: if > 0, each task's budget is this many times the cost of an episode of
        that task, measured on its own backbones as they play (`budget` is then unused): an
        independent-episode algorithm spends `group_size` episodes of each task.
      budget_unit: "tokens" (generated) or "env_steps".
      budget_mode: "target" (spend it: randomised acceptance of a branch that only partly
        fits) or "cap" (never accept one that does not fit); see `bpo_jax.rollout.planner`.
      entropy_reduce: how an action's per-token entropies become one number.
      branch_schedule: "threshold" (the rule's own test) or "spread" (each backbone's branch
        points spread over its expected remaining steps); see `bpo_jax.rollout.planner`.
      branch_scale: `spread`'s rate multiplier (adapted across batches to spend the budget).
      probe_share: `action_samples`: the fraction of a task's slack its probes may spend
        (1 = probe every eligible step that the slack can pay for); see `bpo_jax.rollout.planner`.
    """

    root_group: int
    num_branches: int = 2
    branch_budget: int = 0
    max_depth: int = 1
    budget: float = math.inf
    budget_unit: str = "tokens"
    budget_episodes: float = 0.0
    budget_mode: str = "target"
    entropy_reduce: str = "first"
    branch_schedule: str = "threshold"
    branch_scale: float = 1.0
    probe_share: float = 1.0

    def __post_init__(self):
        if self.root_group < 1:
            raise ValueError(f"root_group must be >= 1, got {self.root_group}.")
        if self.branch_budget and self.num_branches < 2:
            raise ValueError(f"num_branches must be >= 2 to branch, got {self.num_branches}.")
        if self.budget_unit not in BUDGET_UNITS:
            raise ValueError(f"budget_unit must be one of {BUDGET_UNITS}, got {self.budget_unit}.")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget_mode must be one of {BUDGET_MODES}, got {self.budget_mode}.")
        if not 0.0 < self.probe_share <= 1.0:
            raise ValueError(f"probe_share must be in (0, 1], got {self.probe_share}.")
        if self.branch_schedule not in BRANCH_SCHEDULES:
            raise ValueError(
                f"branch_schedule must be one of {BRANCH_SCHEDULES}, got {self.branch_schedule}."
            )
        if not self.branch_scale > 0:
            raise ValueError(f"branch_scale must be > 0, got {self.branch_scale}.")

    @property
    def branches(self) -> bool:
        return self.branch_budget > 0 and self.max_depth > 0


def play_forest(
    pool,
    policy,
    agent,
    tasks: Sequence,
    spec: TreeSpec,
    *,
    rng,
    selector: BranchSelector | None = None,
    greedy: bool = False,
    lengths: LengthModel | None = None,
    costs: CostModel | None = None,
    progress_bar=None,
    cohorts: int = 1,
) -> RolloutForest:
    """Plays every task's forest to the end.

    Args:
      pool: an `envs.sandbox.SandboxPool`.
      policy: an object with `prefill(prompts) -> ctx` and `sample(ctx, rng, rows=None,
        greedy=False) -> [ActionSample]` (`bpo_jax.sampler.policy.Policy`; tests use tabular ones).
      agent: the turn format (`bpo_jax.agent`: `encode(episode) -> ids`, `parse(text) ->
        action | None`), or a bare prompt function (episode -> ids; tiny-format parsing).
      tasks: the batch's tasks.
      spec: the forest's shape and budget.
      rng: a JAX PRNG key; each turn folds in its index.
      selector: the branch rule (needed when `spec` branches).
      greedy: argmax actions (evaluation).
      lengths, costs: running models of path length and tokens per action, kept by the caller
        across iterations so budgets use what earlier batches measured.
      progress_bar: optional tqdm bar advanced by finished episodes.
      cohorts: groups of tasks whose turns are pipelined, so that one samples while the others'
        environments step (1 = every path in lockstep; at most one per task). `forest.seconds`
        has "sampling", "reset" (resets and root copies), "env" (blocked on the steps) and
        "env_busy" (the steps' summed send-to-reply latencies).
    """
    if cohorts < 1:
        raise ValueError(f"cohorts must be >= 1, got {cohorts}.")
    if spec.branches and (selector is None or lengths is None):
        raise ValueError("A branching TreeSpec needs a branch selector and a LengthModel.")
    import jax  # Local: keeps this module importable without initialising JAX.

    planner = BranchPlanner(
        spec,
        selector,
        lengths or LengthModel(max_steps=1),
        costs or CostModel(spec.budget_unit),
        len(tasks),
        seed=int(jax.random.randint(jax.random.fold_in(rng, 2**20), (), 0, 2**31 - 1)),
    )
    if not hasattr(agent, "parse"):
        agent = _PromptOnly(agent)
    loop = LockstepLoop(
        pool, policy, agent, tasks, spec, planner, rng, greedy, progress_bar, cohorts=cohorts
    )
    try:
        loop.start()
        loop.run()
        if planner.posthoc:
            loop.live = posthoc_branches(loop)
            loop.run()
    finally:
        loop.release_all()
        # The contexts kept for prefix reuse would otherwise hold a cache's worth of device
        # memory through the learner's update (and are stale after it).
        if hasattr(policy, "forget_prefixes"):
            policy.forget_prefixes()
    task_ids = [t.task_id for t in loop.tasks]
    forest = loop.builder.build(task_ids, loop.stats, planner.spent, planner.task_budgets())
    forest.seconds = dict(loop.timer.seconds)
    return forest


class _PromptOnly:
    """A bare prompt function as an agent, parsing answers in the tiny format."""

    def __init__(self, encode: Callable[[EpisodeText], list[int]]):
        self.encode = encode
        self.parse = TinyAgent.parse


def prompt_encoder(tokenizer, history_turns: int, max_prompt_tokens: int) -> TinyAgent:
    """The tiny-format agent (`bpo_jax.agent.tiny`), for `play_forest`; other formats come from
    `bpo_jax.builders.make_agent`."""
    return TinyAgent(tokenizer, history_turns, max_prompt_tokens)


def play(
    pool,
    policy,
    tasks: Sequence,
    group_size: int,
    *,
    rng,
    greedy: bool,
    history_turns: int = 0,
    max_prompt_tokens: int = 0,
    agent=None,
    progress_bar=None,
    cohorts: int = 1,
) -> tuple[list[Trajectory], ComputeStats]:
    """Plays `group_size` independent episodes of each task (forks of one reset).

    The turn format is `agent`, else the tiny one with `history_turns` and `max_prompt_tokens`;
    `cohorts` as in `play_forest`.
    Trajectory i * group_size + j is rollout j of task i.
    """
    if agent is None:
        if max_prompt_tokens < 1:
            raise ValueError(
                f"play needs an agent or max_prompt_tokens >= 1, got {max_prompt_tokens}."
            )
        agent = prompt_encoder(policy.tokenizer, history_turns, max_prompt_tokens)
    forest = play_forest(
        pool,
        policy,
        agent,
        tasks,
        TreeSpec(root_group=group_size),
        rng=rng,
        greedy=greedy,
        progress_bar=progress_bar,
        cohorts=cohorts,
    )
    trajs = forest.paths()
    trajs.sort(key=lambda tr: tr.group)  # Stable: keeps each task's rollouts in finishing order.
    return trajs, forest.stats


def success_rate(trajs: Sequence[Trajectory]) -> float:
    return float(np.mean([t.won for t in trajs])) if trajs else 0.0
