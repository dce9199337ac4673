"""The gradient-variance probe on the tabular MDP: RLOO reference, matched spend, bootstrap CIs.

`run_probe` plays the real engine (sandbox pool, planner, forest builder, estimators, step
weights) with a softmax-table policy whose per-task gradient is exact
(`envs.tabular.policy.forest_task_gradients`), so its statistics can be recomputed by hand.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_experiments import tiny_cpu_config

from bpo_jax.config import validate
from bpo_jax.estimators import DEFAULT_SHRINK
from bpo_jax.rollout.explained import ExplainedShare
from bpo_jax.study import probe, stats
from envs.sandbox import SandboxPool
from envs.tabular import load_tasks, make_mdp, objective_grad, random_logits
from envs.tabular.policy import TabularPolicy, encode_state, forest_task_gradients

H, A = 4, 2
MDP = make_mdp("generic", 0, horizon=H, num_actions=A)
ENV = {"instance": "generic", "horizon": H, "num_actions": A}


def probe_config(**rollout):
    cfg = validate(
        tiny_cpu_config(**{"env.max_steps": H, "train.group_size": 4, "train.tasks_per_iter": 3})
    )
    options = dict(
        root_group=2,
        num_branches=2,
        branch_budget=2,
        max_depth=2,
        selector="interval",
        interval=1,
        budget=0.0,
        budget_unit="env_steps",
        budget_mode="target",
    )
    options.update(rollout)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **options))


class Recorder:
    """The exact tabular gradients, each call's rows kept per algorithm for the checks."""

    def __init__(self, policy):
        self.policy, self.rows = policy, {}

    def __call__(self, forest, adv, weights, cfg):
        g = forest_task_gradients(forest, self.policy, np.asarray(weights) * np.asarray(adv))
        self.rows.setdefault(cfg.train.algo, []).append(g)
        return g


def run(cfg, num_batches, warmup=2, seed=0, grads=None, algos=("rloo", "bpo"), **kwargs):
    policy = TabularPolicy(random_logits(MDP, seed=1, scale=0.7))
    tasks = load_tasks(None, "train", copies=3, **ENV)
    grads = Recorder(policy) if grads is None else grads(policy)
    with SandboxPool("tabular", ENV, backend="inprocess") as pool:
        results = probe.run_probe(
            pool,
            policy,
            tasks,
            cfg,
            list(algos),
            num_batches,
            jax.random.key(seed),
            grads,
            encode=encode_state,
            warmup_batches=warmup,
            num_resamples=500,
            **kwargs,
        )
    return results, grads


def test_probe_matches_spend_and_reports_cis():
    m = 24
    results, grads = run(probe_config(), m)
    rloo, bpo = results["rloo"], results["bpo"]
    assert rloo["batches"] == bpo["batches"] == m
    # RLOO's measured cost (4 episodes of H steps) is the tree's budget; the tree spends it.
    assert rloo["task_cost_mean"] == 4 * H and bpo["budget"] == 4 * H
    assert 0.95 <= bpo["spend_ratio"] <= 1.05 and bpo["spend_matched"]
    assert bpo["spend_warning"] is None and len(bpo["spend_ratio_per_task"]) == 3
    assert max(bpo["leaves"]) > 2 * 3  # it branched
    # The statistics, recomputed from the recorded gradients.
    for algo, r in results.items():
        rows = np.stack(grads.rows[algo])  # [M, tasks, D]
        batch = rows.mean(axis=1)
        trace = np.sum(np.var(batch, axis=0, ddof=1))
        assert r["trace_var"] == pytest.approx(trace, rel=1e-9)
        per_task = [np.sum(np.var(rows[:, t], axis=0, ddof=1)) for t in range(3)]
        np.testing.assert_allclose(r["per_task_trace_var"], per_task, rtol=1e-9)
        norms = np.linalg.norm(batch, axis=1)
        assert r["norm_var"] == pytest.approx(np.var(norms, ddof=1), rel=1e-9)
    assert len(grads.rows["bpo"]) == len(grads.rows["rloo"]) == m  # warm-ups not recorded
    assert rloo["trace_var_ratio"] == 1.0
    assert bpo["trace_var_ratio"] == pytest.approx(bpo["trace_var"] / rloo["trace_var"])
    lo, hi = bpo["trace_var_ratio_ci95"]
    assert lo < bpo["trace_var_ratio"] < hi and hi / lo > 1.05
    for t in bpo["per_task"]:
        assert t["ci95"][0] < t["trace_var_ratio"] < t["ci95"][1]
    # On a fixed horizon the default weighting estimates dJ / H: the RLOO samples agree.
    samples = np.concatenate(grads.rows["rloo"])
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    exact = objective_grad(MDP, random_logits(MDP, seed=1, scale=0.7)).ravel() / H
    moving = se > 0
    assert np.max(np.abs(samples.mean(axis=0) - exact)[moving] / se[moving]) < 4.5


