"""Tests of bpo_jax.estimators: hand-computed forests, validation, jit, and the NumPy oracle."""

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bpo_jax import estimators as est
from bpo_jax.estimators import kernels as est_kernels

_REF_PATH = Path(__file__).resolve().parents[1] / "bench" / "reference_estimator.py"
_spec = importlib.util.spec_from_file_location("reference_estimator", _REF_PATH)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

EPS = est.DEFAULT_EPS
TOL = dict(rtol=1e-5, atol=1e-5)

# Depth-1 forest: root 0 -> three trajectories with returns 0, 1, 2.
FLAT = dict(seg_parent=[0, 0, 0], seg_child=[-1, -1, -1], seg_reward=[0.0, 1.0, 2.0], num_nodes=1)

# Nested tree (segment: parent -> child, reward):
#   s0: 0 -> 1, 0.5    s1: 0 -> leaf, 1
#   s2: 1 -> leaf, 0   s3: 1 -> leaf, 1   s4: 1 -> 2, 1
#   s5: 2 -> leaf, 0   s6: 2 -> leaf, 4
# Node values: V(2) = 2, V(1) = (0 + 1 + 3)/3 = 4/3, V(0) = (11/6 + 1)/2 = 17/12.
NESTED = dict(
    seg_parent=[0, 0, 1, 1, 1, 2, 2],
    seg_child=[1, -1, -1, -1, 2, -1, -1],
    seg_reward=[0.5, 1.0, 0.0, 1.0, 1.0, 0.0, 4.0],
    num_nodes=3,
)
NESTED_VALUES = [11 / 6, 1.0, 0.0, 1.0, 3.0, 0.0, 4.0]
NESTED_BPO = [5 / 6, -5 / 6, 0 - (1 + 3) / 2, 1 - (0 + 3) / 2, 3 - (0 + 1) / 2, -4.0, 4.0]
NESTED_WEIGHTS = [1 / 2, 1 / 2, 1 / 6, 1 / 6, 1 / 6, 1 / 12, 1 / 12]


def _args(forest):
    return forest["seg_parent"], forest["seg_child"], forest["seg_reward"], forest["num_nodes"]


def _relabel(forest, seg_perm, node_perm, num_nodes=None):
    """The same forest with segments reordered and node ids renamed."""
    parent = np.asarray(forest["seg_parent"])[seg_perm]
    child = np.asarray(forest["seg_child"])[seg_perm]
    node_perm = np.asarray(node_perm)
    return dict(
        seg_parent=node_perm[parent],
        seg_child=np.where(child >= 0, node_perm[np.maximum(child, 0)], -1),
        seg_reward=np.asarray(forest["seg_reward"], np.float32)[seg_perm],
        num_nodes=num_nodes or forest["num_nodes"],
    )


@pytest.mark.parametrize("method", ["bpo", "rloo"])
def test_flat_leave_one_out(method):
    values, adv = est.tree_advantages(*_args(FLAT), method=method)
    np.testing.assert_allclose(values, [0.0, 1.0, 2.0], **TOL)
    np.testing.assert_allclose(adv, [-1.5, 0.0, 1.5], **TOL)
    assert values.dtype == adv.dtype == jnp.float32


def test_flat_grpo_uses_population_std():
    _, adv = est.tree_advantages(*_args(FLAT), method="grpo")
    std = math.sqrt(2 / 3)  # population std of [0, 1, 2]; the sample std would be 1
    np.testing.assert_allclose(adv, [-1 / (std + EPS), 0.0, 1 / (std + EPS)], **TOL)


def test_sibling_std_normalisation():
    _, adv = est.tree_advantages(*_args(FLAT), method="bpo", normalize="sibling_std", eps=0.5)
    std = math.sqrt(2 / 3)
    np.testing.assert_allclose(adv, [-1.5 / (std + 0.5), 0.0, 1.5 / (std + 0.5)], **TOL)


def test_equal_siblings_give_zero_not_nan():
    forest = dict(FLAT, seg_reward=[1.0, 1.0, 1.0])
    for method, normalize in [("bpo", "sibling_std"), ("grpo", "none")]:
        _, adv = est.tree_advantages(*_args(forest), method=method, normalize=normalize)
        np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0])


