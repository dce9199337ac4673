"""Exact quantities of a `TreeMDP` under a softmax policy, by enumeration.

The policy is a softmax over a logits table `logits[s, a]` (one row per decision state), so every
quantity here is exact: the trajectory enumeration (A**H of them), the objective
`J = sum_tau p(tau) R(tau)`, its gradient
`dJ/dlogits = sum_tau p(tau) R(tau) sum_t grad log pi(a_t | s_t)`, with
`d log pi(a|s) / d logits[s, b] = 1[a == b] - pi(b|s)`, and the conditional mean and variance of
the return given any state. Tests check estimators and rollout engines against them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from envs.tabular.mdp import TreeMDP

__all__ = [
    "Trajectories",
    "enumerate_trajectories",
    "objective",
    "objective_grad",
    "policy_probs",
    "prefix_rewards",
    "random_logits",
    "reward_to_go_moments",
    "state_visit_probs",
    "trajectory_probs",
]


class Trajectories(NamedTuple):
    """Every trajectory of an MDP (N = A**H rows, in lexicographic order of the actions)."""

    actions: np.ndarray  # int64[N, H]
    states: np.ndarray  # int64[N, H], the decision state each action is taken in
    rewards: np.ndarray  # float64[N, H]
    returns: np.ndarray  # float64[N]


def enumerate_trajectories(mdp: TreeMDP) -> Trajectories:
    a, h = mdp.num_actions, mdp.horizon
    actions = np.stack(np.unravel_index(np.arange(a**h), (a,) * h), axis=1).astype(np.int64)
    states = np.zeros_like(actions)
    for t in range(1, h):
        states[:, t] = mdp.child(states[:, t - 1], actions[:, t - 1])
    rewards = mdp.rewards[states, actions]
    return Trajectories(actions, states, rewards, rewards.sum(axis=1))


def _check_logits(mdp: TreeMDP, logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    if logits.shape != (mdp.num_states, mdp.num_actions):
        raise ValueError(
            f"logits must have shape (num_states, num_actions) = "
            f"{(mdp.num_states, mdp.num_actions)} for {mdp.name}, got {logits.shape}"
        )
    return logits


def policy_probs(logits) -> np.ndarray:
    """Softmax over the last axis (stable)."""
    logits = np.asarray(logits, np.float64)
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def random_logits(mdp: TreeMDP, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A reproducible policy: logits ~ N(0, scale^2)."""
    return np.random.default_rng(seed).normal(size=(mdp.num_states, mdp.num_actions)) * scale


def trajectory_probs(mdp: TreeMDP, logits, trajs: Trajectories | None = None) -> np.ndarray:
    """p(tau) of every trajectory of `enumerate_trajectories` (sums to 1)."""
    pi = policy_probs(_check_logits(mdp, logits))
    trajs = enumerate_trajectories(mdp) if trajs is None else trajs
    return pi[trajs.states, trajs.actions].prod(axis=1)


def objective(mdp: TreeMDP, logits) -> float:
    """J = E[R] under the softmax policy, by enumeration."""
    trajs = enumerate_trajectories(mdp)
    return float(trajectory_probs(mdp, logits, trajs) @ trajs.returns)


def objective_grad(mdp: TreeMDP, logits) -> np.ndarray:
    """dJ/dlogits, float64[num_states, A]: sum_tau p R sum_t (onehot(a_t) - pi(s_t)) at s_t."""
    logits = _check_logits(mdp, logits)
    pi = policy_probs(logits)
    trajs = enumerate_trajectories(mdp)
    coef = trajectory_probs(mdp, logits, trajs) * trajs.returns  # [N]
    coef_nh = np.broadcast_to(coef[:, None], trajs.states.shape)
    s, a = trajs.states.ravel(), trajs.actions.ravel()
    grad = np.zeros_like(pi)
    np.add.at(grad, (s, a), coef_nh.ravel())
    grad -= np.bincount(s, coef_nh.ravel(), minlength=mdp.num_states)[:, None] * pi
    return grad


def state_visit_probs(mdp: TreeMDP, logits) -> np.ndarray:
    """float64[num_states]: the chance that an episode passes through each decision state."""
    pi = policy_probs(_check_logits(mdp, logits))
    p = np.zeros(mdp.num_states)
    p[0] = 1.0
    inner = np.arange(mdp.num_states)
    inner = inner[mdp.depth[inner] < mdp.horizon - 1]  # states whose children are decisions
    for s in inner:  # heap order: a parent comes before its children
        p[mdp.child(s, np.arange(mdp.num_actions))] = p[s] * pi[s]
    return p


def prefix_rewards(mdp: TreeMDP) -> np.ndarray:
    """float64[num_states]: the reward collected on the way from the initial state to s."""
    prefix = np.zeros(mdp.num_states)
    for s in range(1, mdp.num_states):
        parent, action = divmod(s - 1, mdp.num_actions)
        prefix[s] = prefix[parent] + mdp.rewards[parent, action]
    return prefix


def reward_to_go_moments(mdp: TreeMDP, logits) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of the reward still to come from each decision state, exactly.

    The return given the history h is `prefix_rewards[h] + reward-to-go`, so its conditional
    variance is the reward-to-go's and its conditional mean is shifted by the prefix.

    Returns:
        (mean, var), float64[num_states] each.
    """
    pi = policy_probs(_check_logits(mdp, logits))
    a = mdp.num_actions
    m1 = np.zeros(mdp.num_states + mdp.num_leaves)  # leaves: 0
    m2 = np.zeros_like(m1)
    for s in range(mdp.num_states - 1, -1, -1):  # children before parents
        kids = mdp.child(s, np.arange(a))
        r = mdp.rewards[s]
        m1[s] = pi[s] @ (r + m1[kids])
        m2[s] = pi[s] @ (r**2 + 2 * r * m1[kids] + m2[kids])
    mean = m1[: mdp.num_states]
    return mean, np.maximum(m2[: mdp.num_states] - mean**2, 0.0)
