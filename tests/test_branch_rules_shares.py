"""Every registered branch rule x how a batch's shares are played: the running statistics a
batch leaves are its shares' measurements, merged in share order.

A batch played in several shares (`mesh.task_shards`, one host each in a multi-host run) plays
every share on a copy of the rollout state as it stood at the batch's start; each share returns
what it measured (`branching.Measurements`) and the running state absorbs them in share order
(`rl.RolloutState.absorb`). Checked here, per rule:
- in process, on the tabular MDPs: absorbing a copy's measurements equals playing on the state
  itself (what a one-share run does), and share order is kept;
- on the tiny ALFWorld BPO config (`tests/branch_rules_worker.py`): one share and two shares in
  one process (`mesh.task_shards=2`) play, and a two-share batch is exactly its two shares each
  played alone, merged in share order: the forests concatenated, the statistics the start's
  followed by share 0's and then share 1's;
- two `jax.distributed` processes on 127.0.0.1, one share each, give exactly the one-process
  two-share results.
"""

from __future__ import annotations

import copy
import json
import pickle
import sys
import time

import jax
import numpy as np
import pytest
from helpers import REPO, free_port, run_together
from test_engine_mdp import TabularPolicy, encode

from bpo_jax.rl import RolloutState
from bpo_jax.rollout.branching import (
    SELECTORS,
    CostModel,
    LengthModel,
    Measurements,
    make_selector,
    measure,
)
from bpo_jax.rollout.engine import TreeSpec, play_forest
from envs.sandbox import SandboxPool
from envs.tabular import load_tasks, make_mdp, random_logits

WORKER = REPO / "tests" / "branch_rules_worker.py"
RULES = sorted(SELECTORS)
INSTANCE = "variable_length"  # Paths of several lengths: the order of lengths shows.


# In process, on a tabular MDP.


def _rollout_state(rule: str) -> RolloutState:
    selector = make_selector(
        rule, quantile=0.5, min_history=4, branch_prob=0.5, interval=1, probes=2
    )
    return RolloutState(selector, LengthModel(make_mdp(INSTANCE, 0).horizon), CostModel("tokens"))


def _play(pool, state: RolloutState, copies: int, seed: int) -> None:
    """One batch of `copies` tasks grown as BPO trees on `state`'s statistics."""
    play_forest(
        pool,
        TabularPolicy(random_logits(make_mdp(INSTANCE, 0), seed=1, scale=0.7)),
        encode,
        load_tasks(None, "train", instance=INSTANCE, copies=copies),
        TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2),
        rng=jax.random.key(seed),
        selector=state.selector,
        lengths=state.lengths,
        costs=state.costs,
    )


@pytest.fixture(scope="module")
def tabular_pool():
    with SandboxPool("tabular", {"instance": INSTANCE}, backend="inprocess") as pool:
        yield pool


@pytest.mark.parametrize("rule", RULES)
def test_absorbed_measurements_equal_playing_on_the_state(tabular_pool, rule):
    """What a one-share run does (play on the state) and what a share does (play on a copy,
    whose measurements the state absorbs) leave the same statistics."""
    direct = _rollout_state(rule)
    for seed in range(3):  # Later batches start from statistics the earlier ones left.
        merged = copy.deepcopy(direct)
        _play(tabular_pool, direct, copies=3, seed=seed)
        local, measured = merged.measuring_copy()  # The rule's stream copied: the same draws.
        _play(tabular_pool, local, copies=3, seed=seed)
        before = merged.dump()
        merged.absorb([measured])
        assert merged.dump() == direct.dump() == local.dump()
        assert merged.dump() != before
    assert direct.dump()["lengths"]
    if rule in ("entropy", "action_samples"):
        assert direct.dump()["scores"]["pooled"]


@pytest.mark.parametrize("rule", RULES)
def test_shares_are_absorbed_in_share_order(tabular_pool, rule):
    start = _rollout_state(rule)
    _play(tabular_pool, start, copies=2, seed=0)
    parts = []
    for seed, copies in ((1, 2), (2, 3)):
        local, measured = start.measuring_copy()
        _play(tabular_pool, local, copies=copies, seed=seed)
        parts.append(measured)
    merged, reverse, by_hand = (copy.deepcopy(start) for _ in range(3))
    merged.absorb(parts)
    reverse.absorb(parts[::-1])
    for m in parts:
        m.apply_to(by_hand.selector, by_hand.lengths, by_hand.costs)
    assert merged.dump() == by_hand.dump()
    d, s = merged.dump(), start.dump()
    assert d["lengths"] == s["lengths"] + parts[0].lengths + parts[1].lengths
    assert (
        d["episode_costs"] == s["episode_costs"] + parts[0].episode_costs + parts[1].episode_costs
    )
    assert d["actions"] == s["actions"] + parts[0].actions + parts[1].actions
    assert parts[0].lengths != parts[1].lengths  # Order is visible: the check can fail.
    assert reverse.dump()["lengths"] != d["lengths"]


def test_measurements_are_plain_data_merged_in_order():
    a = Measurements([([0.5, 1.0], [0, 1])], [3, 2], 4, 20, [8.0])
    b = Measurements([([2.0], None)], [1], 1, 3, [])
    m = Measurements.merged([a, b])
    assert m == Measurements([([0.5, 1.0], [0, 1]), ([2.0], None)], [3, 2, 1], 5, 23, [8.0])
    assert a == Measurements([([0.5, 1.0], [0, 1])], [3, 2], 4, 20, [8.0])  # Inputs untouched.
    # What a share returns travels between processes by pickle (`distributed.allgather_objects`).
    assert pickle.loads(pickle.dumps(m)) == m


