"""The lockstep protocol of slice-wide sampling (`bpo_jax.multihost.lockstep`,
`bpo_jax.multihost.slice_sampler`).

Two hosts simulated in one process: this process is host 0 (its worker thread plays, its main
thread serves the rounds), and host 1's requests come from a script through the round's gather.
The pure parts are checked by hand; the device side runs the real tiny model and is compared
with the plain `Policy` playing host 0's calls alone.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from bpo_jax.models import config as model_config
from bpo_jax.models import sharding
from bpo_jax.models.llama import Transformer
from bpo_jax.multihost.lockstep import (
    LockstepAborted,
    Request,
    blocks,
    group_key,
    plan_round,
    run_in_lockstep,
)
from bpo_jax.multihost.shares import play_in_shares
from bpo_jax.multihost.slice_sampler import SliceSampler, host_row_keys, own_rows, rows_held
from bpo_jax.sampler.policy import Policy
from bpo_jax.sampler.tokens import row_keys

KEY = (tuple(int(v) for v in jax.random.key_data(jax.random.key(7))), "threefry2x32")


def _prefill(n, length=3):
    return Request("prefill", prompts=tuple((5,) * length for _ in range(n)))


def _sample(n, greedy=False, context=0):
    return Request("sample", context=context, rows=tuple(range(n)), greedy=greedy, key=KEY)


# ---------------------------------------------------------------------- pure parts


def test_round_groups_requests_in_canonical_order_with_the_largest_bucket():
    requests = [
        _sample(3, greedy=True),
        _prefill(3),
        Request("done"),
        _sample(10),
        _prefill(9),
        Request("entropy", context=4, size=2),
    ]
    groups = plan_round(requests)
    assert [(g.kind, g.greedy, g.hosts, g.rows) for g in groups] == [
        ("prefill", False, (1, 4), 16),  # max(bucket(3) = 8, bucket(9) = 16)
        ("entropy", False, (5,), 0),
        ("sample", False, (3,), 16),
        ("sample", True, (0,), 8),
    ]
    # The order is the requests' group keys, whichever host asked first.
    assert plan_round(requests[::-1]) == [
        type(g)(g.kind, g.greedy, tuple(5 - h for h in reversed(g.hosts)), g.rows) for g in groups
    ]
    assert group_key(_prefill(1)) < group_key(_sample(1)) < group_key(_sample(1, greedy=True))


def test_round_of_ends_has_no_group():
    assert plan_round([Request("done"), Request("done")]) == []
    with pytest.raises(ValueError, match="kind"):
        Request("decode")


def test_blocks_pad_each_host_and_fill_a_host_without_rows():
    rows = blocks({0: ["a", "b"], 2: ["c"]}, 3, 3, lambda p, own: own[0] if own else f"pad{p}")
    assert rows == ["a", "b", "a", "pad1", "pad1", "pad1", "c", "c", "c"]
    with pytest.raises(ValueError, match="more than the block"):
        blocks({0: [1, 2, 3]}, 1, 2, lambda p, own: 0)


class _Script:
    """Host 1 of a simulated two-host run: its requests, one per round, then "done"."""

    def __init__(self, requests):
        self.requests = list(requests)
        self.seen: list[list[Request]] = []

    def __call__(self, mine: Request) -> list[Request]:
        other = self.requests.pop(0) if self.requests else Request("done")
        self.seen.append([mine, other])
        return [mine, other]


class _Recorder:
    """An executor that records the groups and answers what the worker expects."""

    def __init__(self):
        self.groups, self.released = [], []

    def release(self, host, ids):
        self.released += [(host, i) for i in ids]

    def run(self, group, requests):
        self.groups.append((group.kind, group.hosts, group.rows))
        if group.kind == "prefill":
            return (len(self.groups), 0)
        if group.kind == "entropy":
            return np.zeros((requests[0].size,))
        n = len(requests[0].rows) if 0 in group.hosts else 0
        zeros = np.zeros((n, 1))
        return {"tokens": zeros.astype(int), "logprobs": zeros, "entropies": zeros,
                "lengths": np.ones((n,), int)}  # fmt: skip


class _Tok:
    pad_id, stop_ids = 0, (1,)

    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))


class _Settings:
    tokenizer, max_new_tokens, cache_len, temperature = _Tok(), 4, 64, 1.0


def test_hosts_take_part_in_every_round_until_all_are_done():
    script = _Script([Request("done"), _prefill(20), _sample(2)])
    executor = _Recorder()

    def play(policy):
        ctx = policy.prefill([[3, 4]])
        policy.next_token_entropy(ctx)
        del ctx  # Released: announced with the next request.
        return "played"

    out = run_in_lockstep(play, executor, _Settings(), allgather=script, me=0)
    assert out == "played"
    # Round 1: host 1 is done at once, host 0 prefills alone; round 2: both hosts' calls, each
    # its own group; round 3: host 0 has ended and host 1 samples alone.
    assert executor.groups == [
        ("prefill", (0,), 8),
        ("prefill", (1,), 32),
        ("entropy", (0,), 0),
        ("sample", (1,), 8),
    ]
    assert [r[0].kind for r in script.seen] == ["prefill", "entropy", "done", "done"]
    assert executor.released == [(0, 1)]


def test_a_failed_host_stops_every_host():
    script = _Script([_prefill(1), Request("failed")])

    def play(policy):
        ctx = policy.prefill([[3]])
        policy.next_token_entropy(ctx)  # Answered with the abort.
        raise AssertionError("not reached")

    with pytest.raises(LockstepAborted, match=r"host\(s\) \[1\]"):
        run_in_lockstep(play, _Recorder(), _Settings(), allgather=script, me=0)


def test_own_failure_is_raised_and_announced():
    script = _Script([_prefill(1), _sample(1), _sample(1)])

    def play(policy):
        policy.prefill([[3]])
        raise KeyError("env broke")

    with pytest.raises(KeyError, match="env broke"):
        run_in_lockstep(play, _Recorder(), _Settings(), allgather=script, me=0)
    assert [r[0].kind for r in script.seen] == ["prefill", "failed"]


def test_one_process_plays_a_slice_wide_policy_as_the_host_path():
    """With one process both modes are the plain path: `play` gets the policy itself."""

    class SliceWide:
        slice_wide = True

    policy, seen = SliceWide(), []

    def play(tasks, key, share, share_policy):
        seen.append(share_policy)
        return sum(tasks)

    played = play_in_shares(list(range(5)), 2, jax.random.key(0), policy, play)
    assert seen == [policy, policy]
    assert [(s.start, s.stop, r) for s, r in played] == [(0, 2, 1), (2, 5, 9)]


# ---------------------------------------------------------------------- device side


def test_host_row_keys_are_each_host_s_own_row_keys():
    keys = [jax.random.key(3), jax.random.key(11)]
    data = np.stack([np.asarray(jax.random.key_data(k)) for k in keys])
    got = host_row_keys(data, impl="threefry2x32", rows=4)
    want = np.concatenate([np.asarray(jax.random.key_data(row_keys(k, 4))) for k in keys])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), want)


def test_own_rows_reads_a_host_s_span_from_its_shards():
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    x = jax.device_put(np.arange(24).reshape(8, 3), jax.sharding.NamedSharding(mesh, jax.P()))
    assert rows_held(x.sharding, x.shape, 0).all()
    np.testing.assert_array_equal(own_rows(x, {0: (2, 5)}, 0), np.arange(24).reshape(8, 3)[2:5])
    assert own_rows(x, {1: (0, 2)}, 0) is None


@pytest.fixture(scope="module")
def policy():
    cfg = model_config.tiny(vocab_size=96, max_seq_len=96)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    # Sharpened, as in test_sampler: context-dependent, varied distributions.
    params = jax.tree.map_with_path(
        lambda p, x: x * (4.0 if "embed" in jax.tree_util.keystr(p) else 1.0), params
    )
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    return Policy(
        graphdef,
        params,
        _Tok(),
        cfg,
        max_new_tokens=5,
        cache_len=64,
        temperature=1.0,
        length_bucket=8,
        mesh=mesh,
        prefix_reuse=False,
        slice_wide=True,
    )


def _calls(policy, prompts, consume: bool):
    """Host 0's calls: prefill, entropies, forked rows sampled, then every prompt (greedy)."""
    ctx = policy.prefill(prompts)
    entropy = policy.next_token_entropy(ctx)
    forked = policy.sample(ctx, jax.random.key(5), rows=[0, 1, 1, 2, 3])
    last = policy.sample(ctx, jax.random.key(6), greedy=True, keep_context=not consume)
    return entropy, forked + last


