"""The real rollout engine on an exactly solvable MDP: its forests give unbiased gradients.

`tests/test_estimator_mdp.py` checks the estimator kernels on forests drawn by a reference
sampler. Here the forests come from `bpo_jax.rollout.engine.play_forest` itself: the sandbox pool,
the
online branch rules, the budget, the forest bookkeeping and `RolloutForest.step_weights`, with a
tabular softmax policy in place of the language model (same `prefill` / `sample` interface).
The mean of the per-task BPO gradient over many tasks must match the exact policy gradient
within 4 standard errors per component.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from helpers import play_tabular

from bpo_jax.estimators import step_advantages
from bpo_jax.rollout.branching import make_selector
from bpo_jax.rollout.engine import TreeSpec
from bpo_jax.sampler.policy import ActionSample
from envs.sandbox import SandboxPool
from envs.tabular import load_tasks, make_mdp, objective_grad, policy_probs, random_logits

_STATE = re.compile(r"State s(\d+)")


class _Context(list):
    prefilled_tokens = 0  # A table lookup runs no model.


class TabularPolicy:
    """A softmax policy over a logits table, with the LM policy's sampling interface.

    A prompt is the one-token list [state id]; an action's single "token" is its index.
    """

    def __init__(self, logits: np.ndarray):
        self.probs = policy_probs(logits)

    def prefill(self, prompts):
        return _Context([p[0] for p in prompts])

    def next_token_entropy(self, states):
        p = self.probs[states]
        return -(p * np.log(p)).sum(axis=1)

    def sample(self, states, rng, rows=None, *, greedy=False, keep_context=False):
        rows = range(len(states)) if rows is None else rows
        seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
        gen = np.random.default_rng(seed)
        entropy = self.next_token_entropy(states)
        out = []
        for r in rows:
            p = self.probs[states[r]]
            a = int(np.argmax(p)) if greedy else int(gen.choice(len(p), p=p))
            out.append(ActionSample([a], f"a{a}", np.log(p[[a]]), np.array([entropy[r]])))
        return out


def encode(episode) -> list[int]:
    return [int(_STATE.search(episode.current or episode.room).group(1))]


def sampled_gradients(instance, selector, spec, num_tasks, seed):
    mdp = make_mdp(instance, 0)
    logits = random_logits(mdp, seed=1, scale=0.7)
    policy = TabularPolicy(logits)
    tasks = load_tasks(None, "train", instance=instance, copies=num_tasks)
    with SandboxPool("tabular", {"instance": instance}, backend="inprocess") as pool:
        forest = play_tabular(
            pool, policy, tasks, spec, seed=seed, horizon=mdp.horizon, encode=encode,
            selector=selector,
        )  # fmt: skip
    adv = np.asarray(step_advantages(forest.to_forest(), "bpo"))
    weights = forest.step_weights("path_mass")
    grads = np.zeros((num_tasks, *logits.shape))
    t = 0
    for seg in forest.segments:
        for step in seg.steps:
            s, a = step.prompt_ids[0], step.action_ids[0]
            score = -policy.probs[s].copy()
            score[a] += 1.0  # d log pi(a|s) / d logits[s]
            grads[seg.task, s] += weights[t] * adv[t] * score
            t += 1
    return grads.reshape(num_tasks, -1), objective_grad(mdp, logits).reshape(-1), forest


def assert_matches_exact(grads, exact, resolves: bool = True) -> np.ndarray:
    """The per-task gradients' mean is the exact gradient within 4 standard errors (where it
    varies at all); with `resolves`, the estimate is many standard errors sharp. Returns the
    mean."""
    mean = grads.mean(axis=0)
    se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
    moving = se > 0
    z = np.abs(mean[moving] - exact[moving]) / se[moving]
    assert z.max() < 4.0, (z.max(), mean, exact)
    if resolves:
        assert np.abs(exact).max() > 10 * se.max()
    return mean


@pytest.mark.parametrize(
    "instance,selector",
    [
        ("generic", make_selector("uniform", branch_prob=0.5, seed=3)),
        # The reward is decided by the first action; branch points come only later (t >= 1),
        # so only the root group can give a_0 its gradient.
        pytest.param(
            "first_action_decides", make_selector("interval", interval=1), marks=pytest.mark.slow
        ),
    ],
)
def test_engine_forests_give_the_exact_policy_gradient(instance, selector):
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)
    grads, exact, forest = sampled_gradients(instance, selector, spec, num_tasks=4000, seed=0)
    assert forest.num_branch_points > 1000
    mean = assert_matches_exact(grads, exact)
    moving = grads.std(axis=0, ddof=1) > 0
    np.testing.assert_allclose(mean[~moving], exact[~moving], atol=1e-12)
    if instance == "first_action_decides":
        a0 = slice(0, 2)  # logits of the initial state
        assert np.all(np.abs(exact[a0]) > 0.05) and np.all(np.sign(mean[a0]) == np.sign(exact[a0]))
