"""Tests for `sampler.PrefixCache`: shared prompt prefixes computed once, counted exactly.

Prompts are built so that what can be reused is known by construction: groups of rows share a
head, and every suffix starts with a token no other row's suffix starts with at that position.
Each test checks the tokens run against the prompts' lengths and the contexts against a prefill
of the whole prompts from a fresh cache.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from bpo_jax.models import config
from bpo_jax.models.llama import Transformer, init_cache
from bpo_jax.sampler import PrefixCache, Sampler
from bpo_jax.sampler.prefixes import longest_common_prefix, shared_in_batch

CFG = config.tiny(max_seq_len=256)
CAPACITY = 160
HEAD = 40  # tokens shared by a group
GROUP = 4
# Logits of magnitude up to ~5 from differently shaped float32 products (a suffix prefilled at
# an offset against a whole prompt): on an AVX-512 Xeon they differed by up to 1.8e-5, past the
# 1e-5 used before. The generated tokens must still be identical.
ATOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    # Sharpened as in test_sampler, so that sampled tokens depend on the context.
    params = jax.tree.map_with_path(
        lambda p, x: x * (4.0 if "embed" in jax.tree_util.keystr(p) else 3.0), params
    )
    sampler = Sampler(
        graphdef, eos_ids=(), pad_id=0, max_new_tokens=6, temperature=1.0, length_bucket=16
    )
    return params, sampler


def new_cache(rows):
    return init_cache(CFG, rows, CAPACITY)


def heads(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, CFG.vocab_size, HEAD).tolist() for _ in range(2)]


def suffixes(lengths, first_tokens, seed):
    """Random suffixes whose first tokens are given (distinct, so matches stop there)."""
    rng = np.random.default_rng(seed)
    return [
        [f, *rng.integers(10, CFG.vocab_size, n - 1).tolist()]
        for f, n in zip(first_tokens, lengths)
    ]


def grouped(h, lengths, first_tokens, seed):
    """Prompts of rows in groups of GROUP: the group's head, then each row's own suffix."""
    rows = suffixes(lengths, first_tokens, seed)
    return [h[b // GROUP] + s for b, s in enumerate(rows)]


def first_turn(params, sampler, head_seed, lens, seed):
    """A prefix cache after a first turn whose rows are `grouped` under `heads(head_seed)`, with
    suffixes of `lens` tokens: (the cache, the heads, the turn's prompts, its prefill state)."""
    prefixes = PrefixCache(sampler, new_cache)
    h = heads(seed=head_seed)
    turn = grouped(h, lens, range(1, 9), seed=seed)
    return prefixes, h, turn, prefixes.prefill(params, turn)


def fresh(params, sampler, prompts):
    return sampler.prefill(params, new_cache(len(prompts)), prompts)


def assert_same_contexts(params, sampler, state, prompts, seed):
    """Same next-token logits and the same generated tokens as a prefill from scratch."""
    ref = fresh(params, sampler, prompts)
    np.testing.assert_allclose(state.last_logits, ref.last_logits, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(state.cache.lengths, [len(p) for p in prompts])
    # The lengths the next prefill reads on the host, without waiting for the device.
    np.testing.assert_array_equal(state.host_lengths, [len(p) for p in prompts])
    a = sampler.generate(params, state, jax.random.key(seed))
    b = sampler.generate(params, ref, jax.random.key(seed))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.state.host_lengths, np.asarray(a.state.cache.lengths))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


def test_common_prefix_helpers():
    rows = np.array([[1, 2, 3, -1], [1, 2, 4, 5], [7, 2, 3, 4]])
    assert longest_common_prefix(rows, np.array([1, 2, 3, 9, 9])).tolist() == [3, 2, 0]
    assert longest_common_prefix(rows, np.array([1, 2])).tolist() == [2, 2, 0]
    prompts = [np.array(p) for p in ([1, 2, 3], [5], [1, 2, 9, 9], [1, 2, 3, 4])]
    assert shared_in_batch(prompts).tolist() == [3, 0, 2, 3]


def test_heads_then_suffixes_then_growing_history(setup):
    params, sampler = setup
    prefixes = PrefixCache(sampler, new_cache)
    h = heads()
    lens1 = [5, 9, 2, 14, 7, 3, 11, 6]
    s1 = suffixes(lens1, range(1, 9), seed=1)
    turn1 = [h[b // GROUP] + s1[b] for b in range(8)]
    state = prefixes.prefill(params, turn1)
    # Each head once (its group's rows share exactly HEAD tokens), then every row's suffix.
    assert prefixes.last_shared_tokens == 2 * HEAD
    assert state.prefilled_tokens == 2 * HEAD + sum(lens1)
    assert_same_contexts(params, sampler, state, turn1, seed=0)

    # The next turn: new suffixes after the same heads; only the suffixes run.
    lens2 = [8, 1, 4, 10, 2, 12, 5, 3]
    s2 = suffixes(lens2, range(11, 19), seed=2)
    turn2 = [h[b // GROUP] + s2[b] for b in range(8)]
    state = prefixes.prefill(params, turn2)
    assert prefixes.last_shared_tokens == 0
    assert state.prefilled_b.tolist() == lens2
    assert_same_contexts(params, sampler, state, turn2, seed=1)

    # A history that only grows: each prompt extends its previous one, and only the
    # extension runs.
    ext = [5, 2, 9, 1, 3, 6, 4, 7]
    turn3 = [p + s for p, s in zip(turn2, suffixes(ext, range(21, 29), seed=3))]
    state = prefixes.prefill(params, turn3)
    assert state.prefilled_b.tolist() == ext
    assert_same_contexts(params, sampler, state, turn3, seed=2)

    # The same prompts again: every row ends where a kept row ends; its logits are reused.
    state = prefixes.prefill(params, turn3)
    assert state.prefilled_tokens == 0
    assert_same_contexts(params, sampler, state, turn3, seed=3)

    # A prompt cut inside a kept row still needs its last token's logits: one token runs.
    cut = [p[: HEAD + 1] for p in turn3]
    state = prefixes.prefill(params, cut)
    assert state.prefilled_b.tolist() == [1] * 8
    assert_same_contexts(params, sampler, state, cut, seed=4)


def test_group_members_continue_their_own_rows_in_place(setup, monkeypatch):
    """A row matching several kept rows equally far (its group's head) continues its own.

    Every row then continues itself, in order, so the kept batch is prefilled into in place:
    no program gathers rows (`regroup`), the copy of a batch's cache a turn would otherwise make.
    """
    from bpo_jax.sampler import prefixes as prefixes_lib

    params, sampler = setup
    lens = [4, 6, 3, 5, 7, 2, 8, 5]
    prefixes, h, _, _ = first_turn(params, sampler, 21, lens, seed=22)
    calls = []
    monkeypatch.setattr(prefixes_lib, "regroup", lambda *a: calls.append(a) or None)
    turn2 = grouped(h, lens, range(11, 19), seed=23)
    state = prefixes.prefill(params, turn2)
    assert calls == []
    assert state.prefilled_b.tolist() == lens
    assert_same_contexts(params, sampler, state, turn2, seed=9)


def test_rows_continue_other_rows_reordered_and_repeated(setup):
    """Branch children: the next call's rows continue kept rows out of order, some twice.

    Also checks that the kept rows survive the `generate` that consumes the returned state.
    """
    params, sampler = setup
    lens1 = [6, 3, 9, 4, 2, 8, 5, 7]
    prefixes, _, turn1, state = first_turn(params, sampler, 11, lens1, seed=12)
    sampler.generate(params, state, jax.random.key(0))  # consumes `state`, not the kept rows
    parents = [5, 5, 2, 0, 7, 1]
    ext = [3, 7, 1, 4, 2, 6]
    grown = suffixes(ext, range(31, 37), seed=13)
    turn2 = [turn1[p] + g for p, g in zip(parents, grown)]
    state = prefixes.prefill(params, turn2)
    assert prefixes.last_shared_tokens == 0
    assert state.prefilled_b.tolist() == ext
    assert_same_contexts(params, sampler, state, turn2, seed=8)


def test_identical_prompts_run_once(setup):
    params, sampler = setup
    prefixes = PrefixCache(sampler, new_cache)
    h = heads(seed=5)
    prompts = [h[b // GROUP] for b in range(8)]  # Two prompts, four rows each (turn 0).
    state = prefixes.prefill(params, prompts)
    assert state.prefilled_tokens == 2 * HEAD
    assert_same_contexts(params, sampler, state, prompts, seed=5)


def test_new_parameters_start_from_nothing(setup):
    params, sampler = setup
    lens = [3, 4, 5, 6, 7, 8, 9, 10]
    prefixes, _, prompts, _ = first_turn(params, sampler, 6, lens, seed=7)
    updated = jax.tree.map(lambda x: x * 1.01, params)
    state = prefixes.prefill(updated, prompts)
    # Nothing kept under the old parameters is reused: the heads and suffixes run again.
    assert state.prefilled_tokens == 2 * HEAD + sum(lens)
    assert_same_contexts(updated, sampler, state, prompts, seed=6)
    prefixes.clear()
    assert prefixes.kept_rows == 0


def test_short_shared_prefixes_are_not_prefilled_apart(setup):
    params, sampler = setup
    prefixes = PrefixCache(sampler, new_cache, min_shared=16)
    rng = np.random.default_rng(8)
    common = rng.integers(10, CFG.vocab_size, 15).tolist()  # shorter than min_shared
    lens = [4, 6, 8, 10]
    prompts = [common + s for s in suffixes(lens, range(1, 5), seed=9)]
    state = prefixes.prefill(params, prompts)
    assert prefixes.last_shared_tokens == 0
    assert state.prefilled_tokens == sum(len(p) for p in prompts)
    assert_same_contexts(params, sampler, state, prompts, seed=7)


def test_empty_prompt_is_rejected(setup):
    params, sampler = setup
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(sampler, new_cache).prefill(params, [[1, 2], []])
