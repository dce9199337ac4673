"""f in every tree run: per-batch metrics, the run's sums, bpo_shrink's lam, and where branch
points concentrate (`tests/test_fshare.py` reads them back).

- `rollout.explained`: a batch's metrics re-pool to the exact f of the concatenated parts (sum
  numerators and denominators over iterations), the run's sums survive a checkpoint (and an
  older checkpoint without them loads), and lam is `lambda_from_parts` of earlier batches only.
- Through `rl.play_batch` on the tabular engine: the lam a batch's advantages use is the same
  whether that batch's returns are honest or adversarial; the next batch's lam does move.
- `rollout.concentration`: shares by hand on a small forest, and the exact uniform reference.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
from tabular_trees import sample_trees
from test_experiments import tiny_cpu_config

from bpo_jax import estimators as est
from bpo_jax import rl
from bpo_jax.config import validate
from bpo_jax.rollout import concentration, explained
from bpo_jax.rollout.forest import ComputeStats, Leaf, RolloutForest, Segment, StepRecord
from envs import tabular
from envs.sandbox import SandboxPool
from envs.tabular.policy import TabularPolicy, encode_state

H = 4
ENV = {"instance": "generic", "horizon": H, "num_actions": 2}
MDP = tabular.make_mdp("generic", 0, horizon=H, num_actions=2)


def batches(n: int, tasks: int = 30):
    """`n` batches' parts: forests of `tasks` tasks, 3 backbones, branching at steps 1 and 2."""
    logits = tabular.random_logits(MDP, seed=3, scale=0.8)
    forests = [
        sample_trees(MDP, logits, tasks, root_k=3, branch_at=(1, 2), k=2, max_depth=2, seed=s)
        for s in range(n)
    ]
    return [est.task_depth_parts(est.branch_stats(*f.padded())) for f in forests]


def test_batch_metrics_repool_exactly_and_the_run_sums_survive_a_checkpoint():
    parts = batches(3)
    metrics = [explained.batch_metrics(p) for p in parts]
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    p = explained.PARTS_PREFIX
    for m, part in zip(metrics, parts):
        assert m[explained.F_KEY] == pytest.approx(part["between"].sum() / part["var_return"].sum())
        assert m[f"{p}branch_points"] == part["branch_points"].sum() == 30 * 3 * 3
    for depth in (1, 2):  # f per depth, re-pooled from the metrics' sums alone.
        keep = pooled["depth"] == depth
        num = sum(m[f"{p}depth_{depth}/between"] for m in metrics)
        den = sum(m[f"{p}depth_{depth}/var_return"] for m in metrics)
        assert num / den == pytest.approx(pooled["between"][keep].sum() / den, rel=1e-12)
        assert den == pytest.approx(pooled["var_return"][keep].sum(), rel=1e-12)
    share = explained.ExplainedShare()
    assert share.shrink_lambda() == est.DEFAULT_SHRINK  # Nothing measured yet.
    for part in parts:
        share.add(part)
    summary = share.summary()
    assert summary["f"] == pytest.approx(pooled["between"].sum() / pooled["var_return"].sum())
    assert summary["f_parts"]["batches"] == 3
    for name in explained.SUMMED:
        assert summary["f_parts"]["all"][name] == pytest.approx(pooled[name].sum(), rel=1e-12)
    assert set(summary["f_by_depth"]) == {"1", "2"}
    assert share.shrink_lambda() == pytest.approx(est.lambda_from_parts(pooled), rel=1e-12)
    assert share.record()["depth"] == parts[-1]["depth"].tolist()
    # Through a checkpoint's JSON; a checkpoint from before f was recorded loads empty.
    loaded = explained.ExplainedShare().load(json.loads(json.dumps(share.dump())))
    assert loaded.summary() == summary and loaded.shrink_lambda() == share.shrink_lambda()
    assert explained.ExplainedShare().load(None).shrink_lambda() == est.DEFAULT_SHRINK
    # A batch without branch points: its sums are 0 and it has no f.
    empty = explained.batch_metrics({"depth": np.zeros(0)})
    assert empty[f"{p}branch_points"] == 0 and explained.F_KEY not in empty


def shrink_config():
    cfg = validate(
        tiny_cpu_config(
            **{
                "env.max_steps": H,
                "train.group_size": 4,
                "train.tasks_per_iter": 8,
                "train.algo": "bpo_shrink",
            }
        )
    )
    rollout = dict(root_group=3, num_branches=2, branch_budget=2, max_depth=2)
    rollout |= dict(selector="interval", interval=1, budget=0.0, budget_unit="env_steps")
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout))


