"""One RL iteration: rollouts as a forest -> advantages -> clipped policy-gradient updates.

Every algorithm goes through the same pipeline (DESIGN.md, "Data flow"): the rollout engine
returns a forest (independent groups are depth-1 forests, BPO trees are deeper), the estimator
named by the algorithm (`config.ALGOS`) gives every step an advantage, `RolloutForest.
step_weights` gives it a loss weight, and each step becomes one training sequence (its prompt
followed by its action tokens). A step shared by several leaves enters the loss once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from bpo_jax import learner
from bpo_jax.branching import CostModel, LengthModel, make_selector
from bpo_jax.config import ALGOS, ExperimentConfig
from bpo_jax.estimators import step_advantages
from bpo_jax.forest import RolloutForest
from bpo_jax.rollout import TreeSpec, play_forest, prompt_encoder


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class Example:
    """One training sequence: a step's prompt followed by the tokens the policy generated."""

    tokens: list[int]
    action_start: int
    advantage: float
    weight: float = 1.0  # Loss weight (see `RolloutForest.step_weights`).


def forest_examples(forest: RolloutForest, adv: np.ndarray, weights: np.ndarray) -> list[Example]:
    """One example per step that generated tokens, with its advantage and loss weight."""
    out = []
    for step, a, w in zip(forest.steps(), adv, weights):
        if step.action_ids:
            out.append(
                Example(step.prompt_ids + step.action_ids, len(step.prompt_ids), float(a), float(w))
            )
    return out


def minibatches(items: Sequence, size: int, rng: np.random.Generator):
    order = rng.permutation(len(items))
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i : i + size]]


class RLUpdater:
    """Holds the jitted update and scoring functions for the clipped policy gradient."""

    def __init__(
        self, graphdef, cfg: ExperimentConfig, pad_id: int, write: Callable[[int, dict], None]
    ):
        t = cfg.train
        self.cfg = cfg
        self.pad_id = pad_id
        self.write = write
        self.optimizer = learner.make_optimizer(t.lr, t.weight_decay, t.b1, t.b2, t.grad_clip)
        # The policy optimised is the tempered one the rollouts sample from.
        temp = cfg.sampler.temperature

        def loss(fn, params, batch, ref_logprobs=None):
            return learner.pg_loss(
                fn,
                params,
                batch,
                clip_eps=t.clip_eps,
                loss_agg=t.loss_agg,
                temperature=temp,
                kl_coef=t.kl_coef,
                ref_logprobs=ref_logprobs,
            )

        self.step_fn = learner.make_train_step(graphdef, self.optimizer, loss)
        self.logprob_fn = learner.make_logprob_fn(graphdef, temp)

    def update(
        self,
        state: learner.TrainState,
        examples: list[Example],
        seed: Sequence[int],
        ref_params=None,
    ):
        """Runs `train.epochs` passes of minibatch updates; returns (state, per-update metrics).

        `ref_params` (the frozen reference policy) is needed when `train.kl_coef > 0`.
        """
        if self.cfg.train.kl_coef > 0 and ref_params is None:
            raise ValueError("config.train.kl_coef > 0 needs the reference policy's parameters.")
        t = self.cfg.train
        rng = np.random.default_rng(list(seed))
        # Behaviour log-probs for every example, from the parameters the rollouts used, before
        # any update: with several minibatches or epochs the ratios are then true PPO ratios.
        batches = []
        for chunk in minibatches(examples, t.minibatch_size, rng):
            length = round_up(max(len(e.tokens) for e in chunk), self.cfg.sampler.length_bucket)
            batch = learner.pad_batch(
                [e.tokens for e in chunk],
                [e.action_start for e in chunk],
                batch_size=t.minibatch_size,
                length=length,
                pad_id=self.pad_id,
                advantages=[e.advantage for e in chunk],
                weights=[e.weight for e in chunk],
            )
            old_lp, _ = self.logprob_fn(state.params, batch.tokens)
            extra = ()
            if t.kl_coef > 0:
                extra = (self.logprob_fn(ref_params, batch.tokens)[0],)
            batches.append(
                (
                    dataclasses.replace(batch, old_logprobs=np.asarray(old_lp) * batch.loss_mask),
                    extra,
                )
            )
        history = []
        for epoch in range(t.epochs):
            order = rng.permutation(len(batches)) if epoch else range(len(batches))
            for i in order:
                batch, extra = batches[i]
                state, metrics = self.step_fn(state, batch, *extra)
                metrics = {k: float(v) for k, v in metrics.items()}
                history.append(metrics)
                self.write(
                    int(state.step),
                    {"update/grad_norm": metrics["grad_norm"], "update/loss": metrics["loss"]},
                )
        return state, history