def test_probe_flags_unmatched_spend():
    # No branch budget: the tree is its 2 backbones, half of RLOO's 4 episodes.
    results, _ = run(probe_config(branch_budget=0), num_batches=2, warmup=0)
    bpo = results["bpo"]
    assert bpo["spend_ratio"] == pytest.approx(0.5)
    assert not bpo["spend_matched"] and "not at matched spend" in bpo["spend_warning"]


def test_trees_record_f_and_bpo_shrink_takes_lam_from_earlier_batches(tmp_path):
    # A fixed design (every running backbone of 3 branches into 2 at step 1), as a pilot chose.
    cfg = probe_config(
        selector="steps", branch_steps="1", root_group=3, branch_budget=1, max_depth=1
    )
    record = probe.design_record(cfg, 0.8, "a pilot's choice")
    assert record == {
        "tree": [[0, 3], [1, 2]],
        "group_size": 4,
        "predicted_ratio": 0.8,
        "reason": "a pilot's choice",
    }
    m, identity = 6, {"algos": ["rloo", "bpo", "bpo_shrink"], "batches": 6}
    store = probe.ProbeStore(tmp_path, identity)
    results, _ = run(cfg, m, warmup=0, algos=identity["algos"], store=store)
    assert "explained" not in results["rloo"] and "shrink_lambda_mean" not in results["bpo"]
    for algo in ("bpo", "bpo_shrink"):
        f_rows = results[algo]["explained"]["f"]
        assert [r["depth"] for r in f_rows] == [1, "all"]
        assert f_rows[0]["branch_points"] > 0 and 0 <= f_rows[0]["f"] <= 1
        assert results[algo]["explained"]["table2a"]
    # Each batch's lam is the one the parts of the batches before it give (the first: default).
    batches = store.load("bpo_shrink")[0]
    share = ExplainedShare()
    for batch in batches:
        assert float(batch["shrink"]) == pytest.approx(share.shrink_lambda())
        share.add({k[len("parts_") :]: batch[k] for k in batch if k.startswith("parts_")})
    assert float(batches[0]["shrink"]) == DEFAULT_SHRINK
    assert results["bpo_shrink"]["shrink_lambda_mean"] == pytest.approx(
        np.mean([float(b["shrink"]) for b in batches])
    )


def test_variants_take_their_gradients_on_the_first_trees_forests(tmp_path):
    cfg = probe_config(
        selector="steps", branch_steps="1", root_group=3, branch_budget=1, max_depth=1
    )
    m, algos, variants = 5, ["rloo", "bpo"], ("bpo_traj", "bpo_shrink")
    store = probe.ProbeStore(tmp_path, {"algos": algos, "variants": list(variants)})
    results, grads = run(cfg, m, warmup=0, store=store, variants=variants)
    assert set(results) == {"rloo", "bpo", *variants}
    bpo = results["bpo"]
    for v in variants:
        r = results[v]
        assert r["same_forests_as"] == "bpo" and r["batches"] == m
        # The same trees: the same spend and leaves, another estimator's gradients.
        assert r["task_cost_mean"] == bpo["task_cost_mean"] and r["leaves"] == bpo["leaves"]
        assert r["explained"]["f"] == bpo["explained"]["f"]
        assert r["trace_var_ratio"] == pytest.approx(r["trace_var"] / results["rloo"]["trace_var"])
        assert len(grads.rows[v]) == m and not np.allclose(grads.rows[v], grads.rows["bpo"])
    # bpo_shrink's lam per batch is the one the batches before it give, as when played alone.
    batches = store.load("bpo")[0]
    lams = [float(b["shrink"]) for b in batches]
    assert results["bpo_shrink"]["shrink_lambda_mean"] == pytest.approx(np.mean(lams))
    assert "shrink_lambda_mean" not in bpo and lams[0] == DEFAULT_SHRINK
    # A resumed probe reads the variants' rows back from the store.
    again, grads2 = run(cfg, m, warmup=0, store=store, variants=variants)
    assert not grads2.rows and again["bpo_traj"]["trace_var"] == results["bpo_traj"]["trace_var"]
    with pytest.raises(ValueError, match="variants"):
        run(cfg, 2, warmup=0, variants=("rloo",))


