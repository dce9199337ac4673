"""One RL iteration, in stages: rollouts -> (critic) -> advantages -> examples -> update.

Every algorithm goes through the same pipeline (DESIGN.md, "Data flow"): the rollout engine
returns a forest (independent groups are depth-1 forests, BPO trees are deeper); for an
algorithm with a critic (PPO) the critic's values are computed and the critic is fitted, as a
stage of its own; the estimator the algorithm names (`bpo_jax.algorithms`) gives every step an
advantage; `RolloutForest.step_weights` gives it a loss weight; and each step becomes one
training sequence (its prompt followed by its action tokens), so a step shared by several leaves
enters the loss once. `learner.RLUpdater` runs the clipped policy-gradient updates.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from bpo_jax import learner
from bpo_jax.builders import make_agent
from bpo_jax.config import ExperimentConfig
from bpo_jax.estimators import gae, step_advantages, tree_advantages
from bpo_jax.io.metrics import BRANCH_STEP_PREFIX
from bpo_jax.learner import Example
from bpo_jax.multihost import shares
from bpo_jax.parallel import distributed
from bpo_jax.rollout.branching import CostModel, LengthModel, Measurements, make_selector, measure
from bpo_jax.rollout.concentration import concentration_metrics
from bpo_jax.rollout.design import Choice, Design
from bpo_jax.rollout.design_stats import TreeChooser
from bpo_jax.rollout.engine import TreeSpec, play_forest
from bpo_jax.rollout.explained import ExplainedShare, batch_metrics, measure_parts
from bpo_jax.rollout.forest import ForestArrays, RolloutForest
from bpo_jax.rollout.timing import CompileClock, env_floor_metrics

SHRINK_ESTIMATOR = "bpo_shrink"  # Its lam is fed from earlier batches' f (`RolloutState.shrink`).


def forest_examples(forest: RolloutForest, adv: np.ndarray, weights: np.ndarray) -> list[Example]:
    """One example per step that generated tokens, with its advantage and loss weight."""
    out = []
    for step, a, w in zip(forest.steps(), adv, weights):
        if step.action_ids:
            out.append(
                Example(step.prompt_ids + step.action_ids, len(step.prompt_ids), float(a), float(w))
            )
    return out


@dataclasses.dataclass
class RolloutState:
    """What the rollouts carry from one iteration to the next: the branch rule's running
    statistics, the measured episode lengths and tokens per action (for budgets), for tree
    algorithms f's parts over the batches so far (`rollout.explained`; `bpo_shrink`'s lam comes
    from them), and with `rollout.tree=auto` what earlier batches measured for the choice of
    the tree's shape."""

    selector: object
    lengths: LengthModel
    costs: CostModel
    branch_scale: float = 1.0  # `spread` schedule's rate multiplier (adapted like a rate).
    chooser: TreeChooser | None = None  # rollout.tree=auto (`design_stats.TreeChooser`).
    choice: Choice | None = None  # The last batch's chosen design (None: the configured tree).
    explained: ExplainedShare | None = None  # Tree algorithms: f's parts so far.
    shrink: float | None = None  # `bpo_shrink`'s lam for the batch, from earlier batches only.

    @classmethod
    def create(cls, cfg: ExperimentConfig) -> RolloutState:
        r = cfg.rollout
        selector = make_selector(
            r.selector,
            quantile=r.entropy_quantile,
            window=r.entropy_window,
            branch_prob=r.branch_prob,
            interval=r.interval,
            steps=r.branch_steps,
            probes=r.probe_samples,
            per_step=r.entropy_per_step,
            seed=cfg.seed,
        )
        costs = CostModel(r.budget_unit, tokens_per_action=cfg.agent.max_action_tokens / 2)
        chooser = None
        if r.tree == "auto" and cfg.algorithm.branches:
            chooser = TreeChooser(
                cfg.train.group_size,
                cfg.env.max_steps,
                r.budget_unit,
                explore_every=r.auto_explore,
            )
        measured = ExplainedShare() if cfg.algorithm.branches else None
        return cls(
            selector, LengthModel(cfg.env.max_steps), costs, chooser=chooser, explained=measured
        )

    def dump(self) -> dict:
        """The running statistics as JSON-able data (saved with checkpoints)."""
        history = getattr(self.selector, "history", None)
        return {
            "lengths": list(self.lengths.lengths),
            "actions": self.costs.actions,
            "tokens": self.costs.tokens,
            "episode_costs": list(self.costs.episodes),
            "scores": history.dump() if history is not None else {},
            "selector_rate": self.selector.rate(),
            "branch_scale": self.branch_scale,
            "tree_chooser": self.chooser.dump() if self.chooser is not None else None,
            "explained": self.explained.dump() if self.explained is not None else None,
        }

    def measuring_copy(self, seed: int | None = None) -> tuple[RolloutState, Measurements]:
        """A copy of this state for a share to play on, and the record of what that play feeds
        its statistics (`branching.measure`); this state is left as it is.

        Args:
          seed: if given, the copy's branch rule draws from its own random stream started from
            it (`BranchSelector.reseed`), not from a copy of this state's: shares that started
            from one state would otherwise draw the same numbers, batch after batch.
        """
        local = copy.deepcopy(self)
        if seed is not None:
            local.selector.reseed(seed)
        return local, measure(local.selector, local.lengths, local.costs)

    def absorb(self, shares_measured: Sequence[Measurements]) -> None:
        """Adds what a batch's shares measured, in share order, to the running statistics.

        The shares played on copies of this state as it stood at the batch's start; their
        measurements are merged as plain data (`Measurements.merged`) and fed once, so the
        result depends on the shares' order only, not on which process played which.
        """
        Measurements.merged(shares_measured).apply_to(self.selector, self.lengths, self.costs)

    def loaded(self, data: dict) -> RolloutState:
        """This (fresh) state with the statistics `dump` wrote added; returns self."""
        self.lengths.lengths.extend(data.get("lengths", []))
        self.costs.record(data.get("actions", 0), data.get("tokens", 0))
        self.costs.episodes.extend(data.get("episode_costs", []))
        if data.get("selector_rate") is not None:
            self.selector.set_rate(data["selector_rate"])
        self.branch_scale = float(data.get("branch_scale", self.branch_scale))
        if self.chooser is not None:
            self.chooser.load(data.get("tree_chooser"))
        if self.explained is not None:  # Absent from older checkpoints: f from here on.
            self.explained.load(data.get("explained"))
        history = getattr(self.selector, "history", None)
        if history is not None:
            history.load(data.get("scores", {}))
            history.pooled.extend(data.get("recent_entropies", []))  # Older checkpoints.
        return self

    def budget(self, cfg: ExperimentConfig) -> float:
        """Per-task budget: the configured one, or `group_size` times the measured cost of an
        independent episode (before any has been measured: of one of mean length). With
        `budget_reference=task` the planner measures it per task on the task's own backbones
        and this is only the prior it starts from."""
        if cfg.rollout.budget > 0:
            return float(cfg.rollout.budget)
        episode = self.costs.mean_episode()
        if episode is None:
            episode = self.costs.of_steps(self.lengths.mean_length())
        return cfg.train.group_size * episode

    def plan(self, cfg: ExperimentConfig) -> Choice | None:
        """`rollout.tree=auto`: the next batch's design, from the batches recorded so far only
        (`TreeChooser.next_design`); None: the configured tree."""
        if self.chooser is None:
            return None
        episodes, episode = cfg.train.group_size, self.costs.mean_episode()
        if cfg.rollout.budget > 0 and episode:
            episodes = cfg.rollout.budget / episode
        return self.chooser.next_design(episodes)

    def adapt(self, cfg: ExperimentConfig, forest: RolloutForest) -> None:
        """After a tree batch: moves the branch rule's rate towards spending the budget."""
        ratios = forest.spend_ratio
        gain = cfg.rollout.rate_gain
        if not (cfg.algorithm.branches and gain > 0 and ratios.size):
            return
        ratio = float(np.mean(ratios))
        if cfg.rollout.branch_schedule == "spread":
            # Multiplicative, so the scale stays positive: 20% under-spent -> x e^(gain * 0.2 * 5).
            self.branch_scale = float(
                np.clip(self.branch_scale * np.exp(5.0 * gain * (1.0 - ratio)), 0.05, 20.0)
            )
        else:
            self.selector.adjust_rate(ratio, gain)


