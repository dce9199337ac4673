"""One RL iteration: group rollouts -> advantages -> clipped policy-gradient updates.

Independent-group topology (GRPO, RLOO): per task, `group_size` rollouts forked from one reset;
each trajectory's advantage comes from the estimator kernels (a depth-1 forest per task) and is
given to every action token of every step of that trajectory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from bpo_jax import learner
from bpo_jax.config import ExperimentConfig
from bpo_jax.estimators import tree_advantages
from bpo_jax.rollout import Trajectory, play, success_rate


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def group_advantages(returns_ng: np.ndarray, algo: str, eps: float) -> np.ndarray:
    """Per-trajectory advantages for N tasks x G rollouts (a depth-1 forest per task)."""
    n, g = returns_ng.shape
    seg_parent = np.repeat(np.arange(n, dtype=np.int32), g)
    seg_child = np.full((n * g,), -1, np.int32)
    rewards = returns_ng.reshape(-1).astype(np.float32)
    _, adv = tree_advantages(seg_parent, seg_child, rewards, num_nodes=n, method=algo, eps=eps)
    return np.asarray(adv).reshape(n, g)


@dataclasses.dataclass
class Example:
    """One training sequence: a step's prompt followed by the tokens the policy generated."""

    tokens: list[int]
    action_start: int
    advantage: float
    weight: float = 1.0  # Loss weight of the sequence (see `trajectories_to_examples`).


def trajectories_to_examples(
    trajs: Sequence[Trajectory], adv: np.ndarray, step_weighting: str = "trajectory"
) -> list[Example]:
    """One example per step that generated tokens, carrying its trajectory's advantage.

    With `step_weighting="trajectory"` each step weighs 1 / (steps in its trajectory), so every
    trajectory contributes the same total weight, as in the per-trajectory policy gradient that
    GRPO and RLOO estimate. `"uniform"` weighs every step 1: long (often failing) episodes then
    dominate the gradient.
    """
    if step_weighting not in ("trajectory", "uniform"):
        raise ValueError(f"Unknown step_weighting {step_weighting!r}; use trajectory or uniform.")
    out = []
    for traj, a in zip(trajs, adv):
        n = max(len(traj.steps), 1)
        w = 1.0 / n if step_weighting == "trajectory" else 1.0
        for step in traj.steps:
            if step.action_ids:
                out.append(
                    Example(step.prompt_ids + step.action_ids, len(step.prompt_ids), float(a), w)
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


def rl_iteration(
    pool,
    policy,
    updater: RLUpdater,
    state: learner.TrainState,
    tasks,
    it: int,
    rng,
    ref_params=None,
) -> tuple[learner.TrainState, dict]:
    """Plays a group of rollouts per task, computes advantages and updates the policy."""
    cfg = updater.cfg
    t = cfg.train
    t0 = time.time()
    policy.params = state.params
    trajs, stats = play(
        pool,
        policy,
        tasks,
        t.group_size,
        rng=rng,
        greedy=False,
        history_turns=cfg.agent.history_turns,
        max_prompt_tokens=cfg.agent.max_prompt_tokens,
    )
    t_rollout = time.time() - t0
    returns = np.array([tr.total_reward for tr in trajs], np.float32)
    returns = returns.reshape(len(tasks), t.group_size)
    adv = group_advantages(returns, t.algo, t.adv_eps).reshape(-1)
    examples = trajectories_to_examples(trajs, adv, t.step_weighting)
    state, history = updater.update(state, examples, seed=(cfg.seed, it, 1), ref_params=ref_params)
    mixed = np.mean([len(set(r)) > 1 for r in returns.tolist()])
    metrics = {
        "train/iteration": it + 1,
        "train/success": success_rate(trajs),
        "train/return": float(returns.mean()),
        "train/return_std": float(returns.std()),
        "train/groups_with_signal": float(mixed),  # Groups whose returns differ.
        "train/episode_len": float(np.mean([len(tr.steps) for tr in trajs])),
        "train/num_sequences": len(examples),
        "train/faults": sum(tr.error is not None for tr in trajs),
        "train/rollout_seconds": t_rollout,
        "train/iteration_seconds": time.time() - t0,
        **stats.as_dict("compute/"),
    }
    if history:
        for key in history[0]:
            metrics[f"train/{key}_mean"] = float(np.mean([h[key] for h in history]))
    return state, metrics