@dataclasses.dataclass
class RolloutState:
    """What the rollouts carry from one iteration to the next: the branch rule's running
    statistics and the measured episode lengths and tokens per action (for budgets)."""

    selector: object
    lengths: LengthModel
    costs: CostModel

    @classmethod
    def create(cls, cfg: ExperimentConfig) -> RolloutState:
        r = cfg.rollout
        selector = make_selector(
            r.selector,
            quantile=r.entropy_quantile,
            window=r.entropy_window,
            branch_prob=r.branch_prob,
            interval=r.interval,
            seed=cfg.seed,
        )
        costs = CostModel(r.budget_unit, tokens_per_action=cfg.agent.max_action_tokens / 2)
        return cls(selector, LengthModel(cfg.env.max_steps), costs)

    def dump(self) -> dict:
        """The running statistics as JSON-able data (saved with checkpoints)."""
        recent = getattr(self.selector, "recent", None)
        return {
            "lengths": list(self.lengths.lengths),
            "actions": self.costs.actions,
            "tokens": self.costs.tokens,
            "recent_entropies": list(recent) if recent is not None else [],
        }

    def load(self, data: dict) -> None:
        self.lengths.lengths.extend(data.get("lengths", []))
        self.costs.record(data.get("actions", 0), data.get("tokens", 0))
        recent = getattr(self.selector, "recent", None)
        if recent is not None:
            recent.extend(data.get("recent_entropies", []))

    def budget(self, cfg: ExperimentConfig) -> float:
        """Per-task budget: the configured one, or what `group_size` episodes should cost."""
        if cfg.rollout.budget > 0:
            return float(cfg.rollout.budget)
        mean_len = self.lengths.mean_length()
        return cfg.train.group_size * self.costs.of_steps(mean_len)


def tree_spec(cfg: ExperimentConfig, state: RolloutState) -> TreeSpec:
    """The forest every task grows under `cfg.train.algo`."""
    topology, _ = ALGOS[cfg.train.algo]
    r = cfg.rollout
    if topology == "independent":
        return TreeSpec(root_group=cfg.train.group_size, budget_unit=r.budget_unit)
    return TreeSpec(
        root_group=r.root_group,
        num_branches=r.num_branches,
        branch_budget=r.branch_budget,
        max_depth=r.max_depth,
        budget=state.budget(cfg),
        budget_unit=r.budget_unit,
        entropy_reduce=r.entropy_reduce,
    )


def forest_advantages(forest: RolloutForest, cfg: ExperimentConfig, critic=None, params=None):
    """Per-step advantages (in `forest.steps()` order) and diagnostics."""
    _, estimator = ALGOS[cfg.train.algo]
    t = cfg.train
    num_steps = sum(len(s.steps) for s in forest.segments)
    if estimator == "gae":
        from bpo_jax.critic import gae

        steps = forest.steps()
        feats = critic.features(params, [s.prompt_ids for s in steps])
        values = critic.values(feats)
        f = forest.to_forest()
        pad = len(f.step_segment) - num_steps
        adv, returns = gae(
            f.step_segment,
            f.step_reward,
            np.concatenate([values, np.zeros((pad,), np.float32)]),
            t.gamma,
            t.gae_lambda,
        )
        adv, returns = np.asarray(adv)[:num_steps], np.asarray(returns)[:num_steps]
        value_loss = critic.fit(feats, returns, seed=len(steps))
        adv = (adv - adv.mean()) / (adv.std() + t.adv_eps)  # PPO's batch normalisation.
        return adv, {"train/value_loss": value_loss, "train/value_mean": float(values.mean())}
    f = forest.to_forest(with_obs_ids=estimator == "gigpo")
    options = {}
    if estimator in ("bpo", "rloo", "grpo"):
        options = {"normalize": t.normalize, "eps": t.adv_eps}
        if estimator == "grpo":
            options["normalize"] = "none"  # GRPO divides by the group std by definition.
    elif estimator == "gigpo":
        options = {"eps": t.adv_eps}
    adv = np.asarray(step_advantages(f, estimator, **options))[:num_steps]
    return adv, {}


def rl_iteration(
    pool,
    policy,
    updater: RLUpdater,
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
    t = cfg.train
    rollout_state = rollout_state or RolloutState.create(cfg)
    t0 = time.time()
    policy.params = state.params
    spec = tree_spec(cfg, rollout_state)
    forest = play_forest(
        pool,
        policy,
        prompt_encoder(policy.tokenizer, cfg.agent.history_turns, cfg.agent.max_prompt_tokens),
        tasks,
        spec,
        rng=rng,
        selector=rollout_state.selector,
        lengths=rollout_state.lengths,
        costs=rollout_state.costs,
    )
    t_rollout = time.time() - t0
    adv, extra_metrics = forest_advantages(forest, cfg, critic, state.params)
    weights = forest.step_weights(t.step_weighting)
    examples = forest_examples(forest, adv, weights)
    state, history = updater.update(state, examples, seed=(cfg.seed, it, 1), ref_params=ref_params)
    metrics = {
        "train/iteration": it + 1,
        **rollout_metrics(forest, adv),
        "train/num_sequences": len(examples),
        "train/budget_per_task": spec.budget if math.isfinite(spec.budget) else 0.0,
        "train/rollout_seconds": t_rollout,
        "train/iteration_seconds": time.time() - t0,
        **extra_metrics,
        **forest.stats.as_dict("compute/"),
    }
    if history:
        for key in history[0]:
            metrics[f"train/{key}_mean"] = float(np.mean([h[key] for h in history]))
    return state, metrics


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
        "compute/generated_per_leaf": forest.stats.generated_tokens / leaves,
        "compute/prefilled_per_leaf": forest.stats.prefilled_tokens / leaves,
    }