def tree_spec(cfg: ExperimentConfig, state: RolloutState, design: Design | None = None) -> TreeSpec:
    """The forest every task grows under `cfg.train.algo`, in the shape of `design` if given
    (`rollout.tree=auto`; its branch steps are the rule, `Design.selector`)."""
    r = cfg.rollout
    if not cfg.algorithm.branches:
        return TreeSpec(root_group=cfg.train.group_size, budget_unit=r.budget_unit)
    shape = {
        "root_group": r.root_group,
        "num_branches": r.num_branches,
        "branch_budget": r.branch_budget,
        "max_depth": r.max_depth,
        "branch_schedule": r.branch_schedule,
    }
    if design is not None:
        shape = {**design.spec_fields(), "branch_schedule": "threshold"}
    return TreeSpec(
        **shape,
        budget=state.budget(cfg),
        budget_episodes=(
            cfg.train.group_size if r.budget == 0 and r.budget_reference == "task" else 0.0
        ),
        budget_unit=r.budget_unit,
        budget_mode=r.budget_mode,
        entropy_reduce=r.entropy_reduce,
        branch_scale=state.branch_scale,
        probe_share=r.probe_share,
    )


def play_batch(pool, policy, tasks, cfg: ExperimentConfig, state: RolloutState, rng, agent=None):
    """Stage 1: every task's forest under the algorithm's topology (returns forest, spec).

    The tasks are played in `mesh.task_shards` shares (`bpo_jax.multihost.shares`), each host its
    own; every host returns the whole batch's forest. Each share plays on a copy of `state` as
    it stood at the batch's start and returns what it measured (`RolloutState.measuring_copy`);
    `state` then gains every share's measurements, in share order (`RolloutState.absorb`).
    With `rollout.tree=auto` the batch's design is chosen before it plays, from earlier batches
    (`RolloutState.plan`), and the batch is recorded for later ones after it played; so is
    `bpo_shrink`'s lam (`RolloutState.shrink`), and a tree batch's f parts are added after it
    (`rollout.explained`). `agent`: the turn format (default `builders.make_agent`).
    """
    state.choice = state.plan(cfg)
    state.shrink = state.explained.shrink_lambda() if state.explained is not None else None
    design = state.choice.design if state.choice is not None else None
    spec = tree_spec(cfg, state, design)
    encode = agent if agent is not None else make_agent(cfg, policy.tokenizer)
    num = distributed.num_shares(cfg.mesh.task_shards)
    # One share on one process: play on the running statistics themselves (they end as a copy's
    # absorbed measurements would leave them), and the rule's random stream runs on over batches.
    direct = num == 1 and distributed.process_count() == 1

    def play(share_tasks, key, _share, share_policy):
        if direct:
            local, measured = state, None
        else:  # The rule's random stream from the share's key (`RolloutState.measuring_copy`).
            local, measured = state.measuring_copy(seed=stream_seed(key))
        forest = play_forest(
            pool,
            share_policy,
            encode,
            share_tasks,
            spec,
            rng=key,
            selector=design.selector() if design is not None else local.selector,
            lengths=local.lengths,
            costs=local.costs,
            cohorts=cfg.rollout.overlap_cohorts,
        )
        return forest, measured

    played = shares.play_in_shares(tasks, num, rng, policy, play)
    if not direct:
        state.absorb([measured for _, (_, measured) in played])
    forest = shares.merge_forests([f for _, (f, _) in played])
    parts = None  # Measured on the merged forest: every host the same, nothing exchanged.
    if state.explained is not None:
        parts = measure_parts(forest)
        state.explained.add(parts)
    if state.chooser is not None:
        state.chooser.record(forest, parts)
    if design is None:  # A design's steps are its rule: no rate to adapt.
        state.adapt(cfg, forest)
    return forest, spec