def test_shrink_lambda_never_looks_at_its_own_batch(monkeypatch):
    """`rl.play_batch` fixes the batch's lam before it plays, from earlier batches' parts: the
    same lam whether the batch's returns are honest or adversarial (huge where it branched),
    while the next batch's lam does change; the advantages use it; a checkpoint keeps it."""
    cfg = shrink_config()
    policy = TabularPolicy(tabular.random_logits(MDP, seed=1, scale=0.7))
    tasks = tabular.load_tasks(None, "train", copies=8, **ENV)[:8]
    real_play = rl.play_forest

    def play(*args, **kwargs):
        forest = real_play(*args, **kwargs)
        if play.adversarial:
            for leaf in forest.leaves:
                last = forest.segments[leaf.segments[-1]].steps[-1]
                last.reward = 1e3 * (len(leaf.segments) > 1) * (-1) ** last.action_ids[0]
        return forest

    monkeypatch.setattr(rl, "play_forest", play)
    play.adversarial = False
    state = rl.RolloutState.create(cfg)
    with SandboxPool("tabular", ENV, backend="inprocess") as pool:

        def batch(s, b):
            return rl.play_batch(pool, policy, tasks, cfg, s, jax.random.key(b), encode_state)[0]

        seen = []
        for b in range(2):
            batch(state, b)
            seen.append(state.explained.last)
            assert state.shrink == (
                est.DEFAULT_SHRINK
                if b == 0
                else pytest.approx(est.lambda_from_parts(seen[0]), rel=1e-12)
            )
        before = state.explained.shrink_lambda()
        pooled = {k: np.concatenate([p[k] for p in seen]) for k in seen[0]}
        assert before == pytest.approx(est.lambda_from_parts(pooled), rel=1e-12)
        after = {}
        for adversarial in (False, True):
            s = copy.deepcopy(state)
            play.adversarial = adversarial
            forest = batch(s, 2)
            after[adversarial] = (s.shrink, s.explained.shrink_lambda(), s)
            metrics = rl.measured_metrics(cfg, s, forest)
            assert metrics["train/shrink_lambda"] == s.shrink
            adv, _ = rl.forest_advantages(forest, cfg, shrink=s.shrink)
            arrays = forest.arrays()
            want = est.step_advantages(arrays.forest, "bpo_shrink", shrink=s.shrink)
            np.testing.assert_allclose(adv, arrays.unpad_steps(want), rtol=1e-6)
    assert after[False][0] == after[True][0] == before  # The batch's own lam.
    assert abs(after[False][1] - after[True][1]) > 0.05  # Its returns steer the next batch's.
    loaded = rl.RolloutState.create(cfg).loaded(json.loads(json.dumps(after[True][2].dump())))
    assert loaded.explained.shrink_lambda() == after[True][1]
    old = after[True][2].dump()
    del old["explained"]  # A checkpoint from before f was recorded.
    assert rl.RolloutState.create(cfg).loaded(old).explained.shrink_lambda() == 0.5


def _forest():
    """Task 0: backbones 0, 1, 2; node 2 on backbone 0, node 3 below node 2 (nested), node 4
    on backbone 1. Task 1: two backbones, one branch point (node 5): not counted."""
    step = StepRecord([1], [2], np.zeros(1), np.zeros(1), "a", "", 0.0)
    seg = lambda task, parent, child=-1: Segment(task, parent, child, [step])
    segments = [
        seg(0, 0, 2),  # 0: backbone -> node 2
        seg(0, 0, 4),  # 1: backbone -> node 4
        seg(0, 0),  # 2: backbone, unbranched
        seg(0, 2, 3),  # 3: node 2 -> node 3
        seg(0, 2),  # 4
        seg(0, 3),  # 5
        seg(0, 3),  # 6
        seg(0, 4),  # 7
        seg(0, 4),  # 8
        seg(1, 1, 5),  # 9
        seg(1, 1),  # 10
        seg(1, 5),  # 11
        seg(1, 5),  # 12
    ]
    paths = [[0, 3, 5], [0, 3, 6], [0, 4], [1, 7], [1, 8], [2], [9, 11], [9, 12], [10]]
    leaves = [Leaf(segments[p[0]].task, p) for p in paths]
    return RolloutForest(["a", "b"], segments, leaves, [0, 1, 0, 0, 0, 1], ComputeStats(), [0, 0])


def test_concentration_by_hand():
    rows = concentration.task_concentration(_forest())
    assert rows == [
        {"task": 0, "n": 3, "k0": 3, "backbone_share": 2 / 3, "path_share": 2 / 3},
    ]
    m = concentration.concentration_metrics(_forest())
    p = concentration.PREFIX
    assert m[f"{p}tasks"] == 1 and m[f"{p}backbone"] == m[f"{p}path"] == 2 / 3
    assert m[f"{p}backbone_uniform"] == pytest.approx(17 / 27)  # E[max] = 51/27 of 3.


def test_uniform_backbone_share():
    share = concentration.uniform_backbone_share
    assert share(2, 2) == pytest.approx(0.75) and share(4, 1) == 1.0 and share(1, 5) == 1.0
    rng = np.random.default_rng(0)
    for n, k in ((5, 3), (9, 4)):
        draws = rng.multinomial(n, [1 / k] * k, size=200_000).max(axis=1) / n
        assert share(n, k) == pytest.approx(draws.mean(), abs=4 * draws.std() / 447)
