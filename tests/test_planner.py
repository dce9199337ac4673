"""The branch planner: budget modes, the acceptance coin, spend on the exact MDPs."""

import numpy as np
import pytest
import scipy.stats
from test_engine_mdp import sampled_gradients

from bpo_jax.branching import CostModel, LengthModel, action_distribution_entropy, make_selector
from bpo_jax.forest_builder import ForestBuilder
from bpo_jax.planner import BranchPlanner
from bpo_jax.rollout import TreeSpec


def planner(mode, budget, seed=0, horizon=4):
    spec = TreeSpec(
        root_group=2, num_branches=2, branch_budget=1, max_depth=1, budget=budget, budget_mode=mode
    )
    lengths = LengthModel(horizon)
    for _ in range(8):
        lengths.add(horizon)  # Every path lasts `horizon` steps: remaining(t) = horizon - t.
    p = BranchPlanner(
        spec,
        make_selector("uniform", branch_prob=1.0, seed=seed),
        lengths,
        CostModel("env_steps"),
        num_tasks=1,
        seed=seed,
    )
    builder = ForestBuilder(1)
    live = [builder.start_path(0) for _ in range(2)]
    for path in live:
        p.add_backbone(path)
    return p, live


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


def budget_spec(mode):
    """Backbones cost 3 + 3 env steps (H = 3); 8.5 leaves room for part of a branch."""
    return TreeSpec(
        root_group=2,
        num_branches=2,
        branch_budget=2,
        max_depth=2,
        budget=8.5,
        budget_unit="env_steps",
        budget_mode=mode,
    )


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
    mean = grads.mean(axis=0)
    se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
    moving = se > 0
    z = np.abs(mean[moving] - exact[moving]) / se[moving]
    assert z.max() < 4.0, (z.max(), mean, exact)
    assert np.abs(exact).max() > 10 * se.max()


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
    mean = grads.mean(axis=0)
    se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
    moving = se > 0
    z = np.abs(mean[moving] - exact[moving]) / se[moving]
    assert z.max() < 4.0, (z.max(), mean, exact)
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
