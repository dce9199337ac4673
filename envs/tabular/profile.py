"""The exact per-step profile of a softmax policy on a `TreeMDP`, for the design model.

`bpo_jax.rollout.design.Profile` predicts a tree's gradient variance from four per-step
quantities; on a tabular MDP they are exact (T the episode's length, R its return):
- explained[t] = Var(E[R | h_{min(t, T)}]) / Var(R), t = 0 .. H (an episode that ended before t
  has its return known: its history explains it whole);
- survival[t] = P(T > t), t = 0 .. H;
- energy[t] = E[1{T > t} ||d log pi(a_t | h_t) / d logits||^2] = E[1{T > t} (1 - ||pi(h_t)||^2)];
- cost[t] = survival[t] (one env step, and one token, per action).
"""

from __future__ import annotations

import numpy as np

from envs.tabular.exact import (
    policy_probs,
    prefix_rewards,
    reward_to_go_moments,
    state_visit_probs,
)
from envs.tabular.mdp import TreeMDP

__all__ = ["step_profile"]


def step_profile(mdp: TreeMDP, logits) -> dict[str, np.ndarray]:
    """The profile's arrays (module docstring): {"explained", "survival", "energy", "cost"}."""
    mean, var = reward_to_go_moments(mdp, logits)
    q = prefix_rewards(mdp) + mean  # E[R | h]; a stopping state's return is its prefix.
    visit = state_visit_probs(mdp, logits)
    pi = policy_probs(logits)
    h = mdp.horizon
    depth = mdp.depth[: mdp.num_states]
    stops = np.asarray(mdp.stops, bool)
    j, var_r = float(mean[0]), float(var[0])
    explained = np.ones(h + 1)
    survival = np.zeros(h + 1)
    energy = np.zeros(h)
    for t in range(h):
        live = (depth == t) & ~stops
        # Histories at step t: the running ones, and every episode that ended at a step <= t.
        known = live | (stops & (depth <= t))
        explained[t] = visit[known] @ (q[known] - j) ** 2 / var_r if var_r > 0 else 1.0
        survival[t] = visit[live].sum()
        energy[t] = visit[live] @ (1.0 - (pi[live] ** 2).sum(axis=1))
    explained[0] = 0.0
    return {"explained": explained, "survival": survival, "energy": energy, "cost": survival[:h]}
