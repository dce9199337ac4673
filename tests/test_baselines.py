"""`bpo_traj` and `bpo_shrink`: BPO's tree with the task's other backbones in the baseline.

Hand-computed values, the identities with `bpo` / `rloo` where the baselines coincide, and
unbiasedness against exact gradients of tabular MDPs (forests of `tabular_trees.sample_trees`;
4 standard errors per component, as `tests/test_estimator_mdp.py`): with path masses the mean
gradient is dJ for every fixed lam, early episode ends included; with the `trajectory`
weighting on variable lengths it is `exact.expected_tree_gradient(..., shrink=lam)`, which
moves with lam. One engine run (`play_forest`, slow) checks the registry path end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import play_tabular, z_max
from tabular_trees import sample_trees, task_gradients

from bpo_jax import estimators as est
from bpo_jax.algorithms import get_algorithm
from envs import tabular
from envs.tabular import exact

MAX_Z = 4.0


def _small_forest():
    """Root 0 with backbones of rewards 1, 2, 0; the first branches (node 1) into leaves of
    rewards 3 and 1."""
    return est.Forest(
        seg_parent=np.array([0, 0, 0, 1, 1, -1]),
        seg_child=np.array([1, -1, -1, -1, -1, -1]),
        seg_reward=np.array([1.0, 2.0, 0.0, 3.0, 1.0, 0.0]),
        num_nodes=4,
    )


def test_values_by_hand():
    """Backbones: V = (3, 2, 0), the root's leave-one-out advantages (2, 0.5, -2.5) for all
    three. Below node 1 (P = 1): bpo compares 3 with 1 and 1 with 3 (+-2); bpo_traj compares
    P + V = 4 and 2 with the other backbones' mean value 1 (3, 1); lam = 0.25 mixes them."""
    forest = _small_forest()
    root = [2.0, 0.5, -2.5]
    expected = {
        "bpo": root + [2.0, -2.0, 0.0],
        "bpo_traj": root + [3.0, 1.0, 0.0],
        "bpo_shrink": root + [0.25 * 2 + 0.75 * 3, 0.25 * -2 + 0.75 * 1, 0.0],
    }
    for name, want in expected.items():
        options = {"shrink": 0.25} if name == "bpo_shrink" else {}
        np.testing.assert_allclose(est.get_estimator(name)(forest, **options), want, atol=1e-6)
    np.testing.assert_allclose(
        est.get_estimator("bpo_shrink")(forest), root + [2.5, -0.5, 0.0], atol=1e-6
    )
    assert est.DEFAULT_SHRINK == 0.5


def _nested_forest():
    mdp = tabular.make_mdp("generic", 0)
    logits = tabular.random_logits(mdp, seed=1, scale=0.8)
    coin = np.random.default_rng(5).uniform(0.15, 0.85, mdp.num_states)
    trees = sample_trees(
        mdp, logits, 300, root_k=3, branch_at=(1,), k=2, coin=coin, coin_k=3, max_depth=2
    )
    return trees.padded()[0]


def test_identities_with_bpo_and_rloo():
    """lam = 1 is bpo and lam = 0 bpo_traj, bit for bit; lam mixes linearly; on independent
    groups (depth-1 forests) every lam is rloo."""
    forest = _nested_forest()
    bpo = np.asarray(est.get_estimator("bpo")(forest))
    traj = np.asarray(est.get_estimator("bpo_traj")(forest))
    assert np.all(np.isfinite(traj)) and np.abs(traj - bpo).max() > 0.5
    np.testing.assert_array_equal(est.get_estimator("bpo_shrink")(forest, shrink=1.0), bpo)
    np.testing.assert_array_equal(est.get_estimator("bpo_shrink")(forest, shrink=0.0), traj)
    for lam in (0.3, 1.7):
        np.testing.assert_allclose(
            est.shrunk_advantages(forest, lam), lam * bpo + (1 - lam) * traj, atol=1e-5
        )
    mdp = tabular.make_mdp("generic", 0)
    groups = sample_trees(mdp, tabular.random_logits(mdp, seed=1), 200, root_k=4).padded()[0]
    rloo = np.asarray(est.get_estimator("rloo")(groups))
    np.testing.assert_array_equal(est.get_estimator("bpo_traj")(groups), rloo)
    np.testing.assert_allclose(est.get_estimator("bpo_shrink")(groups, shrink=0.3), rloo, 1e-6)