@pytest.mark.parametrize("consume", [False, True])
def test_two_simulated_hosts_sample_host_0_s_rows_as_it_alone_does(policy, consume):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 96, n).tolist() for n in (5, 11, 3, 8)]
    # Host 1: more, longer prompts (a wider batch and length bucket), other rows and keys.
    other = [rng.integers(2, 96, n).tolist() for n in (30, 2, 17, 9, 12, 4, 6, 20, 7)]
    key1 = (tuple(int(v) for v in jax.random.key_data(jax.random.key(99))), "threefry2x32")
    script = _Script(
        [
            Request("prefill", prompts=tuple(map(tuple, other))),
            Request("entropy", context=0, size=len(other)),
            Request("sample", context=0, rows=(8, 0, 3), key=key1),
            Request(
                "sample",
                context=0,
                rows=tuple(range(9)),
                in_place=consume,
                greedy=True,
                key=key1,
                released=(0,),  # Host 1 dropped its handle (the context outlives it: host 0's).
            ),
        ]
    )
    executor = SliceSampler(policy, hosts=2, me=0)
    entropy, samples = run_in_lockstep(
        lambda p: _calls(p, prompts, consume), executor, policy, allgather=script, me=0
    )
    assert executor.contexts == {}  # Consumed, or released by both hosts.
    want_entropy, want = _calls(policy, prompts, consume)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-5)
    assert [s.token_ids for s in samples] == [s.token_ids for s in want]
    for got, ref in zip(samples, want):
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)
        np.testing.assert_allclose(got.entropies, ref.entropies, atol=1e-5)