def test_nested_tree_by_hand():
    values, adv = est.tree_advantages(*_args(NESTED))
    np.testing.assert_allclose(values, NESTED_VALUES, **TOL)
    np.testing.assert_allclose(adv, NESTED_BPO, **TOL)
    np.testing.assert_allclose(est.segment_weights(*_args(NESTED)[:2], 3), NESTED_WEIGHTS, **TOL)


def test_nested_tree_grpo_and_sibling_std_by_hand():
    # Children of node 1 have values [0, 1, 3]: mean 4/3, population std sqrt(14/9).
    _, grpo = est.tree_advantages(*_args(NESTED), method="grpo")
    std1 = math.sqrt(((0 - 4 / 3) ** 2 + (1 - 4 / 3) ** 2 + (3 - 4 / 3) ** 2) / 3)
    np.testing.assert_allclose(grpo[2:5], (np.array([0, 1, 3]) - 4 / 3) / (std1 + EPS), **TOL)
    # Root's children [11/6, 1]: std = 5/12; node 2's children [0, 4]: std = 2.
    np.testing.assert_allclose(np.asarray(grpo)[[0, 1, 5, 6]], [1, -1, -1, 1], rtol=1e-5)
    _, norm = est.tree_advantages(*_args(NESTED), normalize="sibling_std")
    stds = np.array([5 / 12, 5 / 12, std1, std1, std1, 2.0, 2.0])
    np.testing.assert_allclose(norm, np.array(NESTED_BPO) / (stds + EPS), **TOL)


def test_order_and_node_ids_do_not_matter():
    seg_perm = np.array([4, 6, 0, 2, 5, 1, 3])
    shuffled = _relabel(
        NESTED, seg_perm, node_perm=[7, 2, 4], num_nodes=9
    )  # ids 0,1,3,5,6,8 unused
    values, adv = est.tree_advantages(*_args(shuffled))
    np.testing.assert_allclose(values, np.array(NESTED_VALUES)[seg_perm], **TOL)
    np.testing.assert_allclose(adv, np.array(NESTED_BPO)[seg_perm], **TOL)
    weights = est.segment_weights(shuffled["seg_parent"], shuffled["seg_child"], 9)
    np.testing.assert_allclose(weights, np.array(NESTED_WEIGHTS)[seg_perm], **TOL)


def test_padding_segments_get_zero():
    padded = dict(
        seg_parent=NESTED["seg_parent"][:3] + [-1] + NESTED["seg_parent"][3:] + [-1],
        seg_child=NESTED["seg_child"][:3] + [2] + NESTED["seg_child"][3:] + [-1],
        seg_reward=NESTED["seg_reward"][:3] + [9.0] + NESTED["seg_reward"][3:] + [-3.0],
        num_nodes=3,
    )
    real = [0, 1, 2, 4, 5, 6, 7]
    for method in est.METHODS:
        values, adv = est.tree_advantages(*_args(padded), method=method)
        v_ref, a_ref = est.tree_advantages(*_args(NESTED), method=method)
        assert values[3] == adv[3] == values[8] == adv[8] == 0.0
        np.testing.assert_allclose(np.asarray(values)[real], v_ref, **TOL)
        np.testing.assert_allclose(np.asarray(adv)[real], a_ref, **TOL)
    weights = est.segment_weights(padded["seg_parent"], padded["seg_child"], 3)
    assert weights[3] == weights[8] == 0.0
    np.testing.assert_allclose(np.asarray(weights)[real], NESTED_WEIGHTS, **TOL)


def test_all_padding():
    values, adv = est.tree_advantages([-1, -1], [-1, -1], [1.0, 2.0], 4)
    np.testing.assert_array_equal(values, [0.0, 0.0])
    np.testing.assert_array_equal(adv, [0.0, 0.0])