def test_registered_as_tree_algorithms():
    for name in ("bpo_traj", "bpo_shrink"):
        algo = get_algorithm(name)
        assert (algo.topology, algo.estimator, algo.uses_normalize) == ("tree", name, False)
        assert algo.estimator_options(None) == {}
        assert name in est.estimator_names()


def test_shrink_lambda():
    """lam* minimises W + lam^2 W/m + (1 - lam)^2 (B + Var(b_t)) (relative to sigma^2)."""
    grid = np.linspace(0, 1, 100_001)
    for f, v, m, w in [(0.3, 0.1, 3, None), (0.8, 0.05, 1, 0.1), (0.05, 0.25, 2, None)]:
        w_ = 1 - f if w is None else w
        loss = w_ + grid**2 * w_ / m + (1 - grid) ** 2 * (f + v)
        assert est.shrink_lambda(f, v, m, w) == pytest.approx(grid[np.argmin(loss)], abs=1e-4)
    assert est.shrink_lambda(1.0, 0.0, 3) == 1.0 and est.shrink_lambda(0.0, 0.0, 3) == 0.0
    assert est.shrink_lambda(-0.2, 0.0, 3) == 0.0 and est.shrink_lambda(1.3, 0.1, 3) == 1.0
    lams = [0.6 / (0.6 + 0.5 / 3), 0.3 / (0.3 + 0.8 / 3)]
    np.testing.assert_allclose(est.shrink_lambda([0.5, 0.2], 0.1, 3), lams)
    parts = {"between": [1.0, 2.0], "within": [2.0, 4.0], "var_return": [3.0, 6.0]}
    parts |= {"var_baseline": [0.3, 0.6], "m": [3.0, 6.0], "branch_points": [1, 2]}
    assert est.lambda_from_parts(parts) == pytest.approx(est.shrink_lambda(1 / 3, 0.1, 3, 2 / 3))
    with pytest.raises(ValueError, match="no branch points"):
        est.lambda_from_parts({k: [] for k in parts})


# ------------------------------------------------------------------------------- unbiasedness


def _gradients(mdp, logits, trees, lam, weighting="path_mass"):
    forest, seg_len = trees.padded()
    n = len(trees.seg_parent)
    if weighting == "path_mass":
        w = est.segment_weights(forest.seg_parent, forest.seg_child, forest.num_nodes)
    else:
        w = est.trajectory_weights(forest.seg_parent, forest.seg_child, seg_len, forest.num_nodes)
    adv = np.asarray(est.shrunk_advantages(forest, lam), np.float64)[:n]
    return task_gradients(mdp, logits, trees, np.asarray(w, np.float64)[:n] * adv)


def _coin(mdp, seed):
    return np.random.default_rng(seed).uniform(0.15, 0.85, mdp.num_states)


_GENERIC = tabular.make_mdp("generic", 0)
_FIRST = tabular.make_mdp("first_action_decides")
FIXED_HORIZON = {
    # Nested branch points: a fixed one, and a state-dependent coin at the other steps.
    "generic": (_GENERIC, dict(root_k=2, branch_at=(1,), coin=_coin(_GENERIC, 5), coin_k=3)),
    "first_action_decides": (_FIRST, dict(root_k=3, branch_at=(2,), coin=_coin(_FIRST, 6))),
}


@pytest.mark.parametrize("case", list(FIXED_HORIZON))
def test_unbiased_on_fixed_horizons(case):
    mdp, branching = FIXED_HORIZON[case]
    logits = tabular.random_logits(mdp, seed=2, scale=0.8)
    trees = sample_trees(mdp, logits, 40_000, max_depth=2, seed=10, **branching)
    assert np.mean(trees.seg_child[trees.seg_parent >= trees.num_tasks] >= 0) > 0.05  # nested
    dj = exact.objective_grad(mdp, logits)
    for lam in (0.0, 0.3, 1.7):
        grads = _gradients(mdp, logits, trees, lam)
        assert z_max(grads, dj) < MAX_Z, (case, lam)
        se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
        assert MAX_Z * se.max() < 0.1 * np.abs(dj).max()  # a 10% bias would show