class _Device:
    def __init__(self, kind, process_index):
        self.device_kind, self.process_index = kind, process_index


class _Mesh:
    def __init__(self, kind, hosts):
        self.devices = np.array([_Device(kind, p) for p in range(hosts) for _ in range(4)])


def test_host_sampling_is_refused_on_multi_host_v5e_and_v6e_slices():
    """libtpu refuses programs on part of a v5e / v6e slice: say so before the first rollout."""
    from bpo_jax.builders import check_host_sampling

    for kind in ("TPU v5 lite", "TPU v6 lite"):
        with pytest.raises(ValueError, match="mesh.sampler=slice"):
            check_host_sampling(_Mesh(kind, hosts=2))
        check_host_sampling(_Mesh(kind, hosts=1))  # one host: its chips are the slice
    check_host_sampling(_Mesh("TPU v5p", hosts=2))
    check_host_sampling(_Mesh("cpu", hosts=2))


def test_prompt_and_row_checks_shared_by_both_policies():
    from bpo_jax.sampler.policy import check_prompts_fit, check_rows

    check_prompts_fit([[1] * 48], max_new_tokens=16, cache_len=64)
    with pytest.raises(ValueError, match="Prompt 1 has 49 tokens"):
        check_prompts_fit([[1], [1] * 49], max_new_tokens=16, cache_len=64)
    check_rows([0, 2, 2], size=3)
    with pytest.raises(ValueError, match="rows must index the 3 prompts"):
        check_rows([0, 3], size=3)
