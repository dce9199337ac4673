"""The branch planner: budget modes, the acceptance coin, spend on the exact MDPs."""

import numpy as np
import pytest
import scipy.stats
from test_engine_mdp import assert_matches_exact, sampled_gradients

from bpo_jax.rollout.branching import (
    CostModel,
    LengthModel,
    action_distribution_entropy,
    make_selector,
)
from bpo_jax.rollout.engine import TreeSpec
from bpo_jax.rollout.forest_builder import ForestBuilder
from bpo_jax.rollout.planner import BranchPlanner


def _started(spec, selector, horizon, backbones, seed):
    """A planner for one task (`spec`, `selector`, env-step costs) with `backbones` paths at
    t = 0; every path lasts `horizon` steps: remaining(t) = horizon - t."""
    lengths = LengthModel(horizon)
    for _ in range(8):
        lengths.add(horizon)
    p = BranchPlanner(spec, selector, lengths, CostModel("env_steps"), num_tasks=1, seed=seed)
    builder = ForestBuilder(1)
    live = [builder.start_path(0) for _ in range(backbones)]
    for path in live:
        p.add_backbone(path)
    return p, live


def planner(mode, budget, seed=0, horizon=4):
    spec = TreeSpec(
        root_group=2, num_branches=2, branch_budget=1, max_depth=1, budget=budget, budget_mode=mode
    )
    selector = make_selector("uniform", branch_prob=1.0, seed=seed)
    return _started(spec, selector, horizon, backbones=2, seed=seed)


def test_cap_never_takes_a_branch_that_does_not_fit():
    # Two backbones at t = 0 commit 2 x 4 steps; a branch there adds 4 more.
    p, live = planner("cap", budget=11.0)
    assert p.choose(live, np.zeros(2)) == []
    p, live = planner("cap", budget=12.0)
    assert p.choose(live, np.zeros(2)) != [] and len(p.choose(live, np.zeros(2))) <= 1


def test_target_takes_a_partly_fitting_branch_with_probability_slack_over_cost():
    # Slack 11 - 8 = 3 of a branch costing 4: taken with probability 3/4; the second one never.
    taken = []
    for seed in range(2000):
        p, live = planner("target", budget=11.0, seed=seed)
        taken.append(len(p.choose(live, np.zeros(2))))
    taken = np.array(taken)
    assert set(taken) <= {0, 1}
    assert abs(taken.mean() - 0.75) < 4 * np.sqrt(0.75 * 0.25 / len(taken))
    # Expected committed spend = 8 + 0.75 * 4 = 11: the budget, on average.


def test_refund_and_charge():
    p, live = planner("target", budget=100.0)
    chosen = p.choose(live, np.zeros(2))
    assert len(chosen) == 2 and p.branches_left == [0, 0]
    p.refund(live[0])
    assert p.branches_left == [1, 0]
    p.charge(live[1], num_tokens=5)
    assert p.spent[0] == 1.0 and live[1].cost == 1.0  # env_steps: one action, one unit.
    live[1].t = 4
    p.finished(live[1])
    assert list(p.costs.episodes) == [1.0] and p.lengths.lengths[-1] == 4


def two_level_spec(root_group, **fields):
    """Trees of K = 2 children at up to 2 branch points a backbone, 2 levels deep, their budget
    counted in env steps; `fields` are TreeSpec's others."""
    return TreeSpec(
        root_group=root_group, num_branches=2, branch_budget=2, max_depth=2,
        budget_unit="env_steps", **fields,
    )  # fmt: skip


def budget_spec(mode):
    """Backbones cost 3 + 3 env steps (H = 3); 8.5 leaves room for part of a branch."""
    return two_level_spec(2, budget=8.5, budget_mode=mode)


