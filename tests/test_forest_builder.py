"""The forest builder on its own: forests made by hand, without sandboxes or a policy."""

import numpy as np
import pytest

from bpo_jax.estimators import tree_advantages
from bpo_jax.rollout.forest import ComputeStats, StepRecord
from bpo_jax.rollout.forest_builder import ForestBuilder


def step(reward=0.0, name="a"):
    return StepRecord(
        prompt_ids=[1, 2],
        action_ids=[3],
        logprobs=np.zeros(1),
        entropies=np.zeros(1),
        action_text=name,
        observation="",
        reward=reward,
    )


def build_tree():
    """Task 0: two backbones; backbone 0 takes 1 step, branches into 3, the children end with
    rewards 1, 0, 0 after 1, 2, 1 more steps. Backbone 1 takes 2 steps, reward 0. Task 1: two
    one-step backbones, rewards 1 and 0."""
    b = ForestBuilder(num_tasks=2)
    p0, p1 = b.start_path(0, episode="e0"), b.start_path(0, episode="e1")
    q0, q1 = b.start_path(1), b.start_path(1)
    b.record(p0, step())
    c1, c2 = b.branch(p0, 2)
    assert (c1.episode, c1.depth, c1.t, c1.sid, c1.backbone) == ("e0", 1, 1, -1, 0)
    b.record(p0, step(1.0))
    b.finish(p0, {"won": True})
    b.record(c1, step())
    b.record(c1, step())
    b.finish(c1, {})
    b.record(c2, step())
    b.finish(c2, {"truncated": True})
    b.record(p1, step())
    b.record(p1, step())
    b.finish(p1, {})
    b.record(q0, step(1.0))
    b.finish(q0, {"won": True})
    b.record(q1, step())
    b.finish(q1, {"error": "fault"})
    return b.build(["t0", "t1"], ComputeStats(), [5.0, 2.0])


def test_segments_nodes_and_leaves():
    forest = build_tree()
    assert forest.num_nodes == 3 and forest.num_branch_points == 1
    # Segments in creation order: p0's first, p1, q0, q1, then the node's three children.
    parents = [s.parent for s in forest.segments]
    children = [s.child for s in forest.segments]
    assert parents == [0, 0, 1, 1, 2, 2, 2]
    assert children == [2, -1, -1, -1, -1, -1, -1]
    assert [len(s.steps) for s in forest.segments] == [1, 2, 1, 1, 1, 2, 1]
    won = [leaf.won for leaf in forest.leaves]
    assert won == [True, False, False, False, True, False]
    assert forest.leaves[2].truncated and forest.leaves[5].error == "fault"
    assert [len(p.steps) for p in forest.paths()] == [2, 3, 2, 2, 1, 1]
    np.testing.assert_array_equal(forest.task_cost, [5.0, 2.0])