def test_weights_sum_to_one_per_depth_of_a_full_tree():
    # Root 0 (K=2) -> nodes 1 (K=3) and 2 (K=2); every path reaches depth 2.
    parent = [0, 0, 1, 1, 1, 2, 2]
    child = [1, 2, -1, -1, -1, -1, -1]
    weights = np.asarray(est.segment_weights(parent, child, 3))
    np.testing.assert_allclose(weights, [1 / 2, 1 / 2, 1 / 6, 1 / 6, 1 / 6, 1 / 4, 1 / 4], **TOL)
    assert weights[:2].sum() == pytest.approx(1.0)
    assert weights[2:].sum() == pytest.approx(1.0)
    # In the unbalanced tree the leaves (one per path) carry the whole mass.
    leaves = np.asarray(NESTED["seg_child"]) < 0
    assert np.asarray(est.segment_weights(*_args(NESTED)[:2], 3))[leaves].sum() == pytest.approx(1)


# Steps per segment of NESTED. Root-to-leaf paths (segments; steps; mass w):
#   s1 (3; 1/2)   s0 s2 (2+1 = 3; 1/6)   s0 s3 (2+4 = 6; 1/6)
#   s0 s4 s5 (2+2+1 = 5; 1/12)           s0 s4 s6 (2+2+3 = 7; 1/12)
NESTED_LEN = [2, 3, 1, 4, 2, 1, 3]
NESTED_PATH_LEN = [2, 3, 3, 6, 4, 5, 7]
_S2, _S3, _S5, _S6 = 1 / 6 / 3, 1 / 6 / 6, 1 / 12 / 5, 1 / 12 / 7
NESTED_TRAJECTORY = [_S2 + _S3 + _S5 + _S6, 1 / 2 / 3, _S2, _S3, _S5 + _S6, _S5, _S6]


def test_trajectory_weights_by_hand():
    parent, child = NESTED["seg_parent"], NESTED["seg_child"]
    weights = est.trajectory_weights(parent, child, NESTED_LEN, 3)
    np.testing.assert_allclose(weights, NESTED_TRAJECTORY, **TOL)
    lengths = est.path_lengths(parent, child, NESTED_LEN, 3)
    assert lengths.dtype == jnp.int32
    np.testing.assert_array_equal(lengths, NESTED_PATH_LEN)
    # Summed over its steps, each path counts once with its mass: the task's total is 1.
    assert float(np.dot(weights, NESTED_LEN)) == pytest.approx(1.0)
    # An independent group: (1/N) / (trajectory length).
    flat = est.trajectory_weights([0, 0, 0], [-1, -1, -1], [4, 2, 5], 1)
    np.testing.assert_allclose(flat, [1 / 12, 1 / 6, 1 / 15], **TOL)


def test_trajectory_weights_padding_and_empty_segments():
    # Root 0 branches before the first step (s0 and s1 have 0 steps); s1 ends at node 1, whose
    # children have 0 and 2 steps. A path of 0 steps counts as 1 step (s0, s2). Padding s4 has a
    # nonsense length that must be ignored.
    parent, child = [0, 0, 1, 1, -1], [-1, 1, -1, -1, -1]
    seg_len = [0, 0, 0, 2, 7]
    weights = est.trajectory_weights(parent, child, seg_len, 4)
    np.testing.assert_allclose(weights, [1 / 2, 1 / 4 + 1 / 8, 1 / 4, 1 / 8, 0.0], **TOL)
    np.testing.assert_array_equal(est.path_lengths(parent, child, seg_len, 4), [0, 0, 0, 2, 0])


def test_trajectory_weights_check_their_arguments():
    parent, child = NESTED["seg_parent"], NESTED["seg_child"]
    with pytest.raises(ValueError, match=r"seg_len\[2\] = -1.0 is not a number of steps"):
        est.trajectory_weights(parent, child, [2, 3, -1, 4, 2, 1, 3], 3)
    with pytest.raises(ValueError, match=r"seg_len\[0\] = 1.5"):
        est.path_lengths(parent, child, [1.5, 3, 1, 4, 2, 1, 3], 3)
    with pytest.raises(ValueError, match="seg_len"):
        est.trajectory_weights(parent, child, [1, 2], 3)
    with pytest.raises(ValueError, match="node 2 has 1 child"):
        est.trajectory_weights([0, 0, 2], [2, -1, -1], [1, 1, 1], 3)
    # Padding segments are not checked; under jit nothing is (the kernel runs on tracers).
    est.trajectory_weights([0, 0, -1], [-1, -1, -1], [1, 1, -5], 1)
    jitted = jax.jit(lambda n: est.trajectory_weights(parent, child, n, 3))
    np.testing.assert_allclose(jitted(jnp.asarray(NESTED_LEN)), NESTED_TRAJECTORY, **TOL)


