"""A tree that chooses its own shape (`rollout.tree=auto`): the model, the choice, unbiasedness.

- The first-order model (`bpo_jax.rollout.design`) reduces to DESIGN.md's formulas by hand, and
  equals the same model evaluated segment by segment on the forests the real engine grows
  (`bench/variance_model.forest_trace`, an independent implementation), partial budget levels
  included.
- The measured profile (`design_stats.DesignStats`) matches the exact one on tabular MDPs.
- Designs chosen batch by batch from earlier batches only keep the policy gradient exact
  (z-scores against `envs.tabular.objective_grad`), and a batch's design does not depend on
  that batch's returns, however adversarial (through `rl.play_batch` itself).
"""

from __future__ import annotations

import copy
import dataclasses
import sys

import numpy as np
import pytest
from helpers import REPO, play_tabular, z_max

from bpo_jax.estimators import step_advantages
from bpo_jax.rollout.branching import make_selector
from bpo_jax.rollout.design import (
    Design,
    Profile,
    choose_design,
    expected_cost,
    level_shares,
    predicted_ratio,
    predicted_trace,
)
from bpo_jax.rollout.design_stats import DesignStats, TreeChooser
from bpo_jax.rollout.engine import TreeSpec
from envs.sandbox import SandboxPool
from envs.tabular import make_mdp, mdp_tasks, objective_grad, random_logits
from envs.tabular.policy import TabularPolicy, encode_state, forest_task_gradients
from envs.tabular.profile import step_profile

H = 8
# f(t) = sqrt(t / H), score energy 0.3 a step, every episode H steps.
FLAT = Profile(np.sqrt(np.arange(H + 1) / H), np.r_[np.ones(H), 0.0], np.full(H, 0.3), np.ones(H))


def exact(instance: str, seed: int = 0, **sizes):
    mdp = make_mdp(instance, seed, **sizes)
    logits = random_logits(mdp, seed=1, scale=0.7)
    return mdp, logits, Profile(**step_profile(mdp, logits))


@pytest.mark.parametrize("k0,k,d", [(4, 2, 2), (3, 3, 5), (6, 4, 1)])
def test_one_level_is_the_design_notes_formula(k0, k, d):
    f, c_pre, c_suf = FLAT.explained[d], 0.3 * d, 0.3 * (H - d)
    hand = c_pre * (f + (1 - f) / k) / (k0 - 1) + c_suf * (1 - f) / (k0 * (k - 1))
    assert predicted_trace(Design(k0, k, (d,)), FLAT) == pytest.approx(hand, rel=1e-12)
    assert predicted_trace(Design(7), FLAT) == pytest.approx(0.3 * H / 6, rel=1e-12)


def test_the_budget_is_spent_in_step_order():
    # [(0,4),(2,2)] at 7 episodes of 8 steps: 32 + 4 x 6 = 56, exactly the budget.
    assert level_shares(Design(4, 2, (2,)), FLAT, 56.0) == [1.0]
    assert expected_cost(Design(4, 2, (2,)), FLAT, 56.0) == pytest.approx(56.0)
    # K0 = 6: slack 8 buys 8/7 of a 7-step branch among 6 backbones.
    assert level_shares(Design(6, 2, (1,)), FLAT, 56.0) == pytest.approx([8 / 42])
    # Two levels: the first in full (4 x 7 = 28 of 32), the rest to the second (8 x 4 = 32).
    shares = level_shares(Design(4, 2, (1, 4)), FLAT, 64.0)
    assert shares == pytest.approx([1.0, 4 / 32])
    assert expected_cost(Design(4, 2, (1, 4)), FLAT, 64.0) == pytest.approx(64.0)
    assert level_shares(Design(4, 2, (1, 4)), FLAT) == [1.0, 1.0]


def test_choice_falls_back_to_groups_and_branches_where_f_is_high():
    _, _, generic = exact("generic")  # f = 0.01 at step 1: no tree wins at N = 7.
    choice = choose_design(generic, 7)
    assert choice.design == Design(7) and choice.ratio == 1.0 and choice.best_tree_ratio > 0.95
    _, _, decided = exact("first_action_decides", horizon=8)  # f = 1 from step 1 on.
    choice = choose_design(decided, 7)
    assert choice.design.branches and choice.ratio < 0.5
    assert choice.spend == pytest.approx(1.0, abs=1e-9)
    assert predicted_ratio(choice.design, decided, 7) == pytest.approx(choice.ratio)


def _grown(mdp, logits, design: Design, budget: float, tasks: int, seed: int):
    policy = TabularPolicy(logits)
    spec = TreeSpec(**design.spec_fields(), budget=budget, budget_unit="env_steps")
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        return play_tabular(
            pool,
            policy,
            mdp_tasks(mdp, copies=tasks),
            spec,
            seed=seed,
            horizon=mdp.horizon,
            selector=design.selector(),
            encode=encode_state,
        )