@pytest.mark.parametrize("mode", ["target", "cap"])
def test_spend_on_the_exact_mdp(mode):
    """Trees spend the budget on average in target mode, and under-spend it in cap mode."""
    spec = budget_spec(mode)
    selector = make_selector("uniform", branch_prob=0.5, seed=1)
    _, _, forest = sampled_gradients("generic", selector, spec, num_tasks=400, seed=2)
    ratio = forest.spend_ratio
    assert ratio.shape == (400,)
    if mode == "target":
        assert 0.95 <= ratio.mean() <= 1.05, ratio.mean()
    else:
        assert ratio.max() <= 1.0 + 1e-9 and ratio.mean() < 0.95


def test_target_budget_keeps_the_gradient_exact():
    """The acceptance coin and the budget never look at a node's children: still unbiased."""
    spec = budget_spec("target")
    selector = make_selector("uniform", branch_prob=0.5, seed=3)
    grads, exact, forest = sampled_gradients("generic", selector, spec, num_tasks=4000, seed=0)
    assert forest.num_branch_points > 1000
    assert 0.95 <= forest.spend_ratio.mean() <= 1.05
    assert_matches_exact(grads, exact)


def probe_planner(share, seed):
    """One task, three backbones at t = 0 of 4-step episodes (12 committed) and a budget of 16."""
    spec = TreeSpec(root_group=3, branch_budget=1, budget=16.0, probe_share=share)
    return _started(spec, None, 4, backbones=3, seed=seed)


def test_probes_spend_their_share_of_the_slack():
    # share 1: probes wherever the slack (4) pays for them (2 each) and leaves some: one path.
    p, live = probe_planner(1.0, 0)
    assert p.probe_candidates(live, probes=2) == [0]
    # share 1/2: each path probes with probability 1/2 * slack / (2 * 12 steps left): the task's
    # expected probe spend over its remaining steps is half its slack.
    counts = []
    for seed in range(4000):
        p, live = probe_planner(0.5, seed)
        counts.append(len(p.probe_candidates(live, probes=2)))
    q = 0.5 * 4 / (2 * 12)  # Until one path probes; after it the slack (2) pays for none.
    expected = 1 - (1 - q) ** 3
    assert set(counts) == {0, 1}
    assert abs(np.mean(counts) - expected) < 4 * np.sqrt(expected * (1 - expected) / len(counts))
    with pytest.raises(ValueError, match="probe_share"):
        TreeSpec(root_group=3, probe_share=0.0)


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_probe_share_keeps_the_gradient_exact_and_branches_more_at_matched_spend():
    """K0 = 3 against a budget of 4 episodes leaves one episode of slack: probing every step
    spends it on probes; probing half of it leaves more for branches. Both stay unbiased."""
    points = {}
    for share in (1.0, 0.5):
        spec = two_level_spec(3, budget_episodes=4.0, probe_share=share)
        selector = make_selector("action_samples", probes=2)
        grads, exact, forest = sampled_gradients("generic", selector, spec, 3000, seed=6)
        assert forest.spend_ratio.mean() <= 1.05
        points[share] = (forest.num_branch_points, forest.stats.probe_tokens)
        assert_matches_exact(grads, exact, resolves=False)
    assert points[0.5][1] < 0.9 * points[1.0][1]  # Fewer probes ...
    assert points[0.5][0] > 1.1 * points[1.0][0]  # ... and more branch points.


def test_action_distribution_entropy_by_hand():
    assert action_distribution_entropy(["go", "go", "go"]) == 0.0
    assert action_distribution_entropy(["take a", "take b"]) == pytest.approx(np.log(2))
    assert action_distribution_entropy([None, "go", None, "go"]) == pytest.approx(np.log(2))
    p = np.array([2, 1, 1]) / 4
    assert action_distribution_entropy(["x", "x", "y", "z"]) == pytest.approx(
        -(p * np.log(p)).sum()
    )