def test_one_child_node_raises_with_node_id():
    # Node 2 has a single child segment.
    parent, child = [0, 0, 2], [2, -1, -1]
    with pytest.raises(ValueError, match="node 2 has 1 child"):
        est.tree_advantages(parent, child, [0.0, 1.0, 1.0], 3)
    with pytest.raises(ValueError, match="node 2 has 1 child"):
        est.segment_weights(parent, child, 3)
    # A root with one child is the "no root group" trap: also an error.
    with pytest.raises(ValueError, match="node 0 has 1 child"):
        est.tree_advantages([0], [-1], [1.0], 1)


def test_one_child_node_under_jit_gives_nan():
    fn = jax.jit(lambda p, c, r: est.tree_advantages(p, c, r, 3)[1])
    adv = np.asarray(fn(jnp.array([0, 0, 2]), jnp.array([2, -1, -1]), jnp.ones(3)))
    assert np.isnan(adv[2]) and np.isfinite(adv[:2]).all()


@pytest.mark.parametrize(
    "parent, child, match",
    [
        ([0, 0, 1, 1], [1, -1, -1, 2], "node 2 has 0 child"),  # ends at a childless node
        ([0, 0, 1, 1, 2, 2], [1, 1, -1, -1, -1, -1], "node 1 is entered by 2"),
        ([0, 0, 1, 1], [1, -1, 0, -1], "cycle"),
        ([0, 0, 5], [-1, -1, -1], r"seg_parent\[2\] = 5 is outside"),
        ([0, 0], [-1, -2], r"seg_child\[1\] = -2"),
    ],
)
def test_invalid_forests_raise(parent, child, match):
    with pytest.raises(ValueError, match=match):
        est.validate_forest(parent, child, 3)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        est.tree_advantages(*_args(FLAT), method="ppo")
    with pytest.raises(ValueError, match="unknown normalize"):
        est.tree_advantages(*_args(FLAT), normalize="batch")
    with pytest.raises(ValueError, match="already divides"):
        est.tree_advantages(*_args(FLAT), method="grpo", normalize="sibling_std")
    with pytest.raises(ValueError, match="shapes"):
        est.tree_advantages([0, 0], [-1, -1, -1], [0.0, 1.0], 1)
    with pytest.raises(ValueError, match="not finite"):
        est.tree_advantages([0, 0], [-1, -1], [0.0, np.nan], 1)


def test_numpy_and_jax_inputs_agree_exactly():
    np_args = (
        np.array(NESTED["seg_parent"], np.int64),
        np.array(NESTED["seg_child"], np.int64),
        np.array(NESTED["seg_reward"], np.float64),
    )
    jax_args = tuple(jnp.asarray(a) for a in np_args)
    for method in est.METHODS:
        out_np = est.tree_advantages(*np_args, 3, method=method)
        out_jax = est.tree_advantages(*jax_args, 3, method=method)
        for a, b in zip(out_np, out_jax):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        est.segment_weights(*np_args[:2], 3), est.segment_weights(*jax_args[:2], 3)
    )