@pytest.mark.parametrize(
    "design,budget,rel",
    [
        (Design(3, 2, (1,)), 4 * 4.0, 0),  # 4 / 3 branch points: the coin mixes 1 and 2.
        (Design(2, 2, (1, 2)), 22.0, 0),  # Two full levels: 8 + 2 x 3 + 4 x 2 = 22.
        (Design(3, 3, (2,)), 4 * 4.0, 0),  # 4 of 3 x 2 x 2 = 12: a third of the backbones.
        # 3 of the 4 level-1 paths branch at step 2: the model spreads them evenly over the
        # two level-1 nodes (3/4 each), the planner fills one node first; first order only.
        (Design(2, 2, (1, 2)), 20.0, 0.05),
    ],
)
def test_model_equals_the_model_on_grown_forests(design, budget, rel):
    sys.path.insert(0, str(REPO / "bench"))
    import variance_model

    mdp, logits, profile = exact("reward_density", horizon=4)
    forest = _grown(mdp, logits, design, budget, tasks=600, seed=0)
    on_forests = variance_model.forest_trace(forest, variance_model.moments(mdp, logits))
    var_r = variance_model.moments(mdp, logits).var_return
    predicted = predicted_trace(design, profile, budget) * var_r
    mean, se = on_forests.mean(), on_forests.std(ddof=1) / np.sqrt(len(on_forests))
    assert abs(mean - predicted) <= max(4 * se, (rel or 1e-6) * predicted), (mean, se, predicted)
    cost = expected_cost(design, profile, budget)
    assert np.mean(forest.task_cost) == pytest.approx(cost, rel=0.03)


def test_first_level_fill_when_episodes_end_early():
    """Where episodes end before the branch step, a task's slack depends on how many of its
    backbones still run there; the model's expected branch points and spend match the engine's
    (its length model knowing the MDP's lengths, as a run's does after its first batches)."""
    import jax

    from bpo_jax.rollout.branching import CostModel, LengthModel
    from bpo_jax.rollout.engine import play_forest

    mdp, logits, profile = exact("variable_length", 3)  # Episodes of 1, 2 and 4 steps.
    design, budget = Design(3, 2, (1,)), 4 * profile.remaining(0)
    # Room for the batch's own 4,500 episodes: none of the 6,000 known lengths is dropped.
    lengths = LengthModel(mdp.horizon, window=12_000)
    for length, p in enumerate(profile.survival[:-1] - profile.survival[1:], start=1):
        lengths.lengths.extend([length] * int(round(p * 6000)))
    spec = TreeSpec(**design.spec_fields(), budget=budget, budget_unit="env_steps")
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        forest = play_forest(
            pool,
            TabularPolicy(logits),
            encode_state,
            mdp_tasks(mdp, copies=1500),
            spec,
            rng=jax.random.key(0),
            selector=design.selector(),
            lengths=lengths,
            costs=CostModel("env_steps"),
        )
    (share,) = level_shares(design, profile, budget)
    points = share * design.root_group * profile.survival[1]
    assert 0 < share < 1
    assert forest.num_branch_points / 1500 == pytest.approx(points, rel=0.05)
    assert np.mean(forest.task_cost) == pytest.approx(
        expected_cost(design, profile, budget), rel=0.03
    )


@pytest.mark.parametrize("instance,seed", [("generic", 0), ("variable_length", 3)])
def test_measured_profile_matches_the_exact_one(instance, seed):
    mdp, logits, profile = exact(instance, seed)
    design = Design(3, 2, (1,))  # Every running backbone branches at step 1.
    forest = _grown(mdp, logits, design, np.inf, tasks=600, seed=1)
    stats = DesignStats(mdp.horizon, "env_steps")
    stats.add(forest)
    measured = stats.profile()
    np.testing.assert_allclose(measured.survival, profile.survival, atol=0.04)
    np.testing.assert_allclose(measured.energy, profile.energy, atol=0.03)
    np.testing.assert_allclose(measured.explained[1], profile.explained[1], atol=0.06)
    # Steps without branch points are interpolated, never above 1 or decreasing.
    assert np.all(np.diff(measured.explained) >= 0) and measured.explained[-1] == 1.0
    assert DesignStats(mdp.horizon).profile() is None