def stream_seed(key) -> int:
    """A seed for a share's branch-rule stream, from its key (independent of the planner's,
    which `play_forest` draws at `fold_in(key, 2**20)`)."""
    return int(jax.random.randint(jax.random.fold_in(key, 2**21), (), 0, 2**31 - 1))


def fit_critic(critic, params, forest: RolloutForest, arrays: ForestArrays, cfg: ExperimentConfig):
    """Stage 2 (algorithms with a critic): V of every step, then the value head's regression.

    The values are computed before the fit, so the advantages use the critic that has not seen
    this batch's returns.

    Returns:
      (values [T] padded like `arrays`, metrics).
    """
    t = cfg.train
    feats = critic.features(params, [s.prompt_ids for s in forest.steps()])
    values = arrays.pad_steps(critic.values(feats))
    f = arrays.forest
    _, returns = gae(f.step_segment, f.step_reward, values, t.gamma, t.gae_lambda)
    value_loss = critic.fit(feats, arrays.unpad_steps(returns), seed=arrays.num_steps)
    return values, {
        "train/value_loss": value_loss,
        "train/value_mean": float(values[: arrays.num_steps].mean()),
    }


def forest_advantages(
    forest: RolloutForest, cfg: ExperimentConfig, critic=None, params=None, shrink=None
):
    """Stages 2-3: per-step advantages (in `forest.steps()` order) and diagnostics.

    `shrink`: `bpo_shrink`'s lam (`RolloutState.shrink`; None: the estimator's default).
    """
    algo = cfg.algorithm
    arrays = forest.arrays(with_obs_ids=algo.uses_obs_ids)
    options, metrics = algo.estimator_options(cfg.train), {}
    if algo.estimator == SHRINK_ESTIMATOR and shrink is not None:
        options["shrink"] = shrink
    if algo.needs_critic:
        if critic is None:
            raise ValueError(f"train.algo={algo.name!r} needs a critic.")
        options["values"], metrics = fit_critic(critic, params, forest, arrays, cfg)
    adv = step_advantages(arrays.forest, algo.estimator, **options)
    return arrays.unpad_steps(adv), metrics


