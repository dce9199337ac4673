"""Predicted gradient variance of a forest on a tabular MDP, from its exact return moments.

Two predictions stand beside each measured BPO/RLOO ratio of `bench_variance_map.py`:

1. DESIGN.md's identity at the first branch depth d. With `f = Var(E[R | h_d]) / Var(R)` the
   share of the return variance that the history explains, a branch node's leave-one-out
   advantage has variance `K/(K-1) * E[Var(R | h_d)] = K/(K-1) * (1 - f) Var(R)`, against
   `N/(N-1) * Var(R)` for a group of N: the node wins where `f > f* = 1 - (N/(N-1)) / (K/(K-1))`.

2. A first-order model of the whole gradient's covariance trace, evaluated on the forests the
   engine actually grew (so it follows the planner's partial acceptance and nested branches).
   Per segment s (start step t0, end step t1, parent with n children, path mass w):
       E[V(s)^2 | structure] - E[E[R|h_t0]^2] = D(t0, t1) + sum_c EVar(V(c)) / k^2   (inner),
                                              = D(t0, H)                           (leaf),
   with `D(a, b) = E[Q(h_b)^2] - E[Q(h_a)^2]`, `Q(h) = E[R | h]` (exact, law of total variance;
   the k children of s's end node are independent given it);
       E[A(s)^2] = EVar(V(s)) + sum over siblings j of EVar(V(j)) / (n - 1)^2;
       predicted trace = sum_s w(s)^2 E[A(s)^2] sum_{t0 <= t < t1} c_t,
   `c_t = E ||grad log pi(a_t | h_t)||^2 = E[1 - ||pi(h_t)||^2]`. It treats the advantage as
   independent of the score of its own steps and drops the cross terms between steps, so it is
   a first-order guide, not an identity; the measured ratios say how far it carries.

Valid for MDPs where every episode lasts the horizon (the map's MDPs); the weights are the path
masses (the `trajectory` weighting divides all of them by the same H, which cancels in ratios).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from envs.tabular import (
    TreeMDP,
    policy_probs,
    prefix_rewards,
    reward_to_go_moments,
    state_visit_probs,
)


@dataclasses.dataclass(frozen=True)
class Moments:
    """Exact per-depth moments of a policy on a fixed-horizon MDP.

    Attributes:
      q_sq: float[H + 1], `E[Q(h_t)^2]` over on-policy histories at step t (t = H: `E[R^2]`).
      score_sq: float[H], `c_t = E ||grad log pi(a_t | h_t)||^2`.
      var_return: Var(R).
    """

    q_sq: np.ndarray
    score_sq: np.ndarray
    var_return: float

    def explained(self, t: int) -> float:
        """f at step t: `Var(E[R | h_t]) / Var(R)`."""
        return float((self.q_sq[t] - self.q_sq[0]) / self.var_return)

    def gap(self, a: int, b: int) -> float:
        """`D(a, b) = E[Var(Q(h_b) | h_a)]`, the return variance resolved between steps a, b."""
        return float(self.q_sq[b] - self.q_sq[a])


def moments(mdp: TreeMDP, logits) -> Moments:
    mean, var = reward_to_go_moments(mdp, logits)
    q = prefix_rewards(mdp) + mean
    visit = state_visit_probs(mdp, logits)
    pi = policy_probs(logits)
    depth = mdp.depth[: mdp.num_states]
    h = mdp.horizon
    q_sq = np.zeros(h + 1)
    score_sq = np.zeros(h)
    for t in range(h):
        at = depth == t
        q_sq[t] = visit[at] @ q[at] ** 2
        score_sq[t] = visit[at] @ (1.0 - (pi[at] ** 2).sum(axis=1))
    q_sq[h] = var[0] + mean[0] ** 2
    return Moments(q_sq, score_sq, float(var[0]))


def identity_prediction(m: Moments, d: int, k: int, n: int) -> dict:
    """DESIGN.md's identity at branch depth d for K siblings against a group of N."""
    f = m.explained(d)
    factor = (k / (k - 1)) / (n / (n - 1))
    return {
        "f_explained": f,
        "f_threshold": 1.0 - 1.0 / factor,
        "node_adv_var_ratio": factor * (1.0 - f),
    }


def forest_trace(forest, m: Moments) -> np.ndarray:
    """Predicted covariance trace of each task's gradient (path-mass weights), float[tasks]."""
    segs = forest.segments
    h = len(m.score_sq)
    node_t = np.zeros(forest.num_nodes, np.int64)
    start = np.zeros(len(segs), np.int64)
    children: dict[int, list[int]] = {}
    for i, s in enumerate(segs):  # A segment is created before the segments of its end node.
        start[i] = node_t[s.parent]
        children.setdefault(s.parent, []).append(i)
        if s.child >= 0:
            node_t[s.child] = start[i] + len(s.steps)
    var_v = np.zeros(len(segs))
    for i in range(len(segs) - 1, -1, -1):
        s = segs[i]
        if s.child < 0:
            var_v[i] = m.gap(start[i], h)
        else:
            kids = children[s.child]
            var_v[i] = m.gap(start[i], node_t[s.child]) + var_v[kids].sum() / len(kids) ** 2
    mass = forest.arrays().segment_mass()
    cum = np.concatenate([[0.0], np.cumsum(m.score_sq)])
    out = np.zeros(len(forest.task_ids))
    for kids in children.values():
        n, total = len(kids), var_v[kids].sum()
        for i in kids:
            adv_sq = var_v[i] + (total - var_v[i]) / (n - 1) ** 2
            score = cum[start[i] + len(segs[i].steps)] - cum[start[i]]
            out[segs[i].task] += mass[i] ** 2 * adv_sq * score
    return out


def root_corrected_ratio(mdp, logits, ratio: float, k0: int, n: int, rloo_trace: float) -> float:
    """A predicted BPO/RLOO ratio with the root's shared-state terms added exactly.

    Every group member (backbone) takes its first step at the initial state. The first-order
    model counts each member's E[A^2 ||s||^2], which includes the expected gradient's share, and
    drops the cross terms between members and the mean's subtraction; at the root together they
    are `-||g_0||^2 (m - 2) / (m (m - 1))` for a group of m (g_0: the exact gradient at the
    initial state's logits). `rloo_trace` is the model's RLOO(n) trace in units of Var(R) (as
    `bpo_jax.rollout.design.predicted_trace` gives it); docs/variance_map.md, "misses".
    """
    from envs.tabular import objective_grad

    var_r = moments(mdp, logits).var_return
    g0 = float((objective_grad(mdp, logits)[0] ** 2).sum())
    rloo = rloo_trace * var_r
    bpo = ratio * rloo - g0 * (k0 - 2) / (k0 * (k0 - 1))
    return bpo / (rloo - g0 * (n - 2) / (n * (n - 1)))