_VARIABLE = tabular.make_mdp("variable_length", 3)  # Episodes of 1, 2 and 4 steps.
_VARIABLE_LOGITS = tabular.random_logits(_VARIABLE, seed=1, scale=0.7)


@pytest.mark.parametrize("depth", [1, 2])
def test_unbiased_on_variable_lengths(depth):
    """Branching at every step 1 .. depth (K = 2): path masses give dJ; the trajectory
    weighting gives the exact tree target for the same lam, a target lam really moves."""
    mdp, logits = _VARIABLE, _VARIABLE_LOGITS
    steps = tuple(range(1, depth + 1))
    trees = sample_trees(mdp, logits, 40_000, root_k=2, branch_at=steps, max_depth=depth, seed=3)
    forest, seg_len = trees.padded()
    lengths = est.path_lengths(forest.seg_parent, forest.seg_child, seg_len, forest.num_nodes)
    leaves = (forest.seg_parent >= 0) & (forest.seg_child < 0)
    assert set(np.asarray(lengths)[leaves].tolist()) == {1, 2, 4}
    dj = exact.objective_grad(mdp, logits)
    bpo_target = exact.expected_tree_gradient(mdp, logits, depth, 2, "trajectory")
    for lam in (0.0, 0.3):
        assert z_max(_gradients(mdp, logits, trees, lam), dj) < MAX_Z, lam
        grads = _gradients(mdp, logits, trees, lam, "trajectory")
        target = exact.expected_tree_gradient(mdp, logits, depth, 2, "trajectory", shrink=lam)
        assert z_max(grads, target) < MAX_Z, lam
        assert z_max(grads, bpo_target) > 4 * MAX_Z, lam


def test_expected_tree_gradient_shrink():
    """shrink = 1 is the bpo target; path masses give dJ for every lam; on a fixed horizon the
    trajectory target is dJ / H for every lam (the baseline's mean then cancels)."""
    mdp, logits = _VARIABLE, _VARIABLE_LOGITS
    dj = exact.objective_grad(mdp, logits)
    for lam in (0.0, 0.4, 1.5):
        pm = exact.expected_tree_gradient(mdp, logits, 2, 2, "path_mass", shrink=lam)
        np.testing.assert_allclose(pm, dj, atol=1e-12)
    fixed = tabular.make_mdp("generic", 0, horizon=4, num_actions=2)
    fixed_logits = tabular.random_logits(fixed, seed=1, scale=0.7)
    np.testing.assert_allclose(
        exact.expected_tree_gradient(fixed, fixed_logits, 2, 3, "trajectory", shrink=0.2),
        exact.objective_grad(fixed, fixed_logits) / fixed.horizon,
        atol=1e-12,
    )


@pytest.mark.slow
def test_engine_forests_on_variable_lengths():
    """The real engine (sandbox pool, interval rule, forest builder) and the registry: bpo_shrink
    with path masses gives dJ, with trajectory weights the exact tree target."""
    from bpo_jax.rollout.branching import make_selector
    from bpo_jax.rollout.engine import TreeSpec
    from envs.sandbox import SandboxPool
    from envs.tabular.policy import TabularPolicy, forest_task_gradients

    mdp, logits, lam = _VARIABLE, _VARIABLE_LOGITS, 0.3
    policy = TabularPolicy(logits)
    tasks = tabular.load_tasks(None, "train", instance="variable_length", seed=3, copies=1500)
    spec = TreeSpec(2, num_branches=2, branch_budget=100, max_depth=1)
    with SandboxPool(
        "tabular", {"instance": "variable_length", "seed": 3}, backend="inprocess"
    ) as pool:
        forest = play_tabular(
            pool, policy, tasks, spec, seed=4, horizon=mdp.horizon,
            selector=make_selector("interval", interval=1),
        )  # fmt: skip
    arrays = forest.arrays()
    adv = arrays.unpad_steps(
        np.asarray(est.step_advantages(arrays.forest, "bpo_shrink", shrink=lam))
    )
    assert forest.num_branch_points > 1000
    for weighting, target in [
        ("path_mass", exact.objective_grad(mdp, logits)),
        ("trajectory", exact.expected_tree_gradient(mdp, logits, 1, 2, shrink=lam)),
    ]:
        grads = forest_task_gradients(forest, policy, forest.step_weights(weighting) * adv)
        assert z_max(grads, target) < MAX_Z, weighting
