"""Tests for the rollout engine: BPO trees and independent groups with the real tiny policy.

The policy is the tiny decoder with random (sharpened) weights and a SentencePiece tokenizer
trained on counter-game text; the environment is the sandbox counter game, whose observation
carries a hash of every action so far, so a sandbox in the wrong state is caught by replay.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import jax
import numpy as np
import pytest
from helpers import random_tiny_policy, word_tokenizer

from bpo_jax.config import validate
from bpo_jax.estimators import tree_advantages
from bpo_jax.rollout.branching import CostModel, EntropySelector, LengthModel, make_selector
from bpo_jax.rollout.engine import TreeSpec, play, play_forest, prompt_encoder
from bpo_jax.sampler.policy import Policy
from envs.base import make_env, step_result
from envs.sandbox import SandboxPool
from envs.sandbox.testing import CounterTask

MAX_STEPS = 6
TASKS = [CounterTask(task_id=f"count-{i}", start=0, target=50 + i) for i in range(3)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    words = ["inc", "dec", "double", "add 1", "add 2", "add 3", "count=", "steps=", "trace="]
    tok = word_tokenizer(words, tmp_path_factory.mktemp("tok") / "sp", 320, words_per_line=12)
    return random_tiny_policy(
        tok, embed_scale=4.0, max_new_tokens=6, cache_len=192, temperature=1.0
    )


@pytest.fixture(scope="module")
def plain_policy(policy):
    """The same policy without prefix reuse: every prompt prefilled whole, every turn."""
    return Policy(
        policy.graphdef,
        policy.params,
        policy.tokenizer,
        policy.model_cfg,
        max_new_tokens=6,
        cache_len=192,
        temperature=1.0,
        prefix_reuse=False,
    )


@pytest.fixture(scope="module")
def pool():
    with SandboxPool("sandbox_counter", {"max_steps": MAX_STEPS}, backend="inprocess") as p:
        yield p


def encoder(policy):
    return prompt_encoder(policy.tokenizer, history_turns=2, max_prompt_tokens=96)


def grow(pool, policy, spec, selector, seed=0, lengths=None):
    return play_forest(
        pool,
        policy,
        encoder(policy),
        TASKS,
        spec,
        rng=jax.random.key(seed),
        selector=selector,
        lengths=lengths or LengthModel(MAX_STEPS),
        costs=CostModel(spec.budget_unit),
    )


def children_per_node(forest):
    return Counter(seg.parent for seg in forest.segments)


def check_forest(forest, spec):
    """Structural invariants every forest must satisfy."""
    kids = children_per_node(forest)
    roots = range(len(forest.task_ids))
    assert all(kids[r] == spec.root_group for r in roots)
    for node in range(len(forest.task_ids), forest.num_nodes):
        assert kids[node] == spec.num_branches, f"node {node} has {kids[node]} children"
        assert forest.node_task[node] == forest.segments[_into(forest, node)].task
    # Every segment but the leaves ends at a node; every leaf path starts at its task's root.
    for leaf in forest.leaves:
        assert forest.segments[leaf.segments[0]].parent == leaf.task
        assert forest.segments[leaf.segments[-1]].child == -1
        for a, b in zip(leaf.segments, leaf.segments[1:]):
            assert forest.segments[a].child == forest.segments[b].parent
        depth = len(leaf.segments) - 1
        assert depth <= spec.max_depth
    # Leaves: K0 per task plus K - 1 per branch point.
    assert (
        len(forest.leaves)
        == len(forest.task_ids) * spec.root_group
        + (spec.num_branches - 1) * forest.num_branch_points
    )
    # The kernel accepts it (every node has >= 2 children).
    f = forest.to_forest()
    tree_advantages(f.seg_parent, f.seg_child, f.seg_reward, f.num_nodes)


def _into(forest, node):
    return next(s for s, seg in enumerate(forest.segments) if seg.child == node)


def test_tree_shape_depth_and_branch_budget(pool, policy):
    spec = TreeSpec(root_group=2, num_branches=3, branch_budget=2, max_depth=2)
    forest = grow(pool, policy, spec, make_selector("interval", interval=1))
    check_forest(forest, spec)
    assert forest.num_branch_points > 0
    per_backbone = Counter()
    for leaf in forest.leaves:
        first = leaf.segments[0]
        per_backbone[first] = max(per_backbone[first], len(leaf.segments) - 1)
    assert max(per_backbone.values()) == 2  # Depth reached, never exceeded.
    # Branch points per backbone (the root-level segment names the backbone) within budget.
    nodes_under = Counter()
    for node in range(len(forest.task_ids), forest.num_nodes):
        seg = _into(forest, node)
        while forest.segments[seg].parent >= len(forest.task_ids):
            seg = _into(forest, forest.segments[seg].parent)
        nodes_under[seg] += 1
    assert max(nodes_under.values()) <= spec.branch_budget
    assert pool.live() == []  # Every sandbox closed.


def test_shared_prefix_is_prefilled_once(pool, plain_policy):
    # Without prefix reuse, to count exactly what forking alone saves.
    spec = TreeSpec(root_group=2, num_branches=4, branch_budget=3, max_depth=2)
    forest = grow(pool, plain_policy, spec, make_selector("interval", interval=2))
    assert forest.num_branch_points > 0
    steps = forest.steps()
    every_prompt = sum(len(s.prompt_ids) for s in steps)
    # The K children of a node act on one prompt, prefilled once (their rows are forked).
    shared = 0
    for node in range(len(forest.task_ids), forest.num_nodes):
        firsts = [seg.steps[0] for seg in forest.segments if seg.parent == node and seg.steps]
        assert len(firsts) == spec.num_branches
        assert all(f.prompt_ids == firsts[0].prompt_ids for f in firsts)
        shared += (len(firsts) - 1) * len(firsts[0].prompt_ids)
    assert forest.stats.prefilled_tokens == every_prompt - shared
    assert forest.stats.generated_tokens == sum(len(s.action_ids) for s in steps)
    assert forest.stats.env_steps == len(steps)
    # Independent trajectories with the same leaves would prefill every path's every prompt.
    per_leaf = sum(len(st.prompt_ids) for traj in forest.paths() for st in traj.steps)
    assert forest.stats.prefilled_tokens < per_leaf


def test_prefix_reuse_changes_nothing_but_the_prefilled_tokens(pool, policy, plain_policy):
    """Same seed, with and without prefix reuse: the same forest, fewer tokens prefilled."""
    spec = TreeSpec(root_group=2, num_branches=3, branch_budget=2, max_depth=2)
    forests = [
        grow(pool, p, spec, make_selector("interval", interval=2), seed=4)
        for p in (policy, plain_policy)
    ]
    reused, plain = forests
    assert reused.num_branch_points > 0
    assert policy.prefixes.kept_rows == 0  # Freed when the batch ended.
    a, b = reused.steps(), plain.steps()
    assert [s.action_ids for s in a] == [s.action_ids for s in b]
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.reward for s in a] == [s.reward for s in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-5, rtol=0)
    assert [leaf.won for leaf in reused.leaves] == [leaf.won for leaf in plain.leaves]
    same = dataclasses.replace(reused.stats, prefilled_tokens=plain.stats.prefilled_tokens)
    assert same == plain.stats
    # Each task's head (its goal and first observation) runs once for all its paths and turns.
    assert reused.stats.prefilled_tokens < 0.6 * plain.stats.prefilled_tokens


def test_every_path_replays_to_the_same_observations(pool, policy):
    """Forked sandboxes hold exactly the state of their path: a fresh replay agrees."""
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)
    forest = grow(pool, policy, spec, make_selector("interval", interval=1), seed=3)
    assert forest.num_branch_points > 0
    for traj in forest.paths():
        env = make_env("sandbox_counter", max_steps=MAX_STEPS)
        env.reset(options={"task": TASKS[traj.group]})
        for step in traj.steps:
            res = step_result(env, step.action_text)
            assert res.observation == step.observation
            assert res.reward == pytest.approx(step.reward)


def test_env_step_budget_is_never_exceeded(pool, policy):
    # Env steps with an empty length model: expected remaining = the worst case, so the
    # committed cost bounds the real one and the budget cannot be overrun.
    budget = 3 * MAX_STEPS
    spec = TreeSpec(
        root_group=2, num_branches=2, branch_budget=4, max_depth=3, budget=budget,
        budget_unit="env_steps",
    )  # fmt: skip
    forest = grow(pool, policy, spec, make_selector("interval", interval=1))
    check_forest(forest, spec)
    assert forest.num_branch_points > 0
    per_task = Counter(forest.segments[leaf.segments[0]].task for leaf in forest.leaves)
    assert set(per_task) == {0, 1, 2}
    steps_per_task = Counter()
    for seg in forest.segments:
        steps_per_task[seg.task] += len(seg.steps)
    assert max(steps_per_task.values()) <= budget
    np.testing.assert_allclose(forest.task_cost, [steps_per_task[i] for i in range(3)])


def test_token_budget_limits_growth(pool, policy):
    free = grow(
        pool, policy, TreeSpec(2, 2, branch_budget=3, max_depth=3), make_selector("interval")
    )
    tight = grow(
        pool,
        policy,
        TreeSpec(2, 2, branch_budget=3, max_depth=3, budget=1.0),
        make_selector("interval"),
    )
    assert tight.num_branch_points == 0 < free.num_branch_points


def test_entropy_selector_branches_at_high_entropy_only(pool, policy):
    sel = EntropySelector(quantile=0.5, window=256, min_history=1)
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=3, max_depth=2)
    forest = grow(pool, policy, spec, sel, seed=5)
    check_forest(forest, spec)
    assert forest.num_branch_points > 0
    assert math.isfinite(sel.threshold)


def test_selector_rates_follow_the_spend():
    """An under-spent batch (ratio < 1) makes the rules branch more: a lower entropy quantile, a
    higher uniform probability; an over-spent one less; clipped to [0, 1]. Rules without a rate
    have none to move."""
    entropy, uniform = EntropySelector(quantile=0.5), make_selector("uniform", branch_prob=0.5)
    entropy.adjust_rate(0.5, 0.2)
    uniform.adjust_rate(0.5, 0.2)
    assert (entropy.rate(), uniform.rate()) == (pytest.approx(0.4), pytest.approx(0.6))
    entropy.adjust_rate(20.0, 1.0)
    uniform.adjust_rate(20.0, 1.0)
    assert (entropy.quantile, uniform.prob) == (1.0, 0.0)
    uniform.set_rate(0.25)
    assert uniform.rate() == uniform.prob == 0.25
    interval = make_selector("interval", interval=2)
    interval.adjust_rate(0.5, 0.2)
    interval.set_rate(0.3)
    assert interval.rate() is None and interval.interval == 2


def test_posthoc_topk_branches_finished_backbones(pool, policy):
    spec = TreeSpec(root_group=2, num_branches=3, branch_budget=2, max_depth=2)
    forest = grow(pool, policy, spec, make_selector("posthoc_topk"), seed=1)
    check_forest(forest, spec)
    assert forest.num_branch_points == 2 * 2 * len(TASKS)  # Top-2 of every backbone.
    assert pool.live() == []
    # Each backbone's chosen steps are its highest-entropy ones. A backbone's path is root ->
    # node -> node -> end, and its last segment was created before the forks' at that node.
    deep = [leaf.segments for leaf in forest.leaves if len(leaf.segments) == 3]
    backbones = [c for c in deep if c[2] == min(d[2] for d in deep if d[:2] == c[:2])]
    assert len(backbones) == 2 * len(TASKS)
    for chain in backbones:
        segs = [forest.segments[s] for s in chain]
        ent = [s.entropies[0] for seg in segs for s in seg.steps]
        cuts = [len(segs[0].steps), len(segs[0].steps) + len(segs[1].steps)]
        assert sorted(ent, reverse=True)[1] <= min(ent[c] for c in cuts)


def test_independent_groups_are_depth_one_forests(pool, policy):
    forest = grow(pool, policy, TreeSpec(root_group=4), None)
    assert forest.num_nodes == len(TASKS) and len(forest.leaves) == 4 * len(TASKS)
    assert all(seg.child == -1 for seg in forest.segments)
    w = forest.step_weights("trajectory")
    t = 0
    for seg in forest.segments:  # (1 / N) / trajectory length.
        np.testing.assert_allclose(w[t : t + len(seg.steps)], 0.25 / len(seg.steps))
        t += len(seg.steps)
    trajs, stats = play(
        pool, policy, TASKS, 2, rng=jax.random.key(0), greedy=True, history_turns=2,
        max_prompt_tokens=96,
    )  # fmt: skip
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]
    # Greedy forks of one state act identically.
    assert [s.action_text for s in trajs[0].steps] == [s.action_text for s in trajs[1].steps]
    assert stats.resets == 3 and stats.clones == 3 and stats.restores == 0


def test_tree_step_weights_give_every_task_unit_mass(pool, policy):
    spec = TreeSpec(root_group=2, num_branches=3, branch_budget=2, max_depth=2)
    forest = grow(pool, policy, spec, make_selector("interval", interval=2), seed=2)
    assert forest.num_branch_points > 0
    task_of_step = np.concatenate([np.full(len(seg.steps), seg.task) for seg in forest.segments])
    for mode, expected in (("trajectory", 1.0), ("path_mass", None)):
        w = forest.step_weights(mode)
        for task in range(len(TASKS)):
            total = w[task_of_step == task].sum()
            if expected is not None:
                assert total == pytest.approx(expected)
    # Path mass: the leaves of one task carry probability 1 in total.
    mass = forest.leaf_mass()
    for task in range(len(TASKS)):
        got = sum(m for m, leaf in zip(mass, forest.leaves) if leaf.task == task)
        assert got == pytest.approx(1.0)


@pytest.fixture(scope="module")
def walker(policy):
    """The tiny policy after a few behaviour-cloning steps towards "inc" / "dec" at random:
    a random walk whose episodes sometimes reach the target (rewards that vary)."""
    from bpo_jax import learner
    from bpo_jax.agent import EpisodeText

    tok, encode = policy.tokenizer, encoder(policy)
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(64):
        env = make_env("sandbox_counter", max_steps=MAX_STEPS)
        ep = EpisodeText.start(env.reset(options={"task": TASKS[0]})[0], goal="reach the target")
        for _ in range(int(rng.integers(1, MAX_STEPS))):
            action = str(rng.choice(["inc", "dec"]))
            prompt = encode(ep)
            examples.append((prompt + tok.encode(" " + action) + [tok.eos_id], len(prompt)))
            ep.record(action, env.step(action)[0])
    opt = learner.make_optimizer(3e-3, 0.0, 0.9, 0.999, 1.0)
    step = learner.make_train_step(policy.graphdef, opt, learner.bc_loss)
    state = learner.TrainState(
        jax.tree.map(jax.numpy.copy, policy.params), opt.init(policy.params), jax.numpy.zeros(())
    )
    for _ in range(40):
        chunk = [examples[j] for j in rng.choice(len(examples), 16)]
        batch = learner.pad_batch(
            [s for s, _ in chunk], [a for _, a in chunk], batch_size=16, length=128, pad_id=0
        )
        state, _ = step(state, batch)
    return Policy(
        policy.graphdef, state.params, tok, policy.model_cfg, max_new_tokens=6, cache_len=192
    )


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_gradient_probe_reports_matched_compute_variances(pool, walker):
    from test_experiments import tiny_cpu_config

    from bpo_jax.study.probe import ModelGradients, run_probe

    policy = walker
    tasks = [CounterTask(task_id=f"walk-{i}", start=0, target=2) for i in range(2)]
    # RLOO's group of 4 sets the budget; BPO's 2 backbones leave room for branches.
    cfg = validate(
        tiny_cpu_config(
            **{"env.max_steps": MAX_STEPS, "train.minibatch_size": 16, "train.group_size": 4}
        )
    )
    cfg = dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, selector="interval", interval=1),
        agent=dataclasses.replace(cfg.agent, max_prompt_tokens=96),
    )
    grads = ModelGradients(policy.graphdef, policy.params, policy.tokenizer.pad_id, cfg, 4096)
    results = run_probe(
        pool, policy, tasks, cfg, ["rloo", "bpo"], 3, jax.random.key(0), grads,
        warmup_batches=1, num_resamples=200,
    )  # fmt: skip
    rloo, bpo = results["rloo"], results["bpo"]
    assert rloo["batches"] == bpo["batches"] == 3
    assert rloo["trace_var_ratio"] == 1.0 and len(bpo["per_task"]) == 2
    for r in (rloo, bpo):
        assert r["trace_var"] >= 0 and r["norm_var"] >= 0 and r["mean_grad_norm"] > 0
        assert r["exact_trace_var"] >= 0
        lo, hi = r["trace_var_ratio_ci95"]
        assert lo <= hi
    # BPO's budget is RLOO's measured cost; the spend ratio is measured and reported (the
    # budget rule works with expectations, so allow some slack), and the trees do branch.
    assert bpo["budget"] == rloo["task_cost_mean"]
    assert bpo["spend_ratio"] == pytest.approx(bpo["task_cost_mean"] / rloo["task_cost_mean"])
    assert bpo["spend_ratio"] <= 1.5 and bpo["spend_matched"] == (
        0.95 <= bpo["spend_ratio"] <= 1.05
    )
    assert max(bpo["leaves"]) > 2 * cfg.rollout.root_group
