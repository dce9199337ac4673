"""A softmax policy over a logits table, with the language-model policy's sampling interface.

`bpo_jax.rollout.engine.play_forest` drives any object with `prefill(prompts) -> ctx`,
`next_token_entropy(ctx)` and `sample(ctx, rng, rows=None, greedy=False, keep_context=False)`.
`TabularPolicy` is that object for a `TreeMDP`: a prompt is the one-token list `[state id]`
(`encode_state` reads it from the episode's observation), an action's single "token" is its
index, and the action text is "a<index>", which `TabularEnv` parses. So the real engine (sandbox
pool, branch planner, budget, forest builder, estimator kernels and step weights) plays the MDP
with a policy whose gradient is known exactly (`envs.tabular.exact`).

The score of one step is exact: `d log pi(a|s) / d logits[s] = onehot(a) - pi(s)`
(`TabularPolicy.score`), so a forest's policy-gradient estimate is a sum over its steps.
"""

from __future__ import annotations

import re

import numpy as np

from envs.tabular.exact import policy_probs

__all__ = ["TabularPolicy", "encode_state", "forest_task_gradients"]

_STATE = re.compile(r"State s(\d+)")


class _Context(list):
    """The prefilled prompts: one state id per row."""

    prefilled_tokens = 0  # A table lookup runs no model.


class ActionSample:
    """One sampled action, as `bpo_jax.sampler.policy.ActionSample` has it (token ids, text,
    ...)."""

    __slots__ = ("entropies", "logprobs", "text", "token_ids")

    def __init__(self, token_ids, text, logprobs, entropies):
        self.token_ids, self.text, self.logprobs, self.entropies = (
            token_ids,
            text,
            logprobs,
            entropies,
        )


def encode_state(episode) -> list[int]:
    """The prompt of an episode: `[id of its current state]`, read from the observation."""
    text = episode.current or episode.room
    m = _STATE.search(text)
    if m is None:
        raise ValueError(f"no state id in the tabular observation {text[:80]!r}")
    return [int(m.group(1))]


class TabularPolicy:
    """Samples actions from `softmax(logits[s])`; see the module docstring.

    Args:
        logits: float[num_states, A], one row per decision state of the MDP.
    """

    def __init__(self, logits: np.ndarray):
        self.logits = np.asarray(logits, np.float64)
        self.probs = policy_probs(self.logits)
        self._cdf = np.cumsum(self.probs, axis=1)

    def prefill(self, prompts) -> _Context:
        return _Context([p[0] for p in prompts])

    def next_token_entropy(self, states) -> np.ndarray:
        p = self.probs[np.asarray(states, np.int64)]
        return -(p * np.log(np.maximum(p, 1e-300))).sum(axis=1)

    def sample(self, states, rng, rows=None, *, greedy=False, keep_context=False):
        """One action per row of `states` (rows: indices into it, repeated for forks)."""
        import jax  # Local: the env package stays importable without JAX.

        del keep_context  # The table has no cache to keep.
        rows = np.arange(len(states)) if rows is None else np.asarray(rows, np.int64)
        seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
        gen = np.random.default_rng(seed)
        st = np.asarray(states, np.int64)[rows] if len(rows) else np.zeros(0, np.int64)
        entropy = self.next_token_entropy(st) if len(st) else np.zeros(0)
        if greedy:
            actions = np.argmax(self.probs[st], axis=1) if len(st) else st
        else:
            u = gen.random(len(st))
            actions = np.minimum((self._cdf[st] <= u[:, None]).sum(axis=1), self.probs.shape[1] - 1)
        return [
            ActionSample([int(a)], f"a{int(a)}", np.log(self.probs[s, [a]]), np.array([e]))
            for s, a, e in zip(st, actions, entropy)
        ]

    def score(self, state: int, action: int) -> np.ndarray:
        """`d log pi(action | state) / d logits[state]`, float64[A]."""
        g = -self.probs[state].copy()
        g[action] += 1.0
        return g


def forest_task_gradients(forest, policy: TabularPolicy, step_coef) -> np.ndarray:
    """Per task of a tabular forest: `sum over its steps of coef * grad log pi(a | s)`.

    Args:
        forest: a `bpo_jax.rollout.forest.RolloutForest` played with `policy` (prompts = [state]).
        policy: the policy that played it.
        step_coef: float[num_steps] in `forest.steps()` order (weight * advantage).

    Returns:
        float64[num_tasks, num_states * A].
    """
    num_states, num_actions = policy.probs.shape
    coef = np.asarray(step_coef, np.float64)
    task = np.repeat([seg.task for seg in forest.segments], [len(s.steps) for s in forest.segments])
    steps = forest.steps()
    if coef.shape != (len(steps),):
        raise ValueError(f"expected {len(steps)} step coefficients, got shape {coef.shape}")
    state = np.array([s.prompt_ids[0] for s in steps], np.int64)
    action = np.array([s.action_ids[0] for s in steps], np.int64)
    num_tasks = len(forest.task_ids)
    key = task * num_states + state
    grad = np.bincount(
        key * num_actions + action, coef, minlength=num_tasks * num_states * num_actions
    ).reshape(num_tasks, num_states, num_actions)
    grad -= (
        np.bincount(key, coef, minlength=num_tasks * num_states).reshape(num_tasks, num_states, 1)
        * policy.probs[None]
    )
    return grad.reshape(num_tasks, num_states * num_actions)
