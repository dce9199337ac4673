"""Overlapping sampling with environment steps: the pool's submit/collect and the cohort engine.

- `SandboxPool.submit_steps` + `PendingSteps.results()` give what `step_many` gives (faults,
  errors), run while the caller does other work, and time each step by its reply's arrival;
- `play_forest(..., cohorts=C)`: with a greedy policy, C = 1 and C = 2 grow the same forests
  (independent groups and BPO trees); with C = 2 the engine's forests still give the exact policy
  gradient (tabular MDPs, `envs.tabular.exact`); an exception while steps are in flight leaves
  no sandbox open.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest
from helpers import play_tabular, random_tiny_policy, word_tokenizer, z_max

from bpo_jax.estimators import step_advantages
from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector
from bpo_jax.rollout.engine import TreeSpec, play, play_forest
from bpo_jax.rollout.timing import env_floor_metrics
from envs.sandbox import SandboxError, SandboxPool, procutil
from envs.sandbox.testing import CounterTask, leftover_processes
from envs.tabular import exact, load_tasks, make_mdp, random_logits
from envs.tabular.policy import TabularPolicy, encode_state, forest_task_gradients

COUNTER = "sandbox_counter"


def _descendants() -> set[int]:
    return set(procutil.descendant_pids(os.getpid()))


# --- The pool: submit / collect ------------------------------------------------------------------


def _twin_sandboxes(pool, n):
    """n sandboxes one step into an episode, and a live copy of each (same state)."""
    sids = [sid for sid, _, _ in pool.reset_many([CounterTask(f"t{i}") for i in range(n)])]
    pool.step_many([(sid, "add 3") for sid in sids])
    return sids, [pool.clone(sid, 1)[0] for sid in sids]


@pytest.mark.parametrize("backend", ["fork", "inprocess", "replay"])
def test_submit_then_collect_matches_step_many(backend):
    before = _descendants()
    actions = ["inc", "raise", "double", "nonsense", "dec"]
    with SandboxPool(COUNTER, {}, backend=backend, num_workers=2) as pool:
        a, b = _twin_sandboxes(pool, len(actions))
        expected = pool.step_many(list(zip(a, actions)))
        pending = pool.submit_steps(list(zip(b, actions)))
        got = pending.results()
        assert pending.results() is got  # Collecting twice gives the same list.
        for e, g in zip(expected, got):
            assert (g.observation, g.reward, g.done) == (e.observation, e.reward, e.done)
            assert g.info.get("fault") == e.info.get("fault")
        assert got[1].info["fault"] == "error" and "asked to raise" in got[1].info["error"]
        assert got[3].reward < 0 and got[3].info["invalid_action"]
        # The faulted twins are closed and logged, the others go on.
        assert a[1] not in pool.live() and b[1] not in pool.live()
        assert [f["sid"] for f in pool.faults()] == [a[1], b[1]]
        assert pool.stats()["steps"] == 3 * len(actions)
        assert len(pending.latencies) == len(actions) and min(pending.latencies) >= 0
        again = pool.submit_steps([(b[0], "inc")]).results()
        assert again[0].observation.startswith("count=5 ")
    assert leftover_processes(before) == []


def test_submit_rejects_what_step_many_rejects():
    with SandboxPool(COUNTER, {}, backend="fork") as pool:
        (sid, _, _), (other, _, _) = pool.reset_many([CounterTask("a"), CounterTask("b")])
        with pytest.raises(SandboxError, match="appears twice"):
            pool.submit_steps([(sid, "inc"), (sid, "inc")])
        with pytest.raises(SandboxError, match="no live sandbox with id 999"):
            pool.submit_steps([(sid, "inc"), (999, "inc")])
        pending = pool.submit_steps([(sid, "spin 0.2")])
        # A sandbox with a step in flight cannot be stepped, snapshotted or cloned.
        for op in (
            lambda: pool.submit_steps([(sid, "inc")]),
            lambda: pool.step_many([(other, "inc"), (sid, "inc")]),
            lambda: pool.snapshot(sid),
            lambda: pool.clone(sid, 1),
        ):
            with pytest.raises(SandboxError, match="has a step in flight"):
                op()
        assert pending.results()[0].observation.startswith("count=0 steps=1 ")
        # Nothing was sent for the rejected calls: `other` has taken no step.
        assert pool.step(other, "inc").observation.startswith("count=1 steps=1 ")
        won = pool.step(other, "add 4")  # CounterTask's default target is 5.
        assert won.done
        with pytest.raises(SandboxError, match="episode is over"):
            pool.submit_steps([(other, "inc")])
        pool.close_sandbox(sid)
        with pytest.raises(SandboxError, match="no live sandbox"):
            pool.submit_steps([(sid, "inc")])


def test_steps_run_while_the_caller_works_and_are_timed_by_their_replies():
    spin_s, busy_s = 0.2, 2.5
    with SandboxPool(COUNTER, {}, backend="fork", num_workers=2, step_timeout_s=1.5) as pool:
        sids = [s for s, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
        t0 = time.perf_counter()
        pending = pool.submit_steps([(sid, f"spin {spin_s}") for sid in sids])
        assert time.perf_counter() - t0 < spin_s  # Submitting does not wait.
        time.sleep(busy_s)  # The caller's other work; the replies arrive meanwhile.
        t1 = time.perf_counter()
        results = pending.results()
        waited = time.perf_counter() - t1
        # Both replies were in before the deadline (1.5 s) and read after it: not hangs.
        assert all(not r.done and "fault" not in r.info for r in results), results
        assert waited < 0.2 and pending.wait_seconds == pytest.approx(waited, abs=0.05)
        for r, latency in zip(results, pending.latencies):
            start, end = r.info["spin_wall"]
            # Timed by the reply's arrival, not by when the caller came back for it.
            assert end - start - 0.05 < latency < busy_s - 0.2, (latency, start, end)


def test_workers_cap_holds_over_batches_in_flight():
    with SandboxPool(COUNTER, {}, backend="fork", num_workers=1) as pool:
        sids = [s for s, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
        first = pool.submit_steps([(sids[0], "spin 0.2")])
        second = pool.submit_steps([(sids[1], "spin 0.2")])  # Queued behind the first.
        (b,) = second.results()
        (a,) = first.results()
        assert b.info["spin_wall"][0] >= a.info["spin_wall"][1]


def test_cancel_closes_the_sandboxes_whose_steps_were_sent():
    before = _descendants()
    with SandboxPool(COUNTER, {}, backend="fork", num_workers=1) as pool:
        sids = [s for s, _, _ in pool.reset_many([CounterTask("a"), CounterTask("b")])]
        pending = pool.submit_steps([(sid, "spin 5") for sid in sids])  # One sent, one queued.
        pending.cancel()
        assert pool.live() == [sids[1]]  # The queued one was never stepped.
        assert pool.step(sids[1], "inc").observation.startswith("count=1 steps=1 ")
        with pytest.raises(SandboxError, match="cancelled"):
            pending.results()
    assert leftover_processes(before) == []


# --- The engine: cohorts -------------------------------------------------------------------------


# The variable-length instance at this seed has episodes of 1, 2 and 4 steps.
MDP_SEED = {"generic": 0, "variable_length": 3}


def _play(instance, spec, selector, cohorts, num_tasks, seed=0, greedy=False, backend="inprocess"):
    mdp_seed = MDP_SEED[instance]
    mdp = make_mdp(instance, mdp_seed)
    policy = TabularPolicy(random_logits(mdp, seed=1, scale=0.7))
    tasks = load_tasks(None, "train", instance=instance, seed=mdp_seed, copies=num_tasks)
    options = {"instance": instance, "seed": mdp_seed}
    with SandboxPool("tabular", options, backend=backend) as pool:
        forest = play_tabular(
            pool, policy, tasks, spec, seed=seed, horizon=mdp.horizon,
            selector=selector, greedy=greedy, cohorts=cohorts,
        )  # fmt: skip
        assert pool.live() == []
    return forest, policy, mdp


def _shape(forest):
    """Each task's tree as a nested, ordered value: per node, its child segments (steps:
    prompt, action, reward, observation; then the subtree below, or the leaf's outcome), sorted.
    Cohorts keep paths in another order than one lockstep list, so ids are not compared."""
    below = {}
    for i, seg in enumerate(forest.segments):
        below.setdefault(seg.parent, []).append(i)
    leaf_of = {lf.segments[-1]: (lf.won, lf.truncated) for lf in forest.leaves}

    def node(n):
        return sorted(segment(i) for i in below.get(n, []))

    def segment(i):
        seg = forest.segments[i]
        steps = [(st.prompt_ids, st.action_ids, st.reward, st.observation) for st in seg.steps]
        return repr((steps, node(seg.child) if seg.child >= 0 else leaf_of[i]))

    return [node(t) for t in range(len(forest.task_ids))], forest.stats.as_dict("")


@pytest.mark.parametrize(
    "rule,spec",
    [
        (None, TreeSpec(root_group=3)),
        ("interval=1", TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)),
        ("interval=2", TreeSpec(root_group=2, num_branches=3, branch_budget=3, max_depth=3)),
        ("posthoc_topk", TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)),
    ],
    ids=["independent", "bpo-every-step", "bpo-every-2nd", "posthoc"],
)
def test_cohorts_grow_the_same_forests_as_lockstep(rule, spec):
    """Greedy actions and rules that look at each path's own steps: nothing a cohort does
    depends on the others, so every tree is the same (a rule with a pooled history, or a
    budget coin, sees the cohorts' turns in another order; see `bpo_jax.rollout.engine`)."""

    def grow(cohorts, backend="inprocess"):
        if rule is None:
            selector = None
        elif rule.startswith("interval="):
            selector = make_selector("interval", interval=int(rule.split("=")[1]))
        else:
            selector = make_selector(rule)
        forest, _, _ = _play("generic", spec, selector, cohorts, 5, greedy=True, backend=backend)
        return forest

    one = grow(1)
    if rule is not None:
        assert one.num_branch_points > 5
    assert _shape(grow(2)) == _shape(one)
    assert _shape(grow(5)) == _shape(one)  # One cohort per task.
    if rule == "interval=1":  # Steps really in flight in worker processes while sampling.
        assert _shape(grow(2, backend="fork")) == _shape(one)


def _tiny_policy(tmp_path, prefix_reuse):
    """The tiny decoder, random weights, over a tokenizer trained on counter-game text."""
    words = ["inc", "dec", "double", "add 1", "add 2", "count=", "steps=", "trace="]
    tok = word_tokenizer(words, tmp_path / "sp", 320, words_per_line=12)
    return random_tiny_policy(tok, max_new_tokens=6, cache_len=192, prefix_reuse=prefix_reuse)


def test_each_cohort_continues_its_own_prefixes(tmp_path):
    """With prefix reuse, cohorts taking turns prefill what lockstep prefills (a prefix cache
    shared by the cohorts would continue the other cohort's prompts: nothing reused)."""
    from bpo_jax.rollout.engine import prompt_encoder

    reuse = _tiny_policy(tmp_path, True)
    plain = _tiny_policy(tmp_path, False)
    # Different starts: each task's observations are its own (little to share across tasks).
    tasks = [CounterTask(task_id=f"count-{i}", start=100 * i, target=50) for i in range(4)]
    prefilled = {}
    with SandboxPool(COUNTER, {"max_steps": 5}, backend="inprocess") as pool:
        for name, policy, cohorts in (("c1", reuse, 1), ("c2", reuse, 2), ("plain", plain, 2)):
            forest = play_forest(
                pool,
                policy,
                prompt_encoder(policy.tokenizer, history_turns=2, max_prompt_tokens=96),
                tasks,
                TreeSpec(root_group=2),
                rng=jax.random.key(0),
                greedy=True,
                cohorts=cohorts,
            )
            prefilled[name] = forest.stats.prefilled_tokens
            assert forest.stats.env_steps == 4 * 2 * 5
    assert reuse.prefixes.kept_rows == 0  # Freed when the batch ended.
    assert prefilled["c2"] < 0.6 * prefilled["plain"], prefilled
    assert prefilled["c2"] <= 1.1 * prefilled["c1"], prefilled


def test_cohort_keys_are_distinct_and_deterministic():
    spec = TreeSpec(root_group=4)
    runs = [_play("generic", spec, None, c, 4, seed=5)[0] for c in (1, 2, 2)]
    actions = [[st.action_ids for s in f.segments for st in s.steps] for f in runs]
    assert actions[1] == actions[2]
    assert actions[0] != actions[1]  # The cohorts draw from keys of their own.


def test_play_uses_cohorts_and_reports_its_time():
    mdp = make_mdp("generic", 0)
    policy = TabularPolicy(random_logits(mdp, seed=1, scale=0.7))
    tasks = load_tasks(None, "train", instance="generic", copies=3)
    with SandboxPool("tabular", {"instance": "generic"}, backend="fork", num_workers=2) as pool:
        trajs, stats = play(
            pool, policy, tasks, 2, rng=jax.random.key(0), greedy=True, agent=_Agent(), cohorts=2
        )
        forest = play_forest(
            pool, policy, encode_state, tasks, TreeSpec(2), rng=jax.random.key(0), cohorts=2
        )
        assert pool.live() == []
    assert [t.group for t in trajs] == [0, 0, 1, 1, 2, 2] and stats.env_steps > 0
    sec = forest.seconds
    assert sec["sampling"] > 0 and sec["env"] > 0 and sec["env_busy"] > 0
    floor = env_floor_metrics(sec, forest.stats.env_steps, 2, sec["sampling"] + sec["env"] + 1.0)
    assert floor["time/env_floor_seconds"] == pytest.approx(sec["env_busy"] / 2)
    assert floor["time/env_step_latency_seconds"] == pytest.approx(
        sec["env_busy"] / forest.stats.env_steps
    )


class _Agent:
    """The tabular prompt as an agent (`play` takes an agent or a tokenizer's policy)."""

    encode = staticmethod(encode_state)

    @staticmethod
    def parse(text):
        return text


class _FailingPolicy(TabularPolicy):
    """Raises in its `fail_at`-th sampling call."""

    def __init__(self, logits, fail_at):
        super().__init__(logits)
        self.calls, self.fail_at = 0, fail_at

    def sample(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the policy failed")
        return super().sample(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [2, 5])
def test_an_exception_with_steps_in_flight_leaves_no_sandbox_open(fail_at):
    """Call 2 is cohort B's first turn, with cohort A's first steps in flight; call 5 is later,
    with trees branching."""
    before = _descendants()
    mdp = make_mdp("generic", 0)
    policy = _FailingPolicy(random_logits(mdp, seed=1, scale=0.7), fail_at)
    tasks = load_tasks(None, "train", instance="generic", copies=4)
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)
    with SandboxPool("tabular", {"instance": "generic"}, backend="fork") as pool:
        with pytest.raises(RuntimeError, match="the policy failed"):
            play_forest(
                pool,
                policy,
                encode_state,
                tasks,
                spec,
                rng=jax.random.key(0),
                selector=make_selector("interval", interval=1),
                lengths=LengthModel(mdp.horizon),
                costs=CostModel("env_steps"),
                cohorts=2,
            )
        assert pool.live() == [] and pool.stats()["held_snapshots"] == 0
        # The pool is still good for the next batch.
        forest = play_forest(
            pool, policy, encode_state, tasks[:1], TreeSpec(2), rng=jax.random.key(1), cohorts=2
        )
        assert len(forest.leaves) == 2 and pool.live() == []
    assert leftover_processes(before) == []


@pytest.mark.parametrize(
    "instance,selector,spec",
    [
        (
            "generic",
            make_selector("uniform", branch_prob=0.5, seed=3),
            TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2),
        ),
        # A spent `target` budget: decisions depend on what the other paths (and now the other
        # cohorts, in their own order) spent, never on a node's own children.
        (
            "variable_length",
            make_selector("interval", interval=1),
            TreeSpec(
                2,
                num_branches=2,
                branch_budget=3,
                max_depth=2,
                budget=10.0,
                budget_unit="env_steps",
            ),
        ),  # fmt: skip
    ],
    ids=["generic-uniform", "variable-length-budget"],
)
def test_cohort_forests_give_the_exact_policy_gradient(instance, selector, spec):
    num_tasks = 1500
    forest, policy, mdp = _play(instance, spec, selector, 2, num_tasks, seed=11)
    assert forest.num_branch_points > 500
    arrays = forest.arrays()
    adv = arrays.unpad_steps(np.asarray(step_advantages(arrays.forest, "bpo")))
    grads = forest_task_gradients(forest, policy, forest.step_weights("path_mass") * adv)
    dj = exact.objective_grad(mdp, policy.logits)
    assert z_max(grads, dj) < 4.0
    se = grads.std(axis=0, ddof=1) / np.sqrt(num_tasks)
    assert np.abs(dj).max() > 10 * se.max()  # The test resolves the gradient.