def test_jit_compiles_once_for_fixed_shapes():
    traces = []

    @jax.jit
    def pipeline(parent, child, reward, step_segment):
        traces.append(None)  # runs only while tracing
        values, adv = est.tree_advantages(parent, child, reward, 3)
        weights = est.segment_weights(parent, child, 3)
        return values, est.expand_to_steps(adv * weights, step_segment)

    rng = np.random.default_rng(0)
    step_segment = jnp.array([0, 0, 1, 2, 3, 4, 4, 5, 6, -1])
    for _ in range(3):
        reward = jnp.asarray(rng.normal(size=7), jnp.float32)
        values, per_step = pipeline(
            jnp.array(NESTED["seg_parent"]), jnp.array(NESTED["seg_child"]), reward, step_segment
        )
    assert len(traces) == 1
    expected_v, expected_a = ref.tree_advantages(*_args(dict(NESTED, seg_reward=reward)))
    np.testing.assert_allclose(values, expected_v, **TOL)
    expected = ref.expand(expected_a * np.array(NESTED_WEIGHTS), np.asarray(step_segment))
    np.testing.assert_allclose(per_step, expected, **TOL)
    # The library's own kernel cache does not grow with new values either.
    before = est_kernels._tree_advantages_kernel._cache_size()
    est.tree_advantages(*_args(dict(NESTED, seg_reward=np.ones(7))))
    assert est_kernels._tree_advantages_kernel._cache_size() == before


def test_expand_to_steps_and_tokens():
    seg_values = jnp.array([10.0, 20.0, 30.0])
    steps = est.expand_to_steps(seg_values, np.array([2, 0, -1, 1]))
    np.testing.assert_array_equal(steps, [30.0, 10.0, 0.0, 20.0])
    tokens = est.expand_to_tokens(steps, np.array([[0, 0, 1], [3, -1, -1]]))
    np.testing.assert_array_equal(tokens, [[30.0, 30.0, 10.0], [20.0, 0.0, 0.0]])


def test_treerl_by_hand():
    # P = reward above the parent node, L = leaves under s (see treerl's docstring).
    v_root, v1, v2 = 17 / 12, 4 / 3, 2.0
    rows = [  # (P, V(s), V(parent), L)
        (0.0, 11 / 6, v_root, 4),
        (0.0, 1.0, v_root, 1),
        (0.5, 0.0, v1, 1),
        (0.5, 1.0, v1, 1),
        (0.5, 3.0, v1, 2),
        (1.5, 0.0, v2, 1),
        (1.5, 4.0, v2, 1),
    ]
    expected = [((p + v - v_root) + (v - vp)) / math.sqrt(n) for p, v, vp, n in rows]
    np.testing.assert_allclose(
        expected, [5 / 12, -5 / 6, -9 / 4, -1 / 4, 15 / 4 / math.sqrt(2), -23 / 12, 73 / 12]
    )
    adv = est.get_estimator("treerl")(est.Forest(**NESTED))
    np.testing.assert_allclose(adv, expected, **TOL)


def _gigpo_forest():
    """Task A (root 0): 3 trajectories; task B (root 1): 2 one-step trajectories.

    Steps, in time order per trajectory (obs id, reward):
      s0: (10, 0) (11, 1)            return-to-go [1, 1]
      s1: (10, 0) (12, 0)            [0, 0]
      s2: (10, 0) (11, 0) (13, 2)    [2, 2, 2]
      s3: (10, 3)                    [3]    task B: obs 10 again, but a separate group
      s4: (10, 5)                    [5]
    The step arrays interleave the trajectories and end with one padding step.
    """
    layout = [  # (segment, obs id, reward) in array order
        (2, 10, 0.0), (0, 10, 0.0), (3, 10, 3.0), (1, 10, 0.0), (2, 11, 0.0),
        (4, 10, 5.0), (0, 11, 1.0), (1, 12, 0.0), (2, 13, 2.0), (-1, 10, 7.0),
    ]  # fmt: skip
    seg, obs, reward = (np.array(col) for col in zip(*layout))
    return est.Forest(
        seg_parent=np.array([0, 0, 0, 1, 1]),
        seg_child=np.full(5, -1),
        seg_reward=np.array([1.0, 0.0, 2.0, 3.0, 5.0], np.float32),
        num_nodes=2,
        step_segment=seg,
        step_reward=reward.astype(np.float32),
        step_obs_id=obs,
    )