def rl_iteration(
    pool,
    policy,
    updater: learner.RLUpdater,
    state: learner.TrainState,
    tasks,
    it: int,
    rng,
    ref_params=None,
    rollout_state: RolloutState | None = None,
    critic=None,
) -> tuple[learner.TrainState, dict]:
    """Grows every task's forest, computes advantages and updates the policy."""
    cfg = updater.cfg
    rollout_state = rollout_state or RolloutState.create(cfg)
    compile0 = CompileClock.total()
    t0 = time.time()
    policy.params = state.params
    forest, spec = play_batch(pool, policy, tasks, cfg, rollout_state, rng)
    t_rollout = time.time() - t0
    adv, extra_metrics = forest_advantages(forest, cfg, critic, state.params, rollout_state.shrink)
    t1 = time.time()
    examples = forest_examples(forest, adv, forest.step_weights(cfg.train.step_weighting))
    state, history = updater.update(state, examples, seed=(cfg.seed, it, 1), ref_params=ref_params)
    metrics = {
        "train/iteration": it + 1,
        **rollout_metrics(forest, adv),
        "train/num_sequences": len(examples),
        "train/budget_per_task": (
            float(np.mean(forest.budget)) if np.all(np.isfinite(forest.budget)) else 0.0
        ),
        "train/rollout_seconds": t_rollout,
        "train/update_seconds": time.time() - t1,
        "train/iteration_seconds": time.time() - t0,
        # Where the rollout's time went, and JAX compilation during the iteration (inside
        # whichever phase first ran a program).
        **{f"time/{k}_seconds": v for k, v in forest.seconds.items()},
        **env_floor_metrics(forest.seconds, forest.stats.env_steps, pool.num_workers, t_rollout),
        "time/compile_seconds": CompileClock.total() - compile0,
        **extra_metrics,
        **design_metrics(rollout_state),
        **measured_metrics(cfg, rollout_state, forest),
        **forest.stats.as_dict("compute/"),
    }
    # Means over the update's steps; a step on a zero gradient (no row with an advantage)
    # reports its loss and norms but no entropy or ratio statistics.
    for key in dict.fromkeys(k for h in history for k in h):
        metrics[f"train/{key}_mean"] = float(np.mean([h[key] for h in history if key in h]))
    return state, metrics


def measured_metrics(cfg: ExperimentConfig, state: RolloutState, forest: RolloutForest) -> dict:
    """Tree algorithms: the batch's f (`rollout.explained`), `bpo_shrink`'s lam, and how
    concentrated the branch points are (`rollout.concentration`)."""
    if state.explained is None or state.explained.last is None:
        return {}
    out = {**batch_metrics(state.explained.last), **concentration_metrics(forest)}
    if cfg.algorithm.estimator == SHRINK_ESTIMATOR:
        out["train/shrink_lambda"] = state.shrink
    return out