class Interrupted(Exception):
    pass


def stops_at(algo, calls):
    """A `Recorder` that is interrupted at its `calls`-th gradient of `algo` (mid-batch: the
    batch is played but not recorded)."""

    class Stopping(Recorder):
        def __call__(self, forest, adv, weights, cfg):
            if cfg.train.algo == algo and len(self.rows.get(algo, [])) == calls:
                raise Interrupted
            return super().__call__(forest, adv, weights, cfg)

    return Stopping


def test_an_interrupted_probe_resumes_after_its_recorded_batches(tmp_path):
    m, cfg = 8, probe_config()
    identity = {"algos": ["rloo", "bpo"], "batches": m}
    lines = []
    with pytest.raises(Interrupted):
        run(cfg, m, grads=stops_at("bpo", 3), store=probe.ProbeStore(tmp_path, identity),
            progress=lines.append)  # fmt: skip
    assert len(lines) == m + 3 and lines[0].startswith("probe rloo batch 1/8: ")
    assert "budget of 16" in lines[-1]  # RLOO's measured cost, as the tree's budget.
    # The first run's recorded batches, as the store keeps them.
    store = probe.ProbeStore(tmp_path, identity)
    first = {a: store.load(a)[0] for a in ("rloo", "bpo")}
    assert [len(first["rloo"]), len(first["bpo"])] == [m, 3]

    results, grads = run(cfg, m, store=store)
    # Only the missing batches were played and differentiated, without a second warm-up.
    assert "rloo" not in grads.rows and len(grads.rows["bpo"]) == m - 3
    for algo, new in (("rloo", []), ("bpo", grads.rows["bpo"])):
        rows = np.stack([b["rows"] for b in first[algo]] + list(new))
        trace = np.sum(np.var(rows.mean(axis=1), axis=0, ddof=1))
        assert results[algo]["batches"] == m
        assert results[algo]["trace_var"] == pytest.approx(trace, rel=1e-9)
    assert results["bpo"]["budget"] == 4 * H and results["bpo"]["spend_matched"]
    # The stored costs are the reference's: the tree's budget is unchanged by the resume.
    costs = np.stack([b["costs"] for b in first["rloo"]])
    assert results["rloo"]["task_cost_per_task"] == costs.mean(axis=0).tolist()


def test_a_store_of_another_probe_is_refused(tmp_path):
    probe.ProbeStore(tmp_path, {"algos": ["rloo", "bpo"], "batches": 64, "tasks": ["a"]})
    with pytest.raises(ValueError, match=r"different probe .*\['batches'\]"):
        probe.ProbeStore(tmp_path, {"algos": ["rloo", "bpo"], "batches": 32, "tasks": ["a"]})


def test_streamed_trace_counts_zero_gradients_and_survives_the_store(tmp_path):
    rng = np.random.default_rng(0)
    grads = [{"w": rng.normal(size=(3, 4)), "b": rng.normal(size=5)} for _ in range(5)]
    grads[2] = None  # A batch that won nothing: an exactly zero gradient, one of the M.
    trace = probe.StreamedTrace()
    for g in grads:
        trace.add(g)
    flat = np.stack(
        [np.zeros(17) if g is None else np.concatenate([g["b"], g["w"].ravel()]) for g in grads]
    )
    want = np.sum(np.var(flat, axis=0, ddof=1))
    assert trace.value() == pytest.approx(want, rel=1e-5)
    store = probe.ProbeStore(tmp_path, {})
    store.save("x", 0, {"rows": np.zeros((1, 2))}, {"lengths": [3]}, trace)
    _, state, loaded = store.load("x")
    assert state == {"lengths": [3]} and loaded.value() == pytest.approx(trace.value())