def test_gigpo_by_hand():
    forest = _gigpo_forest()
    g = 1 / (math.sqrt(2 / 3) + EPS)  # task A's GRPO scale for returns [1, 0, 2]
    episode = {0: 0.0, 1: -g, 2: g, 3: -1 / (1 + EPS), 4: 1 / (1 + EPS)}
    # Step terms: A/obs10 rtg [1, 0, 2] -> [0, -1, 1]; A/obs11 rtg [1, 2] -> [-0.5, 0.5];
    # obs 12 and 13 are singletons -> 0; B/obs10 rtg [3, 5] -> [-1, 1].
    step = [1.0, 0.0, -1.0, -1.0, 0.5, 1.0, -0.5, 0.0, 0.0, 0.0]
    seg = np.asarray(forest.step_segment)
    expected = [episode[s] + st if s >= 0 else 0.0 for s, st in zip(seg, step)]
    np.testing.assert_allclose(est.get_estimator("gigpo")(forest), expected, **TOL)
    half = [episode[s] + 0.5 * st if s >= 0 else 0.0 for s, st in zip(seg, step)]
    np.testing.assert_allclose(est.get_estimator("gigpo")(forest, step_weight=0.5), half, **TOL)


def test_forest_validate_checks_steps():
    forest = _gigpo_forest()
    forest.validate()
    with pytest.raises(ValueError, match="step rewards of segment 0 sum to 2"):
        bad = np.asarray(forest.step_reward).copy()
        bad[6] = 2.0
        forest.replace(step_reward=bad).validate()
    with pytest.raises(ValueError, match=r"step_segment\[0\] = 5"):
        forest.replace(step_segment=np.where(np.arange(10) == 0, 5, forest.step_segment)).validate()


def test_registry():
    assert est.estimator_names() == [
        "bpo",
        "bpo_shrink",
        "bpo_traj",
        "gae",
        "gigpo",
        "grpo",
        "rloo",
        "treerl",
    ]
    with pytest.raises(ValueError, match=r"unknown estimator 'ppo'; known: \['bpo', 'bpo_shrink'"):
        est.get_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        est.register_estimator("bpo")(lambda forest: None)
    assert est.get_estimator("gigpo").per_step and not est.get_estimator("bpo").per_step
    forest = est.Forest(**NESTED, step_segment=np.array([6, 0, -1, 4]))
    np.testing.assert_allclose(est.get_estimator("bpo")(forest), NESTED_BPO, **TOL)
    np.testing.assert_allclose(est.step_advantages(forest, "rloo"), [4.0, 5 / 6, 0.0, 2.5], **TOL)
    _, grpo = est.tree_advantages(*_args(NESTED), method="grpo")
    np.testing.assert_allclose(est.get_estimator("grpo")(forest), grpo, **TOL)


def test_estimators_jit_over_a_forest_pytree():
    """A traced Forest goes through the registry (no host validation), with and without step
    rewards: without, every step's return-to-go is its trajectory's return, which in this
    forest gives the same groups and values. Eight padding segments in front push segment ids
    past the number of steps (the 3-step segment becomes id 10 of 10 steps)."""
    forest = _gigpo_forest()
    expected = est.get_estimator("gigpo")(forest)
    pad = np.full(8, -1)
    shifted = forest.replace(
        seg_parent=np.concatenate([pad, forest.seg_parent]),
        seg_child=np.concatenate([pad, forest.seg_child]),
        seg_reward=np.concatenate([np.ones(8, np.float32), forest.seg_reward]),
        step_segment=np.where(forest.step_segment >= 0, forest.step_segment + 8, -1),
    )
    jitted = jax.jit(
        lambda f: (
            est.step_advantages(f, "gigpo"),
            est.step_advantages(f.replace(step_reward=None), "gigpo"),
        )
    )
    with_rewards, without = jitted(shifted)
    np.testing.assert_allclose(with_rewards, expected, **TOL)
    np.testing.assert_allclose(without, expected, **TOL)