def test_arrays_pad_and_unpad():
    forest = build_tree()
    a = forest.arrays()
    f = a.forest
    assert a.num_segments == 7 and a.num_steps == 9
    assert f.seg_parent.shape == (16,) and f.step_segment.shape == (16,) and f.num_nodes == 16
    np.testing.assert_array_equal(f.step_segment[:9], [0, 1, 1, 2, 3, 4, 5, 5, 6])
    assert (f.step_segment[9:] == -1).all() and (f.seg_parent[7:] == -1).all()
    np.testing.assert_allclose(f.seg_reward[:7], [0, 0, 1, 0, 1, 0, 0])
    x = np.arange(9, dtype=np.float32)
    np.testing.assert_array_equal(a.unpad_steps(a.pad_steps(x)), x)
    with pytest.raises(ValueError, match="expected 9 per-step values"):
        a.pad_steps(x[:3])
    np.testing.assert_array_equal(a.segments_to_steps(np.arange(7)), [0, 1, 1, 2, 3, 4, 5, 5, 6])
    # The estimator on the builder's arrays: node 2's children 1, 0, 0 -> V = 1/3 for seg 0;
    # task 0's root: segs 0 (1/3) and 1 (0); task 1's root: 1 and 0.
    values, adv = tree_advantages(f.seg_parent, f.seg_child, f.seg_reward, f.num_nodes, "rloo")
    np.testing.assert_allclose(values[:7], [1 / 3, 0, 1, 0, 1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(adv[:7], [1 / 3, -1 / 3, 1, -1, 1, -0.5, -0.5], atol=1e-6)


def test_step_weights_by_hand():
    forest = build_tree()
    # path_mass: root children 1/2; the node's children 1/2 * 1/3.
    mass = forest.step_weights("path_mass")
    np.testing.assert_allclose(mass, [0.5, 0.5, 0.5, 0.5, 0.5, 1 / 6, 1 / 6, 1 / 6, 1 / 6])
    # trajectory: sum over leaves below of mass / length. Leaves under seg 0: lengths 2, 3, 2
    # with mass 1/6 each.
    traj = forest.step_weights("trajectory")
    seg0 = (1 / 6) / 2 + (1 / 6) / 3 + (1 / 6) / 2
    expected = [seg0, 0.25, 0.25, 0.5, 0.5, (1 / 6) / 2, (1 / 6) / 3, (1 / 6) / 3, (1 / 6) / 2]
    np.testing.assert_allclose(traj, expected)
    np.testing.assert_allclose(forest.step_weights("uniform"), np.ones(9))
    np.testing.assert_allclose(forest.leaf_mass(), [1 / 6, 1 / 6, 1 / 6, 0.5, 0.5, 0.5])
    # Every path of a task counts once: the trajectory weights of a task sum to 1.
    task = np.array([0, 0, 0, 1, 1, 0, 0, 0, 0])
    assert traj[task == 0].sum() == pytest.approx(1.0)
    assert traj[task == 1].sum() == pytest.approx(1.0)


def test_cut_splits_a_finished_backbone():
    b = ForestBuilder(num_tasks=1)
    p, other = b.start_path(0), b.start_path(0)
    for r in (0.0, 0.0, 0.0, 1.0):
        b.record(p, step(r))
    b.finish(p, {"won": True})
    b.record(other, step())
    b.finish(other, {})
    cuts = b.cut(p, [1, 3], num_new=2)
    assert [t for t, _ in cuts] == [1, 3]
    assert [len(children) for _, children in cuts] == [2, 2]
    assert all(c.depth == 1 and c.backbone == 0 for _, cs in cuts for c in cs)
    assert [c.t for c in cuts[0][1]] == [1, 1]
    # The backbone is now seg 0 (1 step) -> node 1 -> seg (2 steps) -> node 2 -> seg (1 step).
    leaf = b.leaves[0]
    assert [len(b.segments[s].steps) for s in leaf.segments] == [1, 2, 1]
    assert [b.segments[s].child for s in leaf.segments] == [1, 2, -1]
    with pytest.raises(ValueError, match="strictly increasing"):
        b.cut(other, [2, 1], 1)


def test_misuse_is_refused():
    b = ForestBuilder(num_tasks=1)
    with pytest.raises(ValueError, match="task 3 is outside"):
        b.start_path(3)
    p = b.start_path(0)
    with pytest.raises(ValueError, match="at least one new child"):
        b.branch(p, 0)
    with pytest.raises(ValueError, match="2 task ids for 1 tasks"):
        b.build(["a", "b"], ComputeStats(), [0.0])


def test_branch_metrics_by_hand():
    from bpo_jax.rl import branch_metrics

    # One branch point, its children's values 1, 0, 0.
    m = branch_metrics(build_tree())
    assert m["train/branch_points_divergent"] == 1.0
    assert m["train/branch_children_var"] == pytest.approx(np.var([1.0, 0.0, 0.0]))
    # Backbone 0 branched after its first step: the branch point is at step 1.
    assert {k: v for k, v in m.items() if k.startswith("train/branch_step/")} == {
        "train/branch_step/1": 1
    }


def test_branch_steps_of_nested_branch_points():
    from bpo_jax.rl import branch_steps

    # Task 0's backbone branches after 2 steps (node A); one of A's children branches again
    # after 1 more step (node B, step 3). Task 1's backbone branches at its start (step 0).
    b = ForestBuilder(num_tasks=2)
    p, q = b.start_path(0), b.start_path(1)
    b.record(p, step())
    b.record(p, step())
    (c,) = b.branch(p, 1)
    b.record(c, step())
    (d,) = b.branch(c, 1)
    (e,) = b.branch(q, 1)
    for path in (p, c, d, q, e):
        b.record(path, step())
        b.finish(path, {})
    forest = b.build(["t0", "t1"], ComputeStats(), [1.0, 1.0])
    assert forest.num_branch_points == 3
    assert sorted(branch_steps(forest)) == [0, 2, 3]