def test_measure_writes_down_what_the_models_are_fed():
    selector, lengths, costs = (
        make_selector("entropy", min_history=1),
        LengthModel(5),
        CostModel("tokens"),
    )
    journal = measure(selector, lengths, costs)
    selector.observe(np.array([0.25, 0.5], np.float32), np.array([0, 3]))
    lengths.add(4)
    costs.record(2, 9)
    costs.record_episode(9.0)
    assert journal == Measurements([([0.25, 0.5], [0, 3])], [4], 2, 9, [9.0])
    fresh = make_selector("entropy", min_history=1), LengthModel(5), CostModel("tokens")
    journal.apply_to(*fresh)
    assert fresh[0].history.dump() == selector.history.dump()
    assert list(fresh[1].lengths) == [4] and fresh[2].tokens_per_action == 4.5


# The tiny ALFWorld config, in worker processes.


def _launch(out, mode: str, processes: int = 1) -> float:
    """Runs the worker in `mode` as `processes` JAX processes of 2 CPU devices each (every
    process samples on 2 devices, as the one-process run does); returns the wall seconds."""
    address = f"127.0.0.1:{free_port()}"
    t0 = time.time()
    procs, outs = run_together(
        [
            [sys.executable, str(WORKER), str(out), "2", mode]
            + ([address, str(processes), str(i)] if processes > 1 else [])
            for i in range(processes)
        ],
        timeout=1500,
    )
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-5000:]
    return time.time() - t0


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Every rule in one process: one share, two shares, and each share alone."""
    out = tmp_path_factory.mktemp("rules") / "one.json"
    seconds = _launch(out, "one")
    print(f"one process, every rule x (1 share, 2 shares, each share alone): {seconds:.0f}s")
    return json.loads(out.read_text())


def test_every_rule_plays_in_one_and_two_shares(one_process):
    assert sorted(one_process) == RULES
    for rule in RULES:
        (one,) = one_process[rule]["1"]
        assert one["segments"] and one["rollout"]["lengths"], rule
        batches = one_process[rule]["2"]
        assert len(batches) == 2 and all(b["segments"] for b in batches), rule
        # The second batch starts from the statistics the first one's shares left.
        assert len(batches[1]["rollout"]["lengths"]) > len(batches[0]["rollout"]["lengths"])
    # The matrix covers trees that branch (not only backbones), under shares too.
    assert sum(bool(b["branch_points"]) for r in RULES for b in one_process[r]["2"]) >= 4


def _per_task(batch: dict, offset: int = 0) -> dict:
    """Each task's segments (actions, rewards) in order, keyed by task index + offset."""
    out: dict = {}
    for task, _, _, actions, rewards in batch["segments"]:
        out.setdefault(task + offset, []).append((actions, rewards))
    return out


def _history(rollout: dict) -> dict:
    """The running statistics' histories (lists in the order they grew, and counts), without
    the rates adapted to the batch's spend."""
    scores = rollout.get("scores") or {}
    return {
        **{k: rollout[k] for k in ("lengths", "actions", "tokens", "episode_costs")},
        "pooled scores": scores.get("pooled", []),
        **{f"scores at step {t}": h for t, h in scores.get("by_step", {}).items()},
    }


def _added(before: dict, after: dict) -> dict:
    """What `after`'s histories hold beyond `before`'s: lists extended, counts increased."""
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            assert v[: len(before.get(k, []))] == before.get(k, []), k
            out[k] = v[len(before.get(k, [])) :]
        else:
            out[k] = v - before.get(k, 0)
    return out


def _extended(before: dict, *added: dict) -> dict:
    """`before`'s histories followed by each of `added`, in order."""
    out = dict(before)
    for a in added:
        for k, v in a.items():
            out[k] = out.get(k, [] if isinstance(v, list) else 0) + v
    return out


@pytest.mark.parametrize("rule", RULES)
def test_two_shares_are_each_share_alone_merged_in_share_order(one_process, rule):
    empty = {"lengths": [], "actions": 0, "tokens": 0, "episode_costs": [], "scores": {}}
    for b, (merged, alone) in enumerate(zip(one_process[rule]["2"], one_process[rule]["alone"])):
        start = _history(one_process[rule]["2"][b - 1]["rollout"] if b else empty)
        first, second = alone
        assert merged["task_ids"] == first["task_ids"] + second["task_ids"]
        offset = len(first["task_ids"])
        assert _per_task(merged) == {**_per_task(first), **_per_task(second, offset)}
        assert merged["task_cost"] == first["task_cost"] + second["task_cost"]
        assert merged["branch_points"] == first["branch_points"] + second["branch_points"]
        assert merged["stats"] == {
            k: first["stats"][k] + second["stats"][k] for k in first["stats"]
        }
        shares = [_added(start, _history(share["rollout"])) for share in alone]
        assert _history(merged["rollout"]) == _extended(start, *shares), (rule, b)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_processes_play_exactly_the_one_process_shares(one_process, tmp_path):
    out = tmp_path / "two.json"
    seconds = _launch(out, "two", processes=2)
    print(f"two processes, every rule x 2 shares: {seconds:.0f}s")
    two = json.loads(out.read_text())
    assert sorted(two) == RULES
    for rule in RULES:
        assert two[rule]["2"] == one_process[rule]["2"], rule