def test_count_sketch_preserves_inner_products():
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(60, 50)), "b": rng.normal(size=(1000,))}
    y = jax.tree.map(lambda v: v + rng.normal(size=v.shape), x)
    flat = [np.concatenate([v.ravel() for v in jax.tree.leaves(t)]) for t in (x, y)]
    exact = flat[0] @ flat[1]
    dots = [probe.count_sketch(x, 512, s) @ probe.count_sketch(y, 512, s) for s in range(200)]
    # Unbiased over seeds; one sketch of 2^14 coordinates is within a few percent.
    assert abs(np.mean(dots) - exact) < 4 * np.std(dots) / np.sqrt(len(dots))
    big = probe.count_sketch(x, 2**14, 3)
    assert big @ big == pytest.approx(flat[0] @ flat[0], rel=0.05)
    k = stats.gram(np.stack([probe.count_sketch(t, 2**14, 3) for t in (x, y)]))
    assert k[0, 1] == pytest.approx(exact, rel=0.1)


def test_zero_advantage_chunks_are_skipped_and_the_gradient_is_unchanged():
    """A chunk whose advantages are all 0 contributes only its token weight: the gradient
    equals the one computed through the model for every chunk, and the model is not called."""
    import types

    from flax import nnx

    from bpo_jax import learner
    from bpo_jax.models.config import tiny
    from bpo_jax.models.llama import Transformer

    mcfg = tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=2, num_kv_heads=1, max_seq_len=64)  # fmt: skip
    graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))
    grad_fn = probe.make_grad_fn(graphdef, 1.0, "token_mean")
    logprob_fn = learner.make_logprob_fn(graphdef, 1.0)
    calls = []

    def counting(fn):
        def wrapped(*args):
            calls.append(fn)
            return fn(*args)

        return wrapped

    cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(minibatch_size=2),
        sampler=types.SimpleNamespace(length_bucket=8),
    )
    rng = np.random.default_rng(0)

    def example(adv, weight):
        n = int(rng.integers(4, 12))
        return learner.Example(list(rng.integers(1, 64, size=n)), n // 2, adv, weight)

    # Chunks of 2: (0, 0) skipped, (1.5, 0) computed, (0, 0) skipped, (-1, 0) computed.
    examples = [example(a, w) for a, w in zip([0, 0, 1.5, 0, 0, 0, -1.0, 0], [1, 0.5] * 4)]
    got = probe.batch_gradient(
        counting(grad_fn), counting(logprob_fn), params, examples, cfg, pad_id=0
    )
    assert len(calls) == 4  # Two chunks, a log-prob and a gradient call each.

    # By hand: every chunk through the model, weighted by its token weight.
    acc, total = None, 0.0
    for i in range(0, len(examples), 2):
        chunk = examples[i : i + 2]
        length = learner.round_up(max(len(e.tokens) for e in chunk), 8)
        batch = learner.pad_batch(
            [e.tokens for e in chunk], [e.action_start for e in chunk], batch_size=2,
            length=length, pad_id=0, advantages=[e.advantage for e in chunk],
            weights=[e.weight for e in chunk],
        )  # fmt: skip
        old, _ = logprob_fn(params, batch.tokens)
        batch = dataclasses.replace(batch, old_logprobs=np.asarray(old) * batch.loss_mask)
        g, den = grad_fn(params, batch)
        acc = (
            jax.tree.map(lambda x, d=float(den): x * d, g)
            if acc is None
            else jax.tree.map(lambda a, x, d=float(den): a + x * d, acc, g)
        )
        total += float(den)
    want = jax.tree.map(lambda x: x / total, acc)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    # No advantage anywhere: an exactly zero gradient, and no model call.
    calls.clear()
    zero = [example(0.0, 1.0) for _ in range(3)]
    assert probe.batch_gradient(grad_fn, counting(logprob_fn), params, zero, cfg, 0) is None
    assert not calls
