"""The BPO estimator against exact gradients of small tabular MDPs (envs/tabular.py).

A reference forest sampler in NumPy (`tabular_trees.sample_trees`) draws many BPO forests at
once (one task root per forest): a root group of K0 backbones, branch points decided online from
the history alone (a fixed depth, and a state-dependent coin), every fork rolled to the end,
forks branching again up to a depth limit. One jitted call of `estimators.tree_advantages` /
`segment_weights` covers all the forests; the per-forest gradient estimate is

    g = sum_s w(s) A(s) sum_{steps in s} grad log pi(a | state),

and its mean over forests is compared with the exact gradient, component by component, in
units of its standard error. Tolerances are 4 standard errors (per component; about 1 chance in
16,000 of a false alarm each, with fixed seeds), and every comparison also checks that the
standard errors are small enough for the test to mean something.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
from tabular_trees import sample_trees

from bpo_jax import estimators as est
from envs import base as env_base
from envs import tabular

MAX_Z = 4.0

GENERIC = tabular.make_mdp("generic", seed=0)  # H = 3, A = 3
GENERIC_H4 = tabular.make_mdp("generic", seed=0, horizon=4, num_actions=2)
FIRST = tabular.make_mdp("first_action_decides")  # H = 4, A = 2
LOGITS = {
    mdp.name: tabular.random_logits(mdp, seed=i + 1, scale=0.8)
    for i, mdp in enumerate([GENERIC, FIRST, GENERIC_H4])
}


# ----------------------------------------------------------------------- reference BPO sampler


@dataclasses.dataclass(frozen=True)
class Branching:
    """How a forest grows. Every decision uses the current history only (online).

    Attributes:
        root_k: K0, backbones per task (the root group).
        fixed_t: Every path branches before its step `fixed_t` (if its depth budget allows).
        fixed_k: Children at a fixed branch point.
        random_prob: float[num_states] or None: at any other step t >= 1 a path branches with
            probability random_prob[state].
        random_k: Children at a random branch point.
        max_depth: Branch points (below the root) allowed on one path.
    """

    root_k: int = 2
    fixed_t: int | None = None
    fixed_k: int = 2
    random_prob: np.ndarray | None = None
    random_k: int = 2
    max_depth: int = 0


class Sample(NamedTuple):
    num_forests: int
    num_nodes: int  # roots are nodes 0..num_forests-1
    seg_parent: np.ndarray
    seg_child: np.ndarray
    seg_reward: np.ndarray
    node_t: np.ndarray  # the step a node branches before (0 for roots)
    step_forest: np.ndarray
    step_state: np.ndarray
    step_action: np.ndarray
    step_segment: np.ndarray


def _draw_actions(cdf, state, rng):
    """One action per path from pi(. | state), by inverting the cumulative probabilities."""
    u = rng.random(len(state))
    return np.minimum((cdf[state] <= u[:, None]).sum(axis=1), cdf.shape[1] - 1)


def sample_forests(mdp, logits, branching: Branching, num_forests: int, seed: int) -> Sample:
    """Draws `num_forests` independent BPO forests (`tabular_trees.sample_trees`)."""
    trees = sample_trees(
        mdp,
        logits,
        num_forests,
        root_k=branching.root_k,
        branch_at=() if branching.fixed_t is None else (branching.fixed_t,),
        k=branching.fixed_k,
        coin=branching.random_prob,
        coin_k=branching.random_k,
        max_depth=branching.max_depth,
        seed=seed,
    )
    return Sample(
        num_forests,
        trees.num_nodes,
        trees.seg_parent,
        trees.seg_child,
        trees.seg_reward,
        trees.node_t,
        trees.step_task,
        trees.step_state,
        trees.step_action,
        trees.step_segment,
    )


# Every call is padded to these sizes, so the kernels compile once for the whole file.
PAD_SEGMENTS = 1 << 20
PAD_NODES = 1 << 19


def advantages_and_weights(sample: Sample, method: str = "bpo"):
    """Advantages and weights of every segment, one jitted call over all the forests."""
    num_segments = len(sample.seg_parent)
    if num_segments > PAD_SEGMENTS or sample.num_nodes > PAD_NODES:
        raise ValueError(
            f"{num_segments} segments / {sample.num_nodes} nodes exceed the padded sizes "
            f"{PAD_SEGMENTS} / {PAD_NODES}; draw fewer forests"
        )
    pad = PAD_SEGMENTS - num_segments
    parent = np.concatenate([sample.seg_parent, np.full(pad, -1)])
    child = np.concatenate([sample.seg_child, np.full(pad, -1)])
    reward = np.concatenate([sample.seg_reward, np.zeros(pad)])
    num_nodes = PAD_NODES
    _, adv = est.tree_advantages(parent, child, reward, num_nodes, method=method)
    weight = est.segment_weights(parent, child, num_nodes)
    adv = np.asarray(adv, np.float64)[:num_segments]
    return adv, np.asarray(weight, np.float64)[:num_segments]


def forest_gradients(mdp, logits, sample: Sample, seg_coef) -> np.ndarray:
    """float64[F, num_states * A]: per forest, sum over steps of coef * grad log pi(a|s)."""
    pi = tabular.policy_probs(logits)
    f, s, a = sample.num_forests, mdp.num_states, mdp.num_actions
    coef = seg_coef[sample.step_segment]
    key = sample.step_forest * s + sample.step_state
    grad = np.bincount(key * a + sample.step_action, coef, minlength=f * s * a).reshape(f, s, a)
    grad -= np.bincount(key, coef, minlength=f * s).reshape(f, s, 1) * pi[None]
    return grad.reshape(f, s * a)


def bpo_gradients(mdp, logits, sample: Sample, method="bpo", uniform_weight=None):
    """Per-forest gradient estimates, with the tree weights or one weight for every step."""
    adv, w = advantages_and_weights(sample, method)
    if uniform_weight is not None:
        w = np.full_like(w, uniform_weight)
    return forest_gradients(mdp, logits, sample, w * adv)


def z_scores(samples, target):
    """Mean, standard error, and z = (mean - target) / se per component (z = 0 where se = 0)."""
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    z = np.divide(mean - target, se, out=np.zeros_like(mean), where=se > 0)
    return mean, se, z


def assert_unbiased(samples, exact, label):
    mean, se, z = z_scores(samples, exact.ravel())
    # Where every forest gives the same value (se = 0) the estimate must equal the target.
    constant = se == 0
    np.testing.assert_allclose(mean[constant], exact.ravel()[constant], atol=1e-6, err_msg=label)
    worst = int(np.argmax(np.abs(z)))
    assert np.abs(z).max() < MAX_Z, (
        f"{label}: component {worst} (state {worst // exact.shape[1]}, action "
        f"{worst % exact.shape[1]}): mean {mean[worst]:.5f} vs exact {exact.ravel()[worst]:.5f}, "
        f"se {se[worst]:.5f}, z {z[worst]:.2f}"
    )
    return np.abs(z).max(), se


# ---------------------------------------------------------------------------- exact MDP math


ALL_MDPS = pytest.mark.parametrize(
    "mdp", [GENERIC, GENERIC_H4, FIRST], ids=["generic", "generic_h4", "first_action_decides"]
)


@ALL_MDPS
def test_exact_gradient_matches_finite_differences(mdp):
    logits = LOGITS[mdp.name]
    trajs = tabular.enumerate_trajectories(mdp)
    leaves = mdp.child(trajs.states[:, -1], trajs.actions[:, -1])
    np.testing.assert_array_equal(np.sort(leaves), mdp.num_states + np.arange(mdp.num_leaves))
    assert tabular.trajectory_probs(mdp, logits).sum() == pytest.approx(1.0, abs=1e-12)
    grad = tabular.objective_grad(mdp, logits)
    h = 1e-5
    fd = np.zeros_like(grad)
    for idx in np.ndindex(*grad.shape):
        bump = np.zeros_like(logits)
        bump[idx] = h
        fd[idx] = (
            tabular.objective(mdp, logits + bump) - tabular.objective(mdp, logits - bump)
        ) / (2 * h)
    np.testing.assert_allclose(grad, fd, atol=1e-8, rtol=1e-6)
    assert np.abs(grad).max() > 0.05  # not a degenerate instance


def test_first_action_decides_structure():
    trajs = tabular.enumerate_trajectories(FIRST)
    np.testing.assert_array_equal(trajs.returns, 1.0 - trajs.actions[:, 0])
    grad = tabular.objective_grad(FIRST, LOGITS[FIRST.name])
    assert np.abs(grad[0]).min() > 0.1  # the first action carries the whole gradient
    np.testing.assert_allclose(grad[1:], 0.0, atol=1e-12)


@ALL_MDPS
def test_conditional_moments_match_enumeration(mdp):
    logits = LOGITS[mdp.name]
    trajs = tabular.enumerate_trajectories(mdp)
    p = tabular.trajectory_probs(mdp, logits, trajs)
    mean, var = tabular.reward_to_go_moments(mdp, logits)
    prefix = tabular.prefix_rewards(mdp)
    visit = tabular.state_visit_probs(mdp, logits)
    for t in range(mdp.horizon):
        for s in np.unique(trajs.states[:, t]):
            rows = trajs.states[:, t] == s
            assert visit[s] == pytest.approx(p[rows].sum(), abs=1e-12)
            cond = p[rows] / p[rows].sum()
            to_go = trajs.rewards[rows, t:].sum(axis=1)
            assert mean[s] == pytest.approx(cond @ to_go, abs=1e-10)
            assert var[s] == pytest.approx(cond @ (to_go - cond @ to_go) ** 2, abs=1e-10)
            assert prefix[s] == pytest.approx(trajs.rewards[rows, :t].sum(axis=1)[0], abs=1e-12)
    assert mean[0] == pytest.approx(tabular.objective(mdp, logits), abs=1e-12)


# ------------------------------------------------------------------------------- unbiasedness


def _coin(mdp, seed):
    """A state-dependent branching probability in [0.15, 0.85]."""
    return np.random.default_rng(seed).uniform(0.15, 0.85, mdp.num_states)


# Per instance: forests with a root group, a fixed branch point, a state-dependent coin at every
# other step, and nested branch points (depth limit 2).
UNBIASED_CASES = {
    "generic": (
        GENERIC,
        Branching(2, fixed_t=1, fixed_k=2, random_prob=_coin(GENERIC, 5), random_k=3, max_depth=2),
        40_000,
    ),
    # The fixed branch point comes late, so the root segments hold steps 0 and 1 on the paths
    # where the coin did not branch at step 1.
    "first_action_decides": (
        FIRST,
        Branching(3, fixed_t=2, fixed_k=2, random_prob=_coin(FIRST, 6), random_k=2, max_depth=2),
        40_000,
    ),
}


@pytest.mark.parametrize("case", list(UNBIASED_CASES))
def test_bpo_gradient_is_unbiased(case):
    mdp, branching, num_forests = UNBIASED_CASES[case]
    logits = LOGITS[mdp.name]
    sample = sample_forests(mdp, logits, branching, num_forests, seed=10)
    # The forests really branch in every way the rule allows.
    branch_t = sample.node_t[num_forests:]
    assert set(np.unique(branch_t)) == set(range(1, mdp.horizon))
    nested = sample.seg_child[sample.seg_parent >= num_forests] >= 0
    assert nested.mean() > 0.05, "too few nested branch points to test them"

    exact = tabular.objective_grad(mdp, logits)
    grads = bpo_gradients(mdp, logits, sample)
    _, se = assert_unbiased(grads, exact, f"BPO on {case}")
    # Resolution: a bias of 10% of the largest gradient component would show.
    assert MAX_Z * se.max() < 0.1 * np.abs(exact).max()
    if case == "first_action_decides":
        # The root group is what gives a_0 its gradient: nonzero, and matched (above).
        mean0 = grads.mean(axis=0)[: mdp.num_actions]
        assert np.all(np.abs(mean0) > 0.1)
        np.testing.assert_allclose(mean0, exact[0], atol=MAX_Z * se[: mdp.num_actions].max())


@pytest.mark.parametrize("mdp", [GENERIC, FIRST], ids=lambda m: m.name.split("(")[0])
def test_rloo_gradient_is_unbiased(mdp):
    """Depth-1 forests: N = 4 independent trajectories per task, leave-one-out baseline."""
    logits = LOGITS[mdp.name]
    sample = sample_forests(mdp, logits, Branching(root_k=4), 60_000, seed=11)
    assert np.all(sample.seg_child == -1)
    exact = tabular.objective_grad(mdp, logits)
    grads = bpo_gradients(mdp, logits, sample, method="rloo")
    _, se = assert_unbiased(grads, exact, f"RLOO on {mdp.name}")
    assert MAX_Z * se.max() < 0.1 * np.abs(exact).max()


# ------------------------------------------------------------------------------ the weight trap


def test_uniform_step_weights_are_biased():
    """Equal weight per step over-weights the steps after branch points.

    Every path branches before step 1 into K = 3 children, and before step 2 a state-dependent
    coin q(h) may branch again into K2 = 2. Weighting every step 1/K0 (equal weight per step,
    scaled to match the root group; the literal w = 1 is that times K0) instead of the tree's
    1/(K0 K ...) multiplies the expected gradient at a state h by its expected multiplicity: 1 at
    depth 0, K at depth 1, K (1 + q(h) (K2 - 1)) at depth 2. The branch decision at h does not
    depend on the actions at or after h, so given it the tree estimate stays unbiased.
    """
    mdp, logits, k, k2 = GENERIC, LOGITS[GENERIC.name], 3, 2
    coin = _coin(mdp, 7)
    branching = Branching(2, fixed_t=1, fixed_k=k, random_prob=coin, random_k=k2, max_depth=2)
    sample = sample_forests(mdp, logits, branching, 50_000, seed=12)
    exact = tabular.objective_grad(mdp, logits)
    assert_unbiased(bpo_gradients(mdp, logits, sample), exact, "tree weights")

    uniform = bpo_gradients(mdp, logits, sample, uniform_weight=1 / branching.root_k)
    depth = mdp.depth[: mdp.num_states]
    multiplicity = np.select([depth == 0, depth == 1], [1.0, k], k * (1 + coin * (k2 - 1)))
    assert_unbiased(uniform, exact * multiplicity[:, None], "uniform weights, predicted bias")
    _, _, z = z_scores(uniform, exact.ravel())
    assert np.abs(z).max() > 10 * MAX_Z, f"uniform weights should be far off: max |z| {z}"
    _, _, z_one = z_scores(uniform * branching.root_k, exact.ravel())  # w = 1
    assert np.abs(z_one).max() > 10 * MAX_Z


def _roll(mdp, cdf, state, t0, rng):
    """Rolls paths from `state` at step t0 to the end: (states, actions), int[n, H - t0] each."""
    states, actions = [], []
    for _ in range(t0, mdp.horizon):
        action = _draw_actions(cdf, state, rng)
        states.append(state)
        actions.append(action)
        state = mdp.child(state, action)
    return np.stack(states, axis=1), np.stack(actions, axis=1)


def single_branch_forests(mdp, logits, k0, k, num_forests, seed, post_hoc: bool) -> Sample:
    """K0 backbones rolled to the end FIRST, then one branch point per backbone at step t*.

    The node's K children are the backbone's own continuation and K - 1 fresh ones. With
    `post_hoc`, t* is the step in 1..H-1 where the finished backbone's policy entropy is highest
    (top-1 entropy over the trajectory, DESIGN.md's second trap); otherwise t* is drawn
    uniformly, independently of the backbone (an online rule, the control).
    """
    rng = np.random.default_rng(seed)
    pi = tabular.policy_probs(logits)
    cdf = np.cumsum(pi, axis=1)
    num_paths, h = num_forests * k0, mdp.horizon
    states, actions = _roll(mdp, cdf, np.zeros(num_paths, np.int64), 0, rng)
    if post_hoc:
        entropy = -(pi * np.log(pi)).sum(axis=1)
        t_star = 1 + np.argmax(entropy[states[:, 1:]], axis=1)
    else:
        t_star = rng.integers(1, h, num_paths)
    forest = np.repeat(np.arange(num_forests), k0)
    node = num_forests + np.arange(num_paths)  # one per backbone
    # Segments: backbone prefixes [0, P), then K blocks of P children (block 0: the backbone's).
    seg_parent = np.concatenate([forest, np.tile(node, k)])
    seg_child = np.concatenate([node, np.full(k * num_paths, -1)])
    before = np.arange(h)[None, :] < t_star[:, None]
    path, t = np.nonzero(np.ones_like(states, bool))
    own_segment = np.where(before[path, t], path, num_paths + path)
    steps = [(path, states.ravel(), actions.ravel(), own_segment)]
    for j in range(1, k):
        for t0 in range(1, h):
            sel = np.flatnonzero(t_star == t0)
            fresh_s, fresh_a = _roll(mdp, cdf, states[sel, t0], t0, rng)
            rows = np.repeat(sel, h - t0)
            steps.append((rows, fresh_s.ravel(), fresh_a.ravel(), (j + 1) * num_paths + rows))
    step_path, step_state, step_action, step_segment = (np.concatenate(x) for x in zip(*steps))
    seg_reward = np.bincount(
        step_segment, mdp.rewards[step_state, step_action], minlength=len(seg_parent)
    )
    node_t = np.concatenate([np.zeros(num_forests, np.int64), t_star])
    return Sample(
        num_forests,
        num_forests + num_paths,
        seg_parent,
        seg_child,
        seg_reward,
        node_t,
        forest[step_path],
        step_state,
        step_action,
        step_segment,
    )


def test_post_hoc_branch_points_are_biased():
    """Choosing the branch step after seeing the whole backbone biases the estimate; the same
    forests with the step chosen independently of the backbone do not."""
    mdp, logits = GENERIC_H4, LOGITS[GENERIC_H4.name]
    exact = tabular.objective_grad(mdp, logits)
    control = single_branch_forests(mdp, logits, 2, 3, 50_000, seed=13, post_hoc=False)
    assert set(np.unique(control.node_t[50_000:])) == set(range(1, mdp.horizon))
    assert_unbiased(bpo_gradients(mdp, logits, control), exact, "online single branch")
    post_hoc = single_branch_forests(mdp, logits, 2, 3, 50_000, seed=14, post_hoc=True)
    assert len(np.unique(post_hoc.node_t[50_000:])) > 1
    _, _, z = z_scores(bpo_gradients(mdp, logits, post_hoc), exact.ravel())
    assert np.abs(z).max() > 10 * MAX_Z, f"post-hoc selection should be far off: max |z| {z}"


# ------------------------------------------------------------------------------ variance drop


VARIANCE_CASES = {
    # (mdp, branch step d, K, forests): the branch node's children run to the end unbranched.
    # Not generic(H=3, A=3) at d = 1: there Var(E[R | h_1]) is ~1% of Var(R), too small to
    # resolve with these sample sizes (the equalities still hold within their errors).
    "generic_d2_K3": (GENERIC, 2, 3, 100_000),
    "generic_h4_d1_K3": (GENERIC_H4, 1, 3, 100_000),
    "generic_h4_d2_K2": (GENERIC_H4, 2, 2, 120_000),
    # The return is fixed once a_0 is: siblings below the root agree, the advantage is 0.
    "first_action_decides_d1_K2": (FIRST, 1, 2, 100_000),
}


def _mean_and_se(units):
    return units.mean(), units.std(ddof=1) / np.sqrt(len(units))


@pytest.mark.parametrize("case", list(VARIANCE_CASES))
def test_branch_advantage_variance(case):
    """Var(A_BPO) = K/(K-1) E[Var(R|h)], Var(A_RLOO) = N/(N-1) Var(R); N = K, the gap is
    K/(K-1) Var(E[R|h]), h the history at the branch point (law of total variance)."""
    mdp, d, k, num_forests = VARIANCE_CASES[case]
    logits = LOGITS[mdp.name]

    # Exact: the history h_d at the branch point is on-policy (every backbone branches at d).
    mean, var = tabular.reward_to_go_moments(mdp, logits)
    at_d = np.flatnonzero(mdp.depth[: mdp.num_states] == d)
    p_h = tabular.state_visit_probs(mdp, logits)[at_d]
    expected_return_h = tabular.prefix_rewards(mdp)[at_d] + mean[at_d]
    mean_cond_var = p_h @ var[at_d]  # E[Var(R | h)]
    var_cond_mean = p_h @ (expected_return_h - mean[0]) ** 2  # Var(E[R | h])
    var_return = var[0]
    assert var_return == pytest.approx(mean_cond_var + var_cond_mean, abs=1e-10)
    factor = k / (k - 1)
    predicted = {
        "bpo": factor * mean_cond_var,
        "rloo": factor * var_return,
        "gap": factor * var_cond_mean,
    }

    # BPO: K0 = 2 backbones, each branches once, before step d, into K leaves-to-be.
    bpo = sample_forests(
        mdp, logits, Branching(2, fixed_t=d, fixed_k=k, max_depth=1), num_forests, 20
    )
    adv, _ = advantages_and_weights(bpo)
    below = bpo.seg_parent >= num_forests
    assert np.all(bpo.node_t[num_forests:] == d) and np.all(bpo.seg_child[below] == -1)
    # Nodes are independent (one per backbone); average A^2 over each node's K children.
    node = bpo.seg_parent[below] - num_forests
    units_bpo = np.bincount(node, adv[below] ** 2) / k
    # RLOO: N = K independent trajectories per task.
    rloo = sample_forests(mdp, logits, Branching(root_k=k), num_forests, 21)
    adv_rloo, _ = advantages_and_weights(rloo, method="rloo")
    units_rloo = np.bincount(rloo.seg_parent, adv_rloo**2) / k

    v_bpo, se_bpo = _mean_and_se(units_bpo)
    v_rloo, se_rloo = _mean_and_se(units_rloo)
    gap, se_gap = v_rloo - v_bpo, np.hypot(se_bpo, se_rloo)
    measured = {"bpo": (v_bpo, se_bpo), "rloo": (v_rloo, se_rloo), "gap": (gap, se_gap)}
    report = {key: (measured[key][0], measured[key][1], predicted[key]) for key in predicted}
    for key, (value, se) in measured.items():
        # se = 0 only when every advantage is the same (exactly 0 here); then demand equality.
        assert abs(value - predicted[key]) <= MAX_Z * se + 1e-9, (key, report)
    assert predicted["gap"] > 10 * se_gap, f"the variance drop is not resolved: {report}"


# ---------------------------------------------------------------------- the text environment


step = env_base.step_result  # (observation, reward, done = terminated or truncated, info)


def _task(mdp, start=()):
    return tabular.TabularTask(task_id="t", mdp_name=mdp.name, start=start)


def test_env_plays_the_mdp():
    """Every action sequence through the env: rewards, done, won and unique observations."""
    env = env_base.make_env("tabular", max_steps=GENERIC.horizon, invalid_action_penalty=0.5)
    assert isinstance(env, env_base.TextEnv) and env.mdp is GENERIC
    trajs = tabular.enumerate_trajectories(GENERIC)
    seen = {}  # observation -> state
    for actions, rewards, ret in zip(trajs.actions, trajs.rewards, trajs.returns):
        obs, info = env.reset(options={"task": _task(GENERIC)})
        seen.setdefault(obs, info["state"])
        assert info["state"] == 0 and "goal" in info
        for t, action in enumerate(actions):
            result = step(env, f"a{action}")
            assert result.reward == rewards[t]
            assert result.done == (t == GENERIC.horizon - 1)
            assert not result.info["invalid_action"] and not result.info["truncated"]
            assert seen.setdefault(result.observation, result.info["state"]) == result.info["state"]
        assert result.info["won"] == (ret == trajs.returns.max())
        assert result.info["history"] == tuple(actions)
    # One observation per state, decision states and leaves alike.
    assert len(seen) == len(set(seen.values())) == GENERIC.num_states + GENERIC.num_leaves
    with pytest.raises(RuntimeError, match="after the episode"):
        step(env, "a0")


def test_env_invalid_actions_truncation_and_checks():
    env = tabular.TabularEnv(
        max_steps=3, invalid_action_penalty=0.25, instance="first_action_decides"
    )
    obs0, _ = env.reset(options={"task": _task(FIRST)})
    for bad in ["go north", None, "a2", ""]:
        result = step(env, bad)
        assert (
            result.reward == -0.25 and result.info["invalid_action"] and result.info["state"] == 0
        )
        assert result.observation.startswith("Invalid action") and obs0 in result.observation
        if result.done:
            break
    assert result.done and result.info["truncated"] and not result.info["won"]
    assert result.info["steps"] == 3
    # " A1. " parses as a1.
    env.reset(options={"task": _task(FIRST)})
    assert step(env, " A1. ").info["history"] == (1,)
    with pytest.raises(ValueError, match="made for MDP"):
        env.reset(options={"task": _task(GENERIC)})
    with pytest.raises(TypeError):
        env.reset(options={"task": env_base.Task("x")})
    with pytest.raises(RuntimeError, match="before reset"):
        step(tabular.TabularEnv(), "a0")
    with pytest.raises(ValueError):
        tabular.TabularEnv(max_steps=0)
    with pytest.raises(ValueError):
        tabular.TabularEnv(invalid_action_penalty=-1)


def test_env_snapshot_and_fork():
    """A copy mid-episode continues identically; the in-process sandbox pool forks the env."""
    env = tabular.TabularEnv(instance="generic")
    env.reset(options={"task": _task(GENERIC)})
    step(env, "a2")
    fork = copy.deepcopy(env)
    assert fork.mdp is env.mdp  # the immutable MDP is shared, not copied
    a = [step(env, x) for x in ("a0", "a1")]
    b = [step(fork, x) for x in ("a0", "a1")]
    assert a == b and a[-1].done

    from envs.sandbox import SandboxPool

    (task,) = env_base.load_tasks("tabular", None, "train", None)
    with SandboxPool("tabular", {"max_steps": 3}, backend="inprocess") as pool:
        sid, _, _ = pool.reset(task)
        pool.step(sid, "a1")
        handle = pool.snapshot(sid)
        children = pool.fork(handle, 3)
        results = pool.step_many([(c, f"a{i}") for i, c in enumerate(children)])
        assert [r.info["history"] for r in results] == [(1, 0), (1, 1), (1, 2)]
        assert [r.reward for r in results] == list(GENERIC.rewards[GENERIC.state_of((1,))])
        pool.release(handle)


def test_task_loader():
    tasks = env_base.load_tasks(
        "tabular", "/ignored", "valid", None, instance="generic", start_depth=1, copies=2
    )
    assert len(tasks) == 2 * GENERIC.num_actions
    assert len({t.task_id for t in tasks}) == len(tasks)
    env = env_base.make_env("tabular", max_steps=5, invalid_action_penalty=0.0)
    for task in tasks:
        _, info = env.reset(options={"task": task})
        assert info["history"] == task.start and len(task.walkthrough) == GENERIC.horizon - 1
        for action in task.walkthrough:
            result = step(env, action)
        assert result.done and result.info["won"]
    first = "first_action_decides"
    (task,) = env_base.load_tasks("tabular", None, "train", (first,), instance=first)
    assert task.walkthrough == ("a0",) * FIRST.horizon and task.task_type == first
    with pytest.raises(ValueError, match="does not include"):
        env_base.load_tasks("tabular", None, "train", ("generic",), instance=first)