def test_action_samples_rule_gives_exact_gradients_and_iid_children():
    """Probes decide where to branch; children are fresh draws: their actions follow pi(.|h)."""
    spec = TreeSpec(root_group=2, num_branches=3, branch_budget=2, max_depth=2)
    selector = make_selector("action_samples", probes=3)
    grads, exact, forest = sampled_gradients("generic", selector, spec, num_tasks=3000, seed=4)
    assert forest.num_branch_points > 1000
    assert forest.stats.probe_tokens > 0
    assert_matches_exact(grads, exact, resolves=False)
    # Children's first actions at branch points, per state, against the policy.
    from envs.tabular import make_mdp, policy_probs, random_logits

    probs = policy_probs(random_logits(make_mdp("generic", 0), seed=1, scale=0.7))
    counts: dict[int, np.ndarray] = {}
    for seg in forest.segments:
        if seg.parent >= len(forest.task_ids) and seg.steps:  # A branch point's child.
            first = seg.steps[0]
            c = counts.setdefault(first.prompt_ids[0], np.zeros(probs.shape[1]))
            c[first.action_ids[0]] += 1
    tested = 0
    for state, c in counts.items():
        if c.sum() < 200:
            continue
        _, p_value = scipy.stats.chisquare(c, c.sum() * probs[state])
        assert p_value > 1e-3, (state, c, probs[state])
        tested += 1
    assert tested >= 2


def test_score_history_ranks_thresholds_and_round_trip():
    from bpo_jax.rollout.branching import ScoreHistory

    h = ScoreHistory(window=400, min_history=4)
    assert np.isnan(h.rank(1.0, 0))  # No history: no rank.
    h.add(np.arange(8.0), np.zeros(8, int))  # Step 0 sees 0..7.
    h.add(np.arange(100.0, 104.0), np.full(4, 3))  # Step 3 sees 100..103.
    assert h.rank(4.0, 0) == pytest.approx(4.5 / 8)  # 4 below, one tie counted half.
    assert h.rank(101.5, 3) == 0.5
    assert h.rank(101.5, 2) == pytest.approx(10 / 12)  # Step 2 has no history: pooled.
    copy = ScoreHistory(window=400, min_history=4)
    copy.load(h.dump())
    assert copy.rank(4.0, 0) == h.rank(4.0, 0) and copy.rank(101.5, 2) == h.rank(101.5, 2)


def test_per_step_entropy_threshold_uses_its_steps_entropies():
    sel = make_selector("entropy", quantile=0.5, min_history=4, per_step=True)
    sel.observe(np.array([0.0, 0.1, 0.2, 0.3]), np.zeros(4, int))
    sel.observe(np.array([2.0, 2.1, 2.2, 2.3]), np.ones(4, int))
    # 1.0 is high at step 0 and low at step 1; a pooled threshold would treat both alike.
    s = sel.scores(np.array([1.0, 1.0]), np.array([0, 1]))
    assert s[0] == 1.0 and np.isnan(s[1])
    pooled = make_selector("entropy", quantile=0.5, min_history=4)
    pooled.observe(np.array([0.0, 0.1, 0.2, 0.3, 2.0, 2.1, 2.2, 2.3]), None)
    assert (
        np.isnan(pooled.scores(np.array([1.0]), np.array([0])))[0]
        == np.isnan(pooled.scores(np.array([1.0]), np.array([1])))[0]
    )