# Interleaved steps take gigpo's sort path, contiguous ones the in-place path.
@pytest.mark.parametrize(
    "seed, k, depth, interleave", [(0, 2, 4, True), (1, 3, 3, False), (2, 4, 2, True)]
)
def test_random_forests_match_the_numpy_oracle(seed, k, depth, interleave):
    rng = np.random.default_rng(seed)
    f = ref.random_forest(
        rng, num_tasks=10, k=k, max_depth=depth, branch_prob=0.6, num_segments=400,
        num_steps=1200, interleave=interleave,
    )  # fmt: skip
    # One num_nodes for every case, so the kernels compile once (ids past the last are unused).
    assert f["num_nodes"] <= 200
    f["num_nodes"] = 200
    args = _args(f)
    for method, normalize in [("bpo", "none"), ("rloo", "sibling_std"), ("grpo", "none")]:
        values, adv = est.tree_advantages(*args, method=method, normalize=normalize)
        ref_values, ref_adv = ref.tree_advantages(*args, method=method, normalize=normalize)
        np.testing.assert_allclose(values, ref_values, **TOL)
        np.testing.assert_allclose(adv, ref_adv, **TOL)
    weights = est.segment_weights(f["seg_parent"], f["seg_child"], f["num_nodes"])
    np.testing.assert_allclose(weights, ref.segment_weights(*args[:2], args[3]), **TOL)
    seg_len = np.bincount(f["step_segment"][f["step_segment"] >= 0], minlength=400)
    lengths = est.path_lengths(f["seg_parent"], f["seg_child"], seg_len, f["num_nodes"])
    np.testing.assert_array_equal(lengths, ref.path_lengths(*args[:2], seg_len, args[3]))
    trajectory = est.trajectory_weights(f["seg_parent"], f["seg_child"], seg_len, f["num_nodes"])
    np.testing.assert_allclose(
        trajectory, ref.trajectory_weights(*args[:2], seg_len, args[3]), **TOL
    )
    # Every task's paths carry its whole mass once: the step-weighted sum is the task count.
    assert float(np.dot(trajectory, seg_len)) == pytest.approx(10, rel=1e-5)
    forest = est.Forest(**f)
    np.testing.assert_allclose(est.get_estimator("treerl")(forest), ref.treerl(*args), **TOL)
    steps = (f["step_segment"], f["step_obs_id"], f["step_reward"])
    np.testing.assert_allclose(
        est.get_estimator("gigpo")(forest, step_weight=0.7),
        ref.gigpo(*args, *steps, step_weight=0.7),
        **TOL,
    )


def test_gae_by_hand():
    # Trajectory 0: rewards 0, 1 with V 0.5, 0.8; trajectory 1: reward 0 with V 0.2; padding.
    seg = np.array([0, 0, 1, -1], np.int32)
    rewards = np.array([0.0, 1.0, 0.0, 0.0], np.float32)
    values = np.array([0.5, 0.8, 0.2, 0.0], np.float32)
    adv, ret = est.gae(seg, rewards, values, 0.9, 0.5)
    # delta_1 = 1 - 0.8 (the last step bootstraps from 0); delta_0 = 0.9 * 0.8 - 0.5;
    # A_0 = delta_0 + 0.9 * 0.5 * A_1.
    np.testing.assert_allclose(adv, [0.22 + 0.45 * 0.2, 0.2, -0.2, 0.0], **TOL)
    np.testing.assert_allclose(ret, [0.81, 1.0, 0.0, 0.0], **TOL)
    forest = est.Forest(
        seg_parent=np.array([0, 0, -1]),
        seg_child=np.array([-1, -1, -1]),
        seg_reward=np.array([1.0, 0.0, 0.0]),
        num_nodes=1,
        step_segment=seg,
        step_reward=rewards,
    )
    a = np.array([0.31, 0.2, -0.2])
    want = (a - a.mean()) / (a.std() + 1e-6)
    got = est.step_advantages(forest, "gae", values=values, gamma=0.9, lam=0.5, eps=1e-6)
    np.testing.assert_allclose(got, [*want, 0.0], **TOL)
    tree = est.Forest(**NESTED, step_segment=np.array([6, 0, -1, 4]), step_reward=np.zeros(4))
    with pytest.raises(ValueError, match="gae runs on independent trajectories"):
        est.step_advantages(tree, "gae", values=np.zeros(4), gamma=1.0, lam=1.0)