def design_metrics(state: RolloutState) -> dict:
    """`rollout.tree=auto`: the batch's design (prior = 1 when it played the configured tree)
    and its predicted gradient-variance ratio against RLOO(group_size)."""
    if state.chooser is None:
        return {}
    if state.choice is None:
        return {"train/design_prior": 1.0}
    d = state.choice.design
    return {
        "train/design_prior": 0.0,
        "train/design_root_group": d.root_group,
        "train/design_num_branches": d.num_branches,
        "train/design_levels": len(d.depths),
        "train/design_first_step": d.depths[0] if d.depths else 0,
        "train/design_predicted_ratio": float(state.choice.ratio),
    }


def branch_point_spreads(forest: RolloutForest) -> np.ndarray:
    """Per branch point, the population variance of its children's values (subtree mean
    returns): an estimate of Var(E[R | h, a]) at the node, what its baseline takes out."""
    if not forest.num_branch_points:
        return np.zeros((0,))
    f = forest.arrays().forest
    values, _ = tree_advantages(f.seg_parent, f.seg_child, f.seg_reward, f.num_nodes, "rloo")
    values = np.asarray(values, np.float64)
    children: dict[int, list[float]] = {}
    roots = len(forest.task_ids)
    for s, seg in enumerate(forest.segments):
        if seg.parent >= roots:
            children.setdefault(seg.parent, []).append(values[s])
    return np.array([np.var(v) for v in children.values()])


def branch_steps(forest: RolloutForest) -> list[int]:
    """The step of every branch point, in node order: the environment steps taken on the path
    from its root to it (its children's first actions are that step's)."""
    roots = len(forest.task_ids)
    ending = {seg.child: seg for seg in forest.segments if seg.child >= roots}
    steps: dict[int, int] = {}

    def step_of(node: int) -> int:
        if node < roots:
            return 0
        if node not in steps:
            seg = ending[node]
            steps[node] = step_of(seg.parent) + len(seg.steps)
        return steps[node]

    return [step_of(node) for node in sorted(ending)]


def branch_metrics(forest: RolloutForest) -> dict:
    """Whether branch points carry signal: the share of branch points whose children's values
    differ, and the mean spread of the children's values (`branch_point_spreads`); and where
    they are: how many at each step (`branch_steps`)."""
    spread = branch_point_spreads(forest)
    if not spread.size:
        return {}
    at_step = collections.Counter(branch_steps(forest))
    return {
        "train/branch_points_divergent": float(np.mean(spread > 1e-12)),
        "train/branch_children_var": float(spread.mean()),
        **{f"{BRANCH_STEP_PREFIX}{t}": n for t, n in sorted(at_step.items())},
    }


def rollout_metrics(forest: RolloutForest, adv: np.ndarray) -> dict:
    """Success and return as estimates for the policy (leaves weighted by their path mass)."""
    mass = forest.leaf_mass()
    n_tasks = len(forest.task_ids)
    won = np.array([leaf.won for leaf in forest.leaves], np.float64)
    returns = np.array(
        [sum(forest.segments[s].reward for s in leaf.segments) for leaf in forest.leaves]
    )
    lengths = np.array(
        [sum(len(forest.segments[s].steps) for s in leaf.segments) for leaf in forest.leaves]
    )
    leaves = max(len(forest.leaves), 1)
    return {
        "train/success": float(np.sum(mass * won) / n_tasks),
        "train/return": float(np.sum(mass * returns) / n_tasks),
        "train/episode_len": float(np.sum(mass * lengths) / n_tasks),
        "train/leaves": len(forest.leaves),
        "train/branch_points": forest.num_branch_points,
        "train/steps_with_signal": float(np.mean(np.abs(adv) > 1e-8)) if adv.size else 0.0,
        "train/faults": sum(leaf.error is not None for leaf in forest.leaves),
        "compute/task_cost_mean": float(np.mean(forest.task_cost)),
        **spend_metrics(forest),
        **branch_metrics(forest),
        "compute/generated_per_leaf": forest.stats.generated_tokens / leaves,
        "compute/prefilled_per_leaf": forest.stats.prefilled_tokens / leaves,
    }


def spend_metrics(forest: RolloutForest) -> dict:
    """Spent / budget over the batch's tasks (tree algorithms with a finite budget)."""
    r = forest.spend_ratio
    if not r.size:
        return {}
    return {
        "compute/spend_ratio": float(np.mean(r)),
        "compute/spend_ratio_min": float(np.min(r)),
        "compute/spend_ratio_max": float(np.max(r)),
    }
