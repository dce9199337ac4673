"""Episodes of different lengths: what each step weighting estimates, exactly, through the engine.

The `variable_length` MDP ends some episodes before the horizon (`TreeMDP.stops`). The real
rollout engine (`play_forest`: sandbox pool, branch planner, forest builder, estimator kernels,
`RolloutForest.step_weights`) plays it with a softmax-table policy whose score is exact, and the
mean per-task gradient is compared with exact targets from `envs.tabular.exact`:
- `path_mass` weighting: dJ, for RLOO and for BPO trees, with and without a spent budget;
- `trajectory` weighting (the default, 1 / path length): for RLOO, `length_normalized_grad`
  (`dE[R/L] - J dE[1/L]`); for a BPO tree, `expected_tree_gradient`, which depends on K and on
  the branch depth, and differs from both dJ and the RLOO target.
Tolerance: 4 standard errors per component, with a check that the differences that must show
are many standard errors wide.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import play_tabular, z_max

from bpo_jax.estimators import step_advantages
from bpo_jax.rollout.branching import make_selector
from bpo_jax.rollout.engine import TreeSpec
from envs import base as env_base
from envs.sandbox import SandboxPool
from envs.tabular import exact, load_tasks, make_mdp, random_logits
from envs.tabular.policy import TabularPolicy, forest_task_gradients

MAX_Z = 4.0
SEED = 3  # Episodes of 1, 2 and 4 steps, stops at depths 1 and 2.
MDP = make_mdp("variable_length", SEED)
LOGITS = random_logits(MDP, seed=1, scale=0.7)


def test_instance_has_variable_lengths_and_exact_math():
    trajs = exact.enumerate_trajectories(MDP)
    assert set(trajs.lengths.tolist()) == {1, 2, 4}
    p = exact.trajectory_probs(MDP, LOGITS, trajs)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    # Every episode once: its last state leads to a terminal state, and all are distinct.
    last = trajs.states[np.arange(len(p)), trajs.lengths - 1]
    ends = MDP.child(last, trajs.actions[np.arange(len(p)), trajs.lengths - 1])
    assert np.all(MDP.terminal[ends]) and len(set(ends.tolist())) == len(p)
    # Gradients of E[R] and E[R / L] against central differences.
    inv_len = 1.0 / trajs.lengths
    h = 1e-5
    for values in (trajs.returns, trajs.returns * inv_len):
        grad = exact.expectation_grad(MDP, LOGITS, values)
        fd = np.zeros_like(grad)
        for idx in np.ndindex(*grad.shape):
            bump = np.zeros_like(LOGITS)
            bump[idx] = h
            up = exact.trajectory_probs(MDP, LOGITS + bump, trajs) @ values
            down = exact.trajectory_probs(MDP, LOGITS - bump, trajs) @ values
            fd[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(grad, fd, atol=1e-8, rtol=1e-6)
    # Conditional moments and visit probabilities by enumeration, stopping states included.
    mean, var = exact.reward_to_go_moments(MDP, LOGITS)
    visit = exact.state_visit_probs(MDP, LOGITS)
    assert mean[0] == pytest.approx(p @ trajs.returns, abs=1e-12)
    assert var[0] == pytest.approx(p @ (trajs.returns - mean[0]) ** 2, abs=1e-12)
    for s in np.flatnonzero(MDP.stops & MDP.reachable[: MDP.num_states]):
        assert mean[s] == var[s] == 0.0
        t = MDP.depth[s]
        rows = (trajs.lengths == t) & (
            MDP.child(trajs.states[:, t - 1], trajs.actions[:, t - 1]) == s
        )
        assert visit[s] == pytest.approx(p[rows].sum(), abs=1e-12) and visit[s] > 0


def test_env_ends_episodes_at_stopping_states():
    env = env_base.make_env("tabular", instance="variable_length", seed=SEED)
    (task,) = load_tasks(None, "train", instance="variable_length", seed=SEED)
    trajs = exact.enumerate_trajectories(MDP)
    for actions, length, ret in zip(trajs.actions, trajs.lengths, trajs.returns):
        env.reset(options={"task": task})
        for t in range(length):
            result = env_base.step_result(env, f"a{actions[t]}")
            assert result.done == (t == length - 1)
        assert result.info["mdp_return"] == pytest.approx(ret)
        assert result.info["won"] == (ret >= trajs.returns.max() - 1e-9)


def test_expected_tree_gradient_recursion():
    """The recursion reproduces dJ with path masses, the RLOO target at depth 0, and dJ / H on a
    fixed-horizon MDP; with variable lengths its trajectory target moves with K and depth."""
    dj = exact.objective_grad(MDP, LOGITS)
    target_rloo = exact.length_normalized_grad(MDP, LOGITS)
    for depth in range(MDP.horizon):
        for k in (2, 3):
            pm = exact.expected_tree_gradient(MDP, LOGITS, depth, k, "path_mass")
            np.testing.assert_allclose(pm, dj, atol=1e-12)
    np.testing.assert_allclose(
        exact.expected_tree_gradient(MDP, LOGITS, 0, 2, "trajectory"), target_rloo, atol=1e-12
    )
    tree = exact.expected_tree_gradient(MDP, LOGITS, 1, 2, "trajectory")
    assert np.abs(tree - target_rloo).max() > 0.05 and np.abs(tree - dj / MDP.horizon).max() > 0.1
    fixed = make_mdp("generic", 0, horizon=4, num_actions=2)
    logits = random_logits(fixed, seed=1, scale=0.7)
    for depth, k in ((0, 2), (1, 3), (2, 2)):
        np.testing.assert_allclose(
            exact.expected_tree_gradient(fixed, logits, depth, k, "trajectory"),
            exact.objective_grad(fixed, logits) / fixed.horizon,
            atol=1e-12,
        )


def engine_gradients(spec: TreeSpec, method: str, num_tasks: int, seed: int):
    """Per-task gradients of engine forests under both weightings ({weighting: [tasks, D]})."""
    policy = TabularPolicy(LOGITS)
    tasks = load_tasks(None, "train", instance="variable_length", seed=SEED, copies=num_tasks)
    with SandboxPool(
        "tabular", {"instance": "variable_length", "seed": SEED}, backend="inprocess"
    ) as pool:
        selector = make_selector("interval", interval=1)
        forest = play_tabular(
            pool, policy, tasks, spec, seed=seed, horizon=MDP.horizon, selector=selector
        )
    arrays = forest.arrays()
    adv = arrays.unpad_steps(np.asarray(step_advantages(arrays.forest, method)))
    grads = {
        w: forest_task_gradients(forest, policy, forest.step_weights(w) * adv)
        for w in ("trajectory", "path_mass")
    }
    return grads, forest


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,depth,k", [("rloo", 0, 2), ("bpo", 1, 2), ("bpo", 2, 2)], ids=["rloo", "d1", "d2"]
)
def test_engine_weightings_on_variable_lengths(method, depth, k):
    """path_mass estimates dJ; trajectory estimates the exact targets above, not dJ."""
    root = 4 if method == "rloo" else 2
    spec = TreeSpec(root, num_branches=k, branch_budget=100 if depth else 0, max_depth=depth)
    grads, forest = engine_gradients(spec, method, num_tasks=1500, seed=depth)
    if depth:
        lengths = {sum(len(forest.segments[s].steps) for s in lf.segments) for lf in forest.leaves}
        assert lengths == {1, 2, 4} and forest.num_branch_points > 1000
    dj = exact.objective_grad(MDP, LOGITS)
    target = exact.expected_tree_gradient(MDP, LOGITS, depth, k, "trajectory")
    assert z_max(grads["path_mass"], dj) < MAX_Z
    assert z_max(grads["trajectory"], target) < MAX_Z
    # The default weighting does not estimate dJ (nor dJ over any one constant) ...
    assert z_max(grads["trajectory"], dj / MDP.horizon) > 4 * MAX_Z
    if method == "bpo":
        # ... and a tree's target is not RLOO's: the two estimate different updates.
        assert z_max(grads["trajectory"], exact.length_normalized_grad(MDP, LOGITS)) > 4 * MAX_Z


@pytest.mark.slow
def test_engine_path_mass_is_unbiased_with_a_spent_budget():
    """With a `target` budget that cuts the trees at random, branch decisions depend on what
    other paths spent (their lengths), never on the children's own futures: path masses still
    give dJ."""
    spec = TreeSpec(
        2, num_branches=2, branch_budget=3, max_depth=2, budget=10.0, budget_unit="env_steps"
    )
    grads, forest = engine_gradients(spec, "bpo", num_tasks=1500, seed=7)
    # Short episodes leave budget no branch can use: the trees spend about 0.73 of it here.
    assert 0.6 < np.mean(forest.spend_ratio) <= 1.05
    counts = np.bincount(
        [forest.node_task[n] for n in range(1500, forest.num_nodes)], minlength=1500
    )
    assert len(set(counts.tolist())) >= 3  # the budget really cuts trees differently
    assert z_max(grads["path_mass"], exact.objective_grad(MDP, LOGITS)) < MAX_Z