def _spread_episode(rng, branch_budget, horizon, scale=1.0):
    spec = TreeSpec(
        root_group=1,
        num_branches=2,
        branch_budget=branch_budget,
        max_depth=branch_budget,
        branch_schedule="spread",
        branch_scale=scale,
    )
    lengths = LengthModel(horizon)
    for _ in range(8):
        lengths.add(horizon)
    sel = make_selector("entropy", min_history=8, per_step=True)
    sel.observe(rng.random(64), np.repeat(np.arange(horizon), 64 // horizon + 1)[:64])
    p = BranchPlanner(spec, sel, lengths, CostModel("env_steps"), num_tasks=1)
    builder = ForestBuilder(1)
    live = [builder.start_path(0)]
    p.add_backbone(live[0])
    steps = []
    for t in range(horizon):
        for i in p.choose(live, rng.random(len(live))):
            steps.append(t)
            live.extend(builder.branch(live[i], 1))
        for path in live:
            path.t += 1
    return steps


def test_spread_schedule_spends_each_backbones_branch_points_over_its_episode():
    """With b branch points and R(t) = L - t, a backbone branches about b times, at steps spread
    over the episode rather than at the first high scores."""
    rng = np.random.default_rng(0)
    runs = [_spread_episode(rng, branch_budget=2, horizon=10) for _ in range(400)]
    counts = np.array([len(s) for s in runs])
    assert counts.max() <= 2
    assert counts.mean() > 1.5, counts.mean()  # The budget is mostly spent...
    steps = np.concatenate([s for s in runs if s])
    assert 2.5 < steps.mean() < 6.5, steps.mean()  # ...spread over the steps, not all at t = 0.
    assert np.mean(steps == 0) < 0.4


def test_spread_needs_a_ranked_rule():
    with pytest.raises(ValueError, match="branch_schedule"):
        _spread_config("interval")
    _spread_config("entropy")


def _spread_config(selector):
    from bpo_jax import config as config_lib
    from bpo_jax.experiment import load_experiment

    raw = load_experiment("experiments/alfworld.py").get_config("cpu")
    raw.rollout.branch_schedule = "spread"
    raw.rollout.selector = selector
    return config_lib.validate(raw)


def test_spread_schedule_and_per_task_budget_keep_the_gradient_exact():
    """Ranks at step t use only steps already taken, and each task's budget only its backbones'
    progress so far (`budget_episodes`): trees stay unbiased and spend the budget."""
    spec = two_level_spec(2, budget_episodes=4.0, branch_schedule="spread", branch_scale=2.0)
    selector = make_selector("entropy", per_step=True, min_history=16)
    grads, exact, forest = sampled_gradients("generic", selector, spec, num_tasks=3000, seed=5)
    assert forest.num_branch_points > 1000
    np.testing.assert_allclose(forest.budget, 4 * 3.0)  # Its episodes all last 3 steps.
    assert 0.95 <= forest.spend_ratio.mean() <= 1.05, forest.spend_ratio.mean()
    assert_matches_exact(grads, exact)


def test_task_budget_is_measured_on_the_tasks_own_backbones():
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=1, budget_episodes=4)
    lengths = LengthModel(10)
    for _ in range(8):
        lengths.add(6)  # Paths of other batches lasted 6 steps: remaining(t) = 6 - t.
    p = BranchPlanner(spec, None, lengths, CostModel("env_steps"), num_tasks=2)
    builder = ForestBuilder(2)
    a, b = builder.start_path(0), builder.start_path(0)
    c, d = builder.start_path(1), builder.start_path(1)
    for path in (a, b, c, d):
        p.add_backbone(path)
    np.testing.assert_allclose(p.task_budgets(), [24.0, 24.0])  # 4 x 6 expected steps each.
    for _ in range(2):  # Task 0's backbones take 2 steps; a then ends.
        for path in (a, b):
            p.charge(path, 5)
            path.t += 1
    p.finished(a)
    # a cost 2; b spent 2 and is expected to take 6 - 2 = 4 more: 4 x (2 + 6) / 2. Task 1's
    # backbones have taken no step: 4 x remaining(0), and a's length 2 is in the model now.
    np.testing.assert_allclose(p.task_budgets(), [16.0, 4 * (8 * 6 + 2) / 9])
    p.charge(b, 5, probe=True)  # Probe tokens are the task's spend, not the episode's cost.
    assert p.spent[0] == 5.0 and b.cost == 2.0
    np.testing.assert_allclose(p.task_budgets()[0], 16.0)
