"""Exact quantities of a `TreeMDP` under a softmax policy, by enumeration.

The policy is a softmax over a logits table `logits[s, a]` (one row per decision state), so every
quantity here is exact: the trajectory enumeration (A**H of them), the objective
`J = sum_tau p(tau) R(tau)`, its gradient
`dJ/dlogits = sum_tau p(tau) R(tau) sum_t grad log pi(a_t | s_t)`, with
`d log pi(a|s) / d logits[s, b] = 1[a == b] - pi(b|s)`, the conditional mean and variance of
the return given any state, and the parts of `f = Var(E[R | h]) / Var(R)` at a branch step
(`branch_moments`). Tests check estimators and rollout engines against them.

MDPs with early terminal states (`TreeMDP.stops`) have episodes of different lengths L; for
them `length_normalized_grad` is the expected update of a group estimator whose steps are
weighted 1 / L (the `trajectory` step weighting), and `expected_tree_gradient` that of a BPO
tree under either weighting (see their docstrings: the two differ, and differ from dJ).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from envs.tabular.mdp import TreeMDP

__all__ = [
    "BranchMoments",
    "Trajectories",
    "branch_moments",
    "enumerate_trajectories",
    "expectation_grad",
    "expected_tree_gradient",
    "length_normalized_grad",
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
    """Every episode of an MDP, once each, in lexicographic order of the actions (N = A**H
    rows when every episode lasts H steps). Steps after an episode's end are padding: action
    and state 0, reward 0, `live` False."""

    actions: np.ndarray  # int64[N, H]
    states: np.ndarray  # int64[N, H], the decision state each action is taken in
    rewards: np.ndarray  # float64[N, H]
    returns: np.ndarray  # float64[N]
    lengths: np.ndarray  # int64[N], steps in the episode (H without early terminal states)

    @property
    def live(self) -> np.ndarray:
        """bool[N, H]: the step is part of the episode."""
        return np.arange(self.actions.shape[1])[None, :] < self.lengths[:, None]


def enumerate_trajectories(mdp: TreeMDP) -> Trajectories:
    a, h = mdp.num_actions, mdp.horizon
    actions = np.stack(np.unravel_index(np.arange(a**h), (a,) * h), axis=1).astype(np.int64)
    states = np.zeros_like(actions)
    live = np.ones(actions.shape, bool)
    for t in range(1, h):
        states[:, t] = mdp.child(states[:, t - 1], actions[:, t - 1])
        live[:, t] = live[:, t - 1] & ~mdp.terminal[states[:, t]]
    # An episode that ended early is listed once: with every padding action 0.
    keep = np.all(live | (actions == 0), axis=1)
    actions, states, live = actions[keep], np.where(live, states, 0)[keep], live[keep]
    actions = np.where(live, actions, 0)
    rewards = np.where(live, mdp.rewards[states, actions], 0.0)
    return Trajectories(actions, states, rewards, rewards.sum(axis=1), live.sum(axis=1))


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
    return np.where(trajs.live, pi[trajs.states, trajs.actions], 1.0).prod(axis=1)


def objective(mdp: TreeMDP, logits) -> float:
    """J = E[R] under the softmax policy, by enumeration."""
    trajs = enumerate_trajectories(mdp)
    return float(trajectory_probs(mdp, logits, trajs) @ trajs.returns)


def objective_grad(mdp: TreeMDP, logits) -> np.ndarray:
    """dJ/dlogits, float64[num_states, A]: sum_tau p R sum_t (onehot(a_t) - pi(s_t)) at s_t."""
    return expectation_grad(mdp, logits, enumerate_trajectories(mdp).returns)


def expectation_grad(mdp: TreeMDP, logits, values) -> np.ndarray:
    """d E[f(tau)] / dlogits for per-episode values f [N] (in `enumerate_trajectories` order)
    that do not depend on the logits: `sum_tau p f sum_t (onehot(a_t) - pi(s_t))`."""
    logits = _check_logits(mdp, logits)
    pi = policy_probs(logits)
    trajs = enumerate_trajectories(mdp)
    values = np.asarray(values, np.float64)
    if values.shape != trajs.returns.shape:
        raise ValueError(f"values must have shape {trajs.returns.shape}, got {values.shape}")
    coef = trajectory_probs(mdp, logits, trajs) * values  # [N]
    coef_nh = np.where(trajs.live, coef[:, None], 0.0)
    s, a = trajs.states.ravel(), trajs.actions.ravel()
    grad = np.zeros_like(pi)
    np.add.at(grad, (s, a), coef_nh.ravel())
    grad -= np.bincount(s, coef_nh.ravel(), minlength=mdp.num_states)[:, None] * pi
    return grad


def length_normalized_grad(mdp: TreeMDP, logits) -> np.ndarray:
    """`dE[R/L] - J dE[1/L]`: the expected update of a group estimator weighted 1 / L.

    A group of N independent episodes with leave-one-out advantages `R_i - b_i` (RLOO) and
    every step of episode i weighted `1 / (N L_i)` (the `trajectory` weighting) has the expected
    update `E[(R - b) / L * sum_t grad log pi] = dE[R/L] - E[b] dE[1/L]`, with `E[b] = J`:
    the gradient of `E_theta[(R - J) / L]` at the current J held fixed. It equals `dJ / H` when
    every episode lasts H steps, and is neither dJ nor `dE[R/L]` when lengths vary.
    """
    trajs = enumerate_trajectories(mdp)
    inv_len = 1.0 / trajs.lengths
    j = objective(mdp, logits)
    return expectation_grad(mdp, logits, trajs.returns * inv_len) - j * expectation_grad(
        mdp, logits, inv_len
    )


def state_visit_probs(mdp: TreeMDP, logits) -> np.ndarray:
    """float64[num_states]: the chance that an episode passes through (or ends at) each state
    of depth < H."""
    pi = policy_probs(_check_logits(mdp, logits))
    p = np.zeros(mdp.num_states)
    p[0] = 1.0
    inner = np.arange(mdp.num_states)
    inner = inner[mdp.depth[inner] < mdp.horizon - 1]  # states whose children are decisions
    for s in inner:  # heap order: a parent comes before its children
        if not mdp.stops[s]:  # Nothing below a stopping state is reached.
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
        if mdp.stops[s]:
            continue  # The episode is over: nothing to go.
        kids = mdp.child(s, np.arange(a))
        r = mdp.rewards[s]
        m1[s] = pi[s] @ (r + m1[kids])
        m2[s] = pi[s] @ (r**2 + 2 * r * m1[kids] + m2[kids])
    mean = m1[: mdp.num_states]
    return mean, np.maximum(m2[: mdp.num_states] - mean**2, 0.0)


class BranchMoments(NamedTuple):
    """The exact parts of f at a set of branch points (`branch_moments`).

    Attributes:
        between: `E_D[(E[R | h] - J)^2]`, D the law of the history h at the branch points.
        within: `E_D[Var(R | h)]`.
        var_return: `Var(R)` of an episode from the initial state.
        mean_return: `J = E[R]`.
    """

    between: float
    within: float
    var_return: float
    mean_return: float

    @property
    def f(self) -> float:
        """The explained share `between / var_return`."""
        return self.between / self.var_return


def branch_moments(mdp: TreeMDP, logits, depth: int, weights=None) -> BranchMoments:
    """Exact parts of f for branch points at step `depth` (1 .. H - 1).

    D is the law of the on-policy history at that step among the episodes still running (a
    stopped episode has no branch point), reweighted by `weights[s]` when given (a branch rule
    that fires with probability weights[s] in state s). With every episode running to the
    horizon and no weights, `between = Var(E[R | h_depth])` and `between + within = Var(R)`;
    otherwise the two need not add up to Var(R).

    Args:
        mdp, logits: the MDP and the softmax policy's logits.
        depth: the step the branch points come before.
        weights: None, or float[num_states] >= 0, the chance of branching in each state.

    Raises:
        ValueError: no running history at that step (or all weights 0 there).
    """
    mean, var = reward_to_go_moments(mdp, logits)
    visit = state_visit_probs(mdp, logits)
    live = (mdp.depth[: mdp.num_states] == depth) & ~mdp.stops & (visit > 0)
    p = visit * (1.0 if weights is None else np.asarray(weights, np.float64))
    states = np.flatnonzero(live & (p > 0))
    if not 1 <= depth < mdp.horizon or states.size == 0:
        raise ValueError(f"no running history of {mdp.name} to branch at step {depth}")
    p = p[states] / p[states].sum()
    q = prefix_rewards(mdp)[states] + mean[states]
    j = float(mean[0])
    return BranchMoments(float(p @ (q - j) ** 2), float(p @ var[states]), float(var[0]), j)


def expected_tree_gradient(
    mdp: TreeMDP,
    logits,
    branch_depth: int,
    num_branches: int,
    weighting: str = "trajectory",
    shrink: float = 1.0,
) -> np.ndarray:
    """The exact expected update of a BPO forest that branches at every step 1 .. D.

    The forest: a root group of K0 >= 2 backbones (K0 does not enter the expectation); every
    path still running at steps t = 1 .. D (D = `branch_depth`) is a branch point with K =
    `num_branches` children (the engine's `interval` rule with interval 1, `max_depth` D and an
    unlimited budget); below depth D paths run to their end. Advantages are the sibling
    leave-one-out ones (`tree_advantages`, "bpo"), and a step of segment s is weighted
      path_mass:  w(s), the path mass;
      trajectory: `sum over the leaves l below s of w(l) / L(l)` (the default weighting).

    With path_mass the result is dJ (the recursion below reproduces `objective_grad`). With the
    trajectory weighting, write X(s) = `sum_l w(l) / (w(s) L(l))` and Y(s) = V(s) for the
    subtree below a node s; then at a branch point `E[X Y] = E[X_c Y_c] / K + (K-1)/K E[X_c]
    E[Y_c]` over its children c: the siblings' values enter the weight of the steps above them,
    so the expected update depends on K and D. It equals `length_normalized_grad` (the RLOO
    target) when D = 0, and `dJ / H` when every episode lasts H steps; when lengths vary it is
    neither, nor a gradient of one fixed objective for every tree shape.

    `shrink` (lam) is the baseline of `bpo_shrink`: lam times the siblings' mean plus 1 - lam
    times the other backbones' mean less the prefix reward (lam = 1: `bpo`; 0: `bpo_traj`). Given
    the node's history n, its mean is `lam mu(n) + (1 - lam)(J - prefix(n))` in place of
    mu(n), and it is independent of the steps' weights; with path masses every lam gives dJ.

    Returns:
        float64[num_states, A].
    """
    if weighting not in ("trajectory", "path_mass"):
        raise ValueError(f"weighting must be 'trajectory' or 'path_mass', got {weighting!r}")
    if branch_depth < 0 or (branch_depth > 0 and num_branches < 2):
        raise ValueError(
            f"need branch_depth >= 0 and num_branches >= 2, got {branch_depth}, {num_branches}"
        )
    logits = _check_logits(mdp, logits)
    pi = policy_probs(logits)
    a_idx = np.arange(mdp.num_actions)
    total = mdp.num_states + mdp.num_leaves
    depth, terminal = mdp.depth, mdp.terminal
    mean, _ = reward_to_go_moments(mdp, logits)
    mu = np.concatenate([mean, np.zeros(mdp.num_leaves)])
    mu[: mdp.num_states][mdp.stops] = 0.0

    def g(length):
        return 1.0 / length if weighting == "trajectory" else 1.0

    # Chain (no branch point below): EX = E[g(L)], EXY = E[g(L) * reward to go].
    ex_c, exy_c = np.zeros(total), np.zeros(total)
    # Subtree below s when s is a branch point (1 <= depth <= D) or a chain otherwise.
    ex, exy = np.zeros(total), np.zeros(total)
    for s in range(total - 1, -1, -1):  # children before parents
        if terminal[s]:
            ex_c[s] = ex[s] = g(depth[s])
            continue
        kids, r, p = mdp.child(s, a_idx), mdp.rewards[s], pi[s]
        ex_c[s] = p @ ex_c[kids]
        exy_c[s] = p @ (r * ex_c[kids] + exy_c[kids])
        if 1 <= depth[s] <= branch_depth:
            x_c = p @ ex[kids]
            xy_c = p @ (r * ex[kids] + exy[kids])
            ex[s] = x_c
            exy[s] = xy_c / num_branches + (num_branches - 1) / num_branches * x_c * mu[s]
        else:
            ex[s], exy[s] = ex_c[s], exy_c[s]

    visit = state_visit_probs(mdp, logits)
    prefix = np.concatenate([prefix_rewards(mdp), np.zeros(mdp.num_leaves)])
    # The baseline's mean at each node, as a reward to go (at the root both terms are J).
    base = shrink * mu + (1.0 - shrink) * (mu[0] - prefix)
    grad = np.zeros_like(pi)
    # The node each decision state's step hangs from: itself where it is a branch point or
    # the root (one-step segments), else the chain's start at depth D (or the root if D = 0).
    for s in range(mdp.num_states):
        if terminal[s] or visit[s] == 0.0:
            continue
        kids, r, p = mdp.child(s, a_idx), mdp.rewards[s], pi[s]
        if depth[s] <= branch_depth and (depth[s] >= 1 or branch_depth >= 1):
            # One-step segment from node s: its value r + Y(s'), its baseline mean base(s).
            z = r * ex[kids] + exy[kids] - base[s] * ex[kids]
        else:
            start = s
            while depth[start] > branch_depth:
                start = (start - 1) // mdp.num_actions
            to_here = prefix[s] - prefix[start]
            z = (to_here + r - base[start]) * ex_c[kids] + exy_c[kids]
        grad[s] = visit[s] * (p * z - p * (p @ z))
    return grad