def _auto_batches(mdp, logits, n, batches, tasks, explore_every=3):
    """Batches whose design the chooser picks from the earlier ones: per-task gradients
    (path-mass weights, the "bpo" estimator) and the designs played."""
    policy = TabularPolicy(logits)
    budget = n * float(step_profile(mdp, logits)["survival"][:-1].sum())  # n episodes.
    chooser = TreeChooser(n, mdp.horizon, "env_steps", explore_every=explore_every, margin=0.0)
    prior = TreeSpec(root_group=3, num_branches=2, branch_budget=1, max_depth=1, budget=budget)
    grads, played = [], []
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        for b in range(batches):
            choice = chooser.next_design()
            spec, selector = dataclasses.replace(prior, budget_unit="env_steps"), None
            if choice is None:
                selector = make_selector("uniform", branch_prob=0.5, seed=b)
            else:
                fields = choice.design.spec_fields()
                spec = dataclasses.replace(spec, **fields)
                selector = choice.design.selector()
            forest = play_tabular(
                pool,
                policy,
                mdp_tasks(mdp, copies=tasks),
                spec,
                seed=100 + b,
                horizon=mdp.horizon,
                selector=selector,
                encode=encode_state,
            )
            adv = forest.arrays().unpad_steps(
                np.asarray(step_advantages(forest.to_forest(), "bpo"))
            )
            coef = forest.step_weights("path_mass") * adv
            grads.append(forest_task_gradients(forest, policy, coef))
            played.append(None if choice is None else choice.design)
            chooser.record(forest)
    return np.concatenate(grads), played


def test_designs_chosen_from_earlier_batches_keep_the_gradient_exact():
    # Episodes of 2 to 4 steps; f(1) = 0.74: the model picks trees (0.85 at the exact profile).
    mdp = make_mdp("variable_length", 6)
    logits = random_logits(mdp, seed=1, scale=0.7)
    grads, played = _auto_batches(mdp, logits, n=7, batches=9, tasks=400)
    trees = {d for d in played if d is not None and d.branches}
    assert played[0] is None and played[3] is None and len(trees) >= 1, played
    target = objective_grad(mdp, logits).ravel()
    z = z_max(grads, target)
    print(f"designs {[d.tree if d else 'prior' for d in played]}; z_max {z:.2f}")
    assert z < 4.0
    se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
    assert np.abs(target).max() > 10 * se.max()  # Sharp enough to see a bias.


def _auto_config():
    from bpo_jax import config as config_lib
    from bpo_jax.experiment import load_experiment

    raw = load_experiment("experiments/alfworld.py").get_config("cpu,algo=bpo")
    raw.rollout.tree = "auto"
    raw.rollout.budget_unit = "env_steps"
    raw.env.max_steps = 4
    raw.train.group_size = 7
    raw.mesh.task_shards = 1
    return config_lib.validate(raw)


def test_a_batch_design_does_not_depend_on_its_own_returns(monkeypatch):
    """`rl.play_batch` picks the batch's design before playing it: the spec it plays is the same
    whether the batch's returns are honest or adversarial, while what it records (and so the
    next batch's design) does differ."""
    from bpo_jax import rl

    cfg = _auto_config()
    mdp = make_mdp("variable_length", 3)
    logits = random_logits(mdp, seed=1, scale=0.7)
    played = []

    def forest_of(spec, seed, adversarial):
        design = Design(spec.root_group, spec.num_branches, (1,) if spec.branch_budget else ())
        budget = 7 * 2.0
        forest = _grown(mdp, logits, design, budget, tasks=200, seed=seed)
        if adversarial:  # Huge returns exactly where the backbones branched: f near 1.
            for leaf in forest.leaves:
                last = forest.segments[leaf.segments[-1]].steps[-1]
                last.reward = 1e3 * (len(leaf.segments) > 1) * (-1) ** last.action_ids[0]
        return forest

    def fake_play_forest(pool, policy, agent, tasks, spec, **kw):
        played.append(spec)
        return forest_of(spec, len(played), fake_play_forest.adversarial)

    monkeypatch.setattr(rl, "play_forest", fake_play_forest)
    fake_play_forest.adversarial = False
    state = rl.RolloutState.create(cfg)
    for b in range(2):  # Batch 0: the prior; batch 1: a design from batch 0.
        rl.play_batch(None, None, [None] * 4, cfg, state, rl.jax.random.key(b), agent=object())
    after = {}
    for adversarial in (False, True):
        copy_state = copy.deepcopy(state)
        fake_play_forest.adversarial = adversarial
        del played[2:]
        rl.play_batch(None, None, [None] * 4, cfg, copy_state, rl.jax.random.key(2), agent=object())
        after[adversarial] = (played[2], copy_state)
    assert after[False][0] == after[True][0]  # The batch's own spec: returns not looked at.
    honest, adversarial = (after[k][1].plan(cfg) for k in (False, True))
    assert honest != adversarial  # The recorded returns do steer later batches.
    # The chooser survives a checkpoint: a state loaded from the dump plans the same.
    loaded = rl.RolloutState.create(cfg).loaded(after[True][1].dump())
    assert loaded.plan(cfg) == adversarial
