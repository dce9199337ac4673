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

Every live path advances in lockstep: one prefill + one batched sampling call per turn (plus one
for the extra children of that turn's branch points) and one parallel `step_many` across the
pool's worker processes.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from bpo_jax.agent import EpisodeText, encode_prompt, parse_action
from bpo_jax.branching import (
    BUDGET_UNITS,
    BranchSelector,
    CostModel,
    LengthModel,
    PostHocTopK,
    action_entropy,
)
from bpo_jax.forest import (
    ComputeStats,
    Leaf,
    RolloutForest,
    Segment,
    StepRecord,
    Trajectory,
)

__all__ = [
    "ComputeStats",
    "StepRecord",
    "TreeSpec",
    "Trajectory",
    "play",
    "play_forest",
    "success_rate",
]

log = logging.getLogger(__name__)


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
      budget_unit: "tokens" (generated) or "env_steps".
      entropy_reduce: how an action's per-token entropies become one number.
    """

    root_group: int
    num_branches: int = 2
    branch_budget: int = 0
    max_depth: int = 1
    budget: float = math.inf
    budget_unit: str = "tokens"
    entropy_reduce: str = "first"

    def __post_init__(self):
        if self.root_group < 1:
            raise ValueError(f"root_group must be >= 1, got {self.root_group}.")
        if self.branch_budget and self.num_branches < 2:
            raise ValueError(f"num_branches must be >= 2 to branch, got {self.num_branches}.")
        if self.budget_unit not in BUDGET_UNITS:
            raise ValueError(f"budget_unit must be one of {BUDGET_UNITS}, got {self.budget_unit}.")

    @property
    def branches(self) -> bool:
        return self.branch_budget > 0 and self.max_depth > 0


@dataclasses.dataclass
class _Path:
    """A live episode: its sandbox, its text so far and where it sits in the forest."""

    sid: int
    task: int
    backbone: int
    episode: EpisodeText
    segments: list[int]  # Root to the current segment.
    depth: int = 0
    t: int = 0  # Steps taken since the task's initial state.
    # Post-hoc branching only: a snapshot and the episode text before every step.
    history: list[tuple[object, EpisodeText]] = dataclasses.field(default_factory=list)


class _Engine:
    def __init__(
        self, pool, policy, encode, tasks, spec, selector, lengths, costs, rng, greedy, bar
    ):
        self.pool, self.policy, self.encode, self.rng = pool, policy, encode, rng
        self.tasks, self.spec, self.selector = list(tasks), spec, selector
        self.lengths, self.costs, self.greedy, self.bar = lengths, costs, greedy, bar
        self.stats = ComputeStats()
        self.segments: list[Segment] = []
        self.leaves: list[Leaf] = []
        self.node_task = list(range(len(self.tasks)))
        self.spent = np.zeros((len(self.tasks),), np.float64)
        self.branches_left: list[int] = []
        self.finished_backbones: list[_Path] = []
        self.live: list[_Path] = []  # Paths with an open sandbox (closed on any exit).
        self.turn = 0

    # ---------------------------------------------------------------- building blocks

    def _new_segment(self, task: int, parent: int) -> int:
        self.segments.append(Segment(task=task, parent=parent))
        return len(self.segments) - 1

    def _new_node(self, task: int) -> int:
        self.node_task.append(task)
        return len(self.node_task) - 1

    def start(self) -> None:
        k0 = self.spec.root_group
        resets = self.pool.reset_many(self.tasks)
        self.stats.resets += len(resets)
        for ti, (sid, obs, info) in enumerate(resets):
            # The reset sandbox plays the first member; the others are live copies of it.
            sids = [sid, *self.pool.clone(sid, k0 - 1)]
            self.stats.clones += k0 - 1
            for fsid in sids:
                self.branches_left.append(self.spec.branch_budget)
                self.live.append(
                    _Path(
                        sid=fsid,
                        task=ti,
                        backbone=len(self.branches_left) - 1,
                        episode=EpisodeText.start(obs, goal=info.get("goal")),
                        segments=[self._new_segment(ti, ti)],
                    )
                )

    def _key(self, salt: int):
        import jax  # Local: keeps this module importable without initialising JAX.

        return jax.random.fold_in(self.rng, 2 * self.turn + salt)

    def _expected_cost(self, t: int) -> float:
        """Expected cost of a path's steps from its step t on (t steps taken, step t included)."""
        return self.costs.of_steps(self.lengths.remaining(t))

    # ---------------------------------------------------------------- online branching

    def _may_branch(self, live: list[_Path]) -> bool:
        spec = self.spec
        return (
            spec.branches
            and self.selector is not None
            and self.selector.online
            and any(p.depth < spec.max_depth and self.branches_left[p.backbone] for p in live)
        )

    def _choose_branches(self, live: list[_Path], entropies: np.ndarray) -> list[int]:
        """Indices into `live` of the paths that branch at this turn (online rules only)."""
        spec = self.spec
        if not (spec.branches and self.selector is not None and self.selector.online):
            return []
        self.selector.observe(entropies)
        scores = self.selector.scores(entropies, np.array([p.t for p in live]))
        eligible = [
            i
            for i, p in enumerate(live)
            if not np.isnan(scores[i])
            and p.depth < spec.max_depth
            and self.branches_left[p.backbone] > 0
        ]
        eligible.sort(key=lambda i: -scores[i])
        # Committed spending per task: what it spent before this turn plus what its live paths
        # are expected to spend from this turn's action on.
        committed = self.spent.copy()
        for p in live:
            committed[p.task] += self._expected_cost(p.t)
        chosen = []
        for i in eligible:
            p = live[i]
            extra = (spec.num_branches - 1) * self._expected_cost(p.t)
            if self.branches_left[p.backbone] > 0 and committed[p.task] + extra <= spec.budget:
                committed[p.task] += extra
                self.branches_left[p.backbone] -= 1
                chosen.append(i)
        return chosen

    def _branch_where(self, live: list[_Path], rows: list[int], entropies: np.ndarray) -> None:
        """Branches the paths the rule picks.

        The children join `live` (which also puts their sandboxes in the clean-up on error) and
        `rows` (they sample from their parent's context row).
        """
        for i in self._choose_branches(live, entropies):
            children = self._branch(live[i])
            live.extend(children)
            rows.extend([i] * len(children))

    def _branch(self, p: _Path) -> list[_Path]:
        """Turns p's current state into a node with p plus K - 1 forked children."""
        from envs.sandbox import SandboxError  # Local: the sandbox package is optional here.

        k = self.spec.num_branches
        try:
            # Copies of the live sandbox before the step (a snapshot and K - 1 forks of it in one
            # go: on the fork server, one os.fork per copy).
            sids = self.pool.clone(p.sid, k - 1)
        except SandboxError as e:
            log.warning("Branch at step %d of task %s skipped: %s", p.t, p.task, e)
            self.branches_left[p.backbone] += 1
            return []
        self.stats.clones += len(sids)
        node = self._new_node(p.task)
        self.segments[p.segments[-1]].child = node
        prefix = list(p.segments)  # Ends with the segment that now ends at the node.
        p.segments = prefix + [self._new_segment(p.task, node)]
        p.depth += 1
        return [
            dataclasses.replace(
                p,
                sid=sid,
                episode=copy.deepcopy(p.episode),
                segments=prefix + [self._new_segment(p.task, node)],
                history=[],
            )
            for sid in sids
        ]

    # ---------------------------------------------------------------- the lockstep loop

    def run(self) -> None:
        """Plays every live path to its end."""
        posthoc = self.spec.branches and isinstance(self.selector, PostHocTopK)
        live = self.live
        while live:
            prompts = [self.encode(p.episode) for p in live]
            ctx = self.policy.prefill(prompts)
            self.stats.prefilled_tokens += ctx.prefilled_tokens
            rows = list(range(len(live)))
            if self.spec.entropy_reduce == "first" or not self._may_branch(live):
                # The branch rule sees h_t only (the first token's distribution), so every
                # path's action and every child's action come from one sampling call.
                self._branch_where(live, rows, self.policy.next_token_entropy(ctx))
                samples = self.policy.sample(ctx, self._key(0), rows=rows, greedy=self.greedy)
            else:
                # "mean" / "max" look at the backbone's sampled action first (an ablation).
                samples = self.policy.sample(ctx, self._key(0), keep_context=True)
                entropies = np.array(
                    [action_entropy(s.entropies, self.spec.entropy_reduce) for s in samples]
                )
                self._branch_where(live, rows, entropies)
                samples += self.policy.sample(ctx, self._key(1), rows=rows[len(samples) :])
            tokens = sum(len(s.token_ids) for s in samples)
            self.stats.generated_tokens += tokens
            self.costs.record(len(samples), tokens)
            for p, s in zip(live, samples):
                self.spent[p.task] += self.costs.of_actions(len(s.token_ids), 1)
            if posthoc:
                for p in live:
                    if p.depth == 0:
                        p.history.append((self.pool.snapshot(p.sid), copy.deepcopy(p.episode)))
                        self.stats.snapshots += 1
            actions = [parse_action(s.text) for s in samples]
            results = self.pool.step_many([(p.sid, a) for p, a in zip(live, actions)])
            self.stats.env_steps += len(live)
            still = []
            for p, row, sample, action, res in zip(live, rows, samples, actions, results):
                self.segments[p.segments[-1]].steps.append(
                    StepRecord(
                        prompt_ids=prompts[row],
                        action_ids=sample.token_ids,
                        logprobs=sample.logprobs,
                        entropies=sample.entropies,
                        action_text=action,
                        observation=res.observation,
                        reward=float(res.reward),
                        state_text=p.episode.current or p.episode.room,
                    )
                )
                p.episode.record(action or "", res.observation)
                p.t += 1
                if res.done:
                    self._finish(p, res.info)
                else:
                    still.append(p)
            live[:] = still
            self.turn += 1

    def _finish(self, p: _Path, info: dict) -> None:
        self.leaves.append(
            Leaf(
                task=p.task,
                segments=list(p.segments),
                won=bool(info.get("won", False)),
                truncated=bool(info.get("truncated", False)),
                error=info.get("error"),
            )
        )
        self.pool.close_sandbox(p.sid)
        self.lengths.add(p.t)
        if p.history:
            self.finished_backbones.append(p)
        if self.bar is not None:
            self.bar.update(1)

    # ---------------------------------------------------------------- post-hoc ablation

    def posthoc_branches(self) -> list[_Path]:
        """Splits finished backbones at their top-entropy steps and forks there (biased)."""
        spec, new_paths = self.spec, []
        committed = self.spent.copy()
        for p in self.finished_backbones:
            steps = self.segments[p.segments[-1]].steps
            ents = [action_entropy(s.entropies, spec.entropy_reduce) for s in steps]
            # Cuts on one backbone nest, so the depth limit caps their number too.
            k = min(spec.branch_budget, spec.max_depth)
            chosen = PostHocTopK.choose_posthoc(np.array(ents), k)
            affordable = []
            for t in chosen:
                extra = (spec.num_branches - 1) * self._expected_cost(t)
                if committed[p.task] + extra <= spec.budget:
                    committed[p.task] += extra
                    affordable.append(t)
            leaf = next(lf for lf in self.leaves if lf.segments[-1] == p.segments[-1])
            new_paths += self._split_backbone(p, leaf, affordable)
            for handle, _ in p.history:
                self.pool.release(handle)
            p.history = []
        return new_paths

    def _split_backbone(self, p: _Path, leaf: Leaf, cut_steps: list[int]) -> list[_Path]:
        seg_id = p.segments[-1]
        steps = self.segments[seg_id].steps
        chain, forks = [seg_id], []
        self.segments[seg_id].steps = steps[: cut_steps[0]] if cut_steps else steps
        for j, t in enumerate(cut_steps):
            node = self._new_node(p.task)
            self.segments[chain[-1]].child = node
            end = cut_steps[j + 1] if j + 1 < len(cut_steps) else len(steps)
            cont = self._new_segment(p.task, node)
            self.segments[cont].steps = steps[t:end]
            handle, episode = p.history[t]
            sids = self.pool.fork(handle, self.spec.num_branches - 1)
            self.stats.restores += len(sids)
            for sid in sids:
                forks.append(
                    _Path(
                        sid=sid,
                        task=p.task,
                        backbone=p.backbone,
                        episode=copy.deepcopy(episode),
                        segments=chain[:] + [self._new_segment(p.task, node)],
                        depth=1,
                        t=t,
                    )
                )
            chain.append(cont)
        leaf.segments = p.segments[:-1] + chain
        return forks


def play_forest(
    pool,
    policy,
    encode: Callable[[EpisodeText], list[int]],
    tasks: Sequence,
    spec: TreeSpec,
    *,
    rng,
    selector: BranchSelector | None = None,
    greedy: bool = False,
    lengths: LengthModel | None = None,
    costs: CostModel | None = None,
    progress_bar=None,
) -> RolloutForest:
    """Plays every task's forest to the end.

    Args:
      pool: an `envs.sandbox.SandboxPool`.
      policy: an object with `prefill(prompts) -> ctx` and `sample(ctx, rng, rows=None,
        greedy=False) -> [ActionSample]` (`bpo_jax.policy.Policy`; tests use tabular ones).
      encode: the prompt of an episode so far, as token ids.
      tasks: the batch's tasks.
      spec: the forest's shape and budget.
      rng: a JAX PRNG key; each turn folds in its index.
      selector: the branch rule (needed when `spec` branches).
      greedy: argmax actions (evaluation).
      lengths, costs: running models of path length and tokens per action, kept by the caller
        across iterations so budgets use what earlier batches measured.
      progress_bar: optional tqdm bar advanced by finished episodes.
    """
    if spec.branches and (selector is None or lengths is None):
        raise ValueError("A branching TreeSpec needs a branch selector and a LengthModel.")
    engine = _Engine(
        pool,
        policy,
        encode,
        tasks,
        spec,
        selector,
        lengths or LengthModel(max_steps=1),
        costs or CostModel(spec.budget_unit),
        rng,
        greedy,
        progress_bar,
    )
    try:
        engine.start()
        engine.run()
        if spec.branches and isinstance(selector, PostHocTopK):
            engine.live = engine.posthoc_branches()
            engine.run()
    finally:  # On an exception: free every snapshot and sandbox this call still holds.
        for p in engine.live + engine.finished_backbones:
            for handle, _ in p.history:
                pool.release(handle)
            p.history = []
        for p in engine.live:
            pool.close_sandbox(p.sid)
    return RolloutForest(
        task_ids=[t.task_id for t in engine.tasks],
        segments=engine.segments,
        leaves=engine.leaves,
        node_task=engine.node_task,
        stats=engine.stats,
        task_cost=engine.spent,
    )


def prompt_encoder(tokenizer, history_turns: int, max_prompt_tokens: int):
    """The agent's prompt of an episode (see `bpo_jax.agent`), as a function for `play_forest`."""
    return lambda episode: encode_prompt(tokenizer, episode, history_turns, max_prompt_tokens)


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
    """Plays `group_size` independent episodes of each task (forks of one reset).

    Trajectory i * group_size + j is rollout j of task i.
    """
    forest = play_forest(
        pool,
        policy,
        prompt_encoder(policy.tokenizer, history_turns, max_prompt_tokens),
        tasks,
        TreeSpec(root_group=group_size),
        rng=rng,
        greedy=greedy,
        progress_bar=progress_bar,
    )
    trajs = forest.paths()
    trajs.sort(key=lambda tr: tr.group)  # Stable: keeps each task's rollouts in finishing order.
    return trajs, forest.stats


def success_rate(trajs: Sequence[Trajectory]) -> float:
    return float(np.mean([t.won for t in trajs])) if trajs else 0.0
