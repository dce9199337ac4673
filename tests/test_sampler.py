"""Tests for bpo_jax.sampler: cached decoding, multi-turn appends, forking and sampling rules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bpo_jax import sampler as sampler_lib
from bpo_jax.models import config
from bpo_jax.models.llama import Transformer, init_cache

CFG = config.tiny(max_seq_len=128)  # float32
CAPACITY = 96
NEW = 12  # max_new_tokens
BUCKET = 16
REF_WIDTH = 96  # the uncached reference pass pads every sequence to this width (one compile)
ATOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    # Sharpen the random model: at init its next-token distribution is near uniform, or (with
    # tied embeddings) greedy repeats the input token. Larger weights give context-dependent,
    # non-uniform distributions, so greedy, top-p and entropy tests mean something.
    params = jax.tree.map_with_path(lambda path, x: x * _weight_scale(path), params)
    sampler = sampler_lib.Sampler(
        graphdef, eos_ids=(), pad_id=0, max_new_tokens=NEW, temperature=0.7, length_bucket=BUCKET
    )
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)[0])
    return graphdef, params, sampler, forward


def _weight_scale(path) -> float:
    name = jax.tree_util.keystr(path)
    if "embed_tokens" in name:
        return 4.0
    if "norm" in name or "bias" in name:
        return 1.0
    return 6.0


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CFG.vocab_size, n).tolist() for n in lengths]


def reference_logits(forward, params, seqs):
    """Uncached logits [B, REF_WIDTH, V] of right-padded sequences."""
    toks = np.zeros((len(seqs), REF_WIDTH), np.int32)
    for b, s in enumerate(seqs):
        toks[b, : len(s)] = s
    return np.asarray(forward(params, jnp.asarray(toks)))


def generated(out, b):
    return out.tokens[b, : out.lengths[b]].tolist()


def keys(*seeds):
    return jnp.stack([jax.random.key(s) for s in seeds])


def fresh_cache(batch):
    return init_cache(CFG, batch, CAPACITY)


def generate_fresh(sampler, params, ps, rng, **options):
    """`sampler.generate` from the prompts `ps` prefilled into a fresh cache of their rows."""
    return sampler.generate(
        params, sampler.prefill(params, fresh_cache(len(ps)), ps), rng, **options
    )


def test_cached_decode_matches_uncached_forward(setup):
    _, params, sampler, forward = setup
    temperature = 0.7
    lens = [5, 17, 30, 1]
    ps = prompts(lens)
    state = sampler.prefill(params, fresh_cache(4), ps)
    out = sampler.generate(params, state, jax.random.key(1), temperature=temperature)
    assert out.lengths.tolist() == [NEW] * 4 and not out.stopped.any()
    assert out.num_generated == 4 * NEW

    seqs = [p + generated(out, b) for b, p in enumerate(ps)]
    ref = reference_logits(forward, params, seqs)
    for b, n in enumerate(lens):
        # Token j of row b is predicted at position n + j - 1.
        logits = ref[b, n - 1 : n - 1 + NEW] / temperature
        logp = jax.nn.log_softmax(logits, axis=-1)
        tok = out.tokens[b]
        np.testing.assert_allclose(out.logprobs[b], logp[np.arange(NEW), tok], atol=ATOL)
        entropy = -(np.exp(logp) * logp).sum(-1)
        np.testing.assert_allclose(out.entropies[b], entropy, atol=ATOL)
        # The returned state's next-token logits follow the last generated token.
        np.testing.assert_allclose(
            np.asarray(out.state.last_logits[b]), ref[b, n + NEW - 1], atol=ATOL
        )
    np.testing.assert_array_equal(np.asarray(out.state.cache.lengths), np.asarray(lens) + NEW)


def test_blockwise_causal_forward_matches_full_attention(setup):
    """The reference above is the uncached forward, which skips masked key blocks; with explicit
    positions the model attends over all T keys and masks instead. Both must agree."""
    graphdef, params, _, forward = setup
    t = 200  # four query blocks, the last one ragged
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    full = jax.jit(lambda p, x, pos: nnx.merge(graphdef, p)(x, positions_bt=pos)[0])
    np.testing.assert_allclose(
        np.asarray(forward(params, tokens)), np.asarray(full(params, tokens, positions)), atol=ATOL
    )


def test_prefill_attention_bound_skips_only_masked_slots(setup):
    """A prefill told how long the cached contexts are at most attends to fewer cache slots
    (`offset_bound`) and computes the same logits and cache as one over the whole cache."""
    graphdef, params, _, _ = setup
    step = jax.jit(
        functools.partial(sampler_lib.programs.prefill, graphdef), static_argnames="offset_bound"
    )
    vocab = CFG.vocab_size
    for offsets, new in (([0, 0, 0, 0], 70), ([3, 20, 0, 11], 40)):
        cache = init_cache(CFG, 4, 128)
        last = jnp.zeros((4, vocab))
        if max(offsets):
            first = np.asarray(prompts([max(offsets)] * 4, seed=5), np.int32)
            cache, last = step(params, cache, last, jnp.asarray(first), jnp.asarray(offsets))
        tokens = jnp.asarray(np.asarray(prompts([new] * 4, seed=6), np.int32))
        num_new = jnp.asarray([new, new - 5, 1, new - 30])
        got = step(params, cache, last, tokens, num_new, offset_bound=max(offsets))
        want = step(params, cache, last, tokens, num_new, offset_bound=None)
        np.testing.assert_allclose(got[1], want[1], atol=ATOL, rtol=0)
        for a, b in zip(got[0].k + got[0].v, want[0].k + want[0].v):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert [sampler_lib.core.offset_bucket(n, 4096) for n in (0, 1, 64, 65, 192, 300, 700)] == [
        0,
        64,
        64,
        128,
        192,
        320,
        768,
    ]


def test_multi_turn_append_matches_prefill_from_scratch(setup):
    _, params, sampler, _ = setup
    turn_a = prompts([7, 20, 3, 11], seed=1)
    turn_b = prompts([4, 1, 9, 13], seed=2)
    k1, k2 = jax.random.key(10), jax.random.key(11)

    state = sampler.prefill(params, fresh_cache(4), turn_a)
    assert state.prefilled_b.tolist() == [7, 20, 3, 11] and state.prefilled_tokens == 41
    out1 = sampler.generate(params, state, k1)
    state = sampler.prefill(params, out1.state, turn_b)
    # Only the observation is run: the prompt and the generated tokens are not prefilled again.
    assert state.prefilled_b.tolist() == [4, 1, 9, 13]
    out2 = sampler.generate(params, state, k2)

    whole = [a + generated(out1, b) + o for b, (a, o) in enumerate(zip(turn_a, turn_b))]
    scratch = sampler.prefill(params, fresh_cache(4), whole)
    assert scratch.prefilled_tokens == sum(map(len, whole))
    out_scratch = sampler.generate(params, scratch, k2)

    np.testing.assert_array_equal(out2.tokens, out_scratch.tokens)
    np.testing.assert_allclose(out2.logprobs, out_scratch.logprobs, atol=ATOL)
    np.testing.assert_allclose(out2.entropies, out_scratch.entropies, atol=ATOL)
    np.testing.assert_array_equal(
        np.asarray(out2.state.cache.lengths), np.asarray(out_scratch.state.cache.lengths)
    )
    # The states know their rows' lengths on the host too (the next prefill reads them there),
    # through prefill, generate, append and generate again.
    for st in (out2.state, out_scratch.state):
        np.testing.assert_array_equal(st.host_lengths, np.asarray(st.cache.lengths))


def test_chunked_prefill_matches_one_prefill(setup):
    """`prefill_chunk` runs a prompt's columns a chunk at a time: the same contexts (cache
    lengths, next-token logits, sampled tokens) as one prefill, for ragged rows (one ends in the
    first chunk and runs nothing after it, one has no tokens), a second turn after cached
    contexts, and `prefill_and_copy`."""
    graphdef, params, whole, _ = setup
    chunked = sampler_lib.Sampler(
        graphdef,
        eos_ids=(),
        pad_id=0,
        max_new_tokens=NEW,
        temperature=0.7,
        length_bucket=BUCKET,
        prefill_chunk=BUCKET,
    )
    turn_a = prompts([40, 9, 0, 33], seed=5)
    turn_b = prompts([17, 3, 21, 0], seed=6)
    key = jax.random.key(3)
    outs = []
    for sampler in (whole, chunked):
        state = sampler.prefill(params, fresh_cache(4), turn_a)
        first = sampler.generate(params, state, key)
        state, copy = sampler.prefill_and_copy(params, first.state, turn_b)
        # Host copies first: `generate` donates the state's buffers.
        seen = [(np.asarray(s.last_logits), np.asarray(s.cache.lengths)) for s in (state, copy)]
        outs.append((seen, state.prefilled_b, sampler.generate(params, state, key)))
    (w_seen, w_prefilled, w_out), (c_seen, c_prefilled, c_out) = outs
    for (w_logits, w_lengths), (c_logits, c_lengths) in zip(w_seen, c_seen):
        np.testing.assert_allclose(c_logits, w_logits, atol=ATOL)
        np.testing.assert_array_equal(c_lengths, w_lengths)
    assert c_prefilled.tolist() == w_prefilled.tolist() == [17, 3, 21, 0]
    np.testing.assert_array_equal(c_out.tokens, w_out.tokens)
    np.testing.assert_allclose(c_out.logprobs, w_out.logprobs, atol=ATOL)
    with pytest.raises(ValueError, match="prefill_chunk"):
        sampler_lib.Sampler(
            graphdef, eos_ids=(), pad_id=0, max_new_tokens=4, length_bucket=16, prefill_chunk=24
        )


def test_forked_row_continues_like_original_with_same_key(setup):
    _, params, sampler, _ = setup
    state = sampler.prefill(params, fresh_cache(4), prompts([6, 14, 25, 2], seed=3))
    # Fork before generating: generate donates (consumes) the cache it is given.
    forked = sampler.fork(state, [1, 1, 1, 2])
    assert forked.prefilled_tokens == 0
    np.testing.assert_array_equal(np.asarray(forked.cache.lengths), [14, 14, 14, 25])
    original = sampler.generate(params, state, keys(0, 1, 2, 3))
    out = sampler.generate(params, forked, keys(1, 1, 99, 2))

    np.testing.assert_array_equal(out.tokens[0], original.tokens[1])
    np.testing.assert_array_equal(out.tokens[1], original.tokens[1])
    np.testing.assert_array_equal(out.tokens[3], original.tokens[2])
    np.testing.assert_allclose(out.logprobs[0], original.logprobs[1], atol=ATOL)
    np.testing.assert_allclose(out.logprobs[3], original.logprobs[2], atol=ATOL)
    # Same context, another key: a different continuation.
    assert not np.array_equal(out.tokens[2], out.tokens[1])


def test_concat_states_regroups_contexts(setup):
    _, params, sampler, _ = setup
    a = sampler.prefill(params, fresh_cache(4), prompts([6, 14, 25, 2], seed=11))
    b = sampler.prefill(params, fresh_cache(4), prompts([9, 3, 17, 30], seed=12))
    both = sampler_lib.concat_states([a, b])
    assert both.batch_size == 8 and both.prefilled_tokens == a.prefilled_tokens + b.prefilled_tokens
    # Rows 1 and 2 of a, rows 0 and 3 of b: one batch of four continuations.
    mixed = sampler.fork(both, [1, 2, 4, 7])
    expected = sampler.fork(a, [1, 2, 0, 0])  # compare against each source row alone
    np.testing.assert_array_equal(np.asarray(mixed.cache.lengths), [14, 25, 9, 30])
    np.testing.assert_array_equal(mixed.host_lengths, [14, 25, 9, 30])
    for got, want in zip(mixed.cache.k + mixed.cache.v, expected.cache.k + expected.cache.v):
        np.testing.assert_array_equal(np.asarray(got[:2]), np.asarray(want[:2]))
    np.testing.assert_array_equal(np.asarray(mixed.last_logits[3]), np.asarray(b.last_logits[3]))
    with pytest.raises(ValueError, match="capacities"):
        small = sampler_lib.PrefillState(
            init_cache(CFG, 4, 64), jnp.zeros((4, CFG.vocab_size)), np.zeros(4, np.int32)
        )
        sampler_lib.concat_states([a, small])


def test_one_key_gives_rows_different_streams(setup):
    _, params, sampler, _ = setup
    state = sampler.prefill(params, fresh_cache(4), prompts([6] * 4, seed=4))
    state = sampler.fork(state, [0, 0, 0, 0])
    out = sampler.generate(params, state, jax.random.key(5))  # row b uses fold_in(key, b)
    assert len({tuple(t) for t in out.tokens.tolist()}) == 4


def test_rows_of_different_lengths_behave_as_if_alone(setup):
    _, params, sampler, _ = setup
    lens = [3, 20, 9, 33]
    ps = prompts(lens, seed=5)
    row_keys = keys(20, 21, 22, 23)
    batch = generate_fresh(sampler, params, ps, row_keys)
    for b, p in enumerate(ps):
        alone = generate_fresh(sampler, params, [p], row_keys[b : b + 1])
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])
        np.testing.assert_allclose(alone.logprobs[0], batch.logprobs[b], atol=ATOL)
        np.testing.assert_allclose(alone.entropies[0], batch.entropies[b], atol=ATOL)


def test_greedy_is_argmax_and_tiny_top_p_is_greedy(setup):
    _, params, sampler, forward = setup
    lens = [4, 12, 27, 8]
    ps = prompts(lens, seed=6)
    greedy = generate_fresh(sampler, params, ps, jax.random.key(0), temperature=0.0)
    ref = reference_logits(forward, params, [p + generated(greedy, b) for b, p in enumerate(ps)])
    for b, n in enumerate(lens):
        logits = ref[b, n - 1 : n - 1 + NEW]
        np.testing.assert_array_equal(greedy.tokens[b], logits.argmax(-1))
        # Greedy reports the untempered distribution.
        logp = jax.nn.log_softmax(logits, axis=-1)
        np.testing.assert_allclose(
            greedy.logprobs[b], logp[np.arange(NEW), greedy.tokens[b]], atol=ATOL
        )

    nucleus = generate_fresh(sampler, params, ps, jax.random.key(123), temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(nucleus.tokens, greedy.tokens)
    # logprobs describe the tempered distribution before truncation, so they are not 0.
    assert (nucleus.logprobs < -1e-3).any()


def test_logprobs_and_entropies_are_valid(setup):
    _, params, sampler, _ = setup
    ps = prompts([10, 3, 31, 17], seed=7)
    for temperature, top_p in [(1.0, 1.0), (0.5, 0.9), (1.5, 0.5)]:
        out = generate_fresh(
            sampler, params, ps, jax.random.key(3), temperature=temperature, top_p=top_p
        )
        assert np.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()
        assert (out.entropies >= 0).all()
        assert (out.entropies <= np.log(CFG.vocab_size) + 1e-4).all()
        # A token drawn from the nucleus has at least the mass of the least likely kept token,
        # which is never below (1 - top_p) / V; in particular, never an impossible draw.
        assert (out.logprobs > -60).all()


def test_stops_at_eos_and_pads_after(setup):
    graphdef, params, base, _ = setup
    lens = [6, 15, 2, 22]
    ps = prompts(lens, seed=8)
    free = generate_fresh(base, params, ps, jax.random.key(0), temperature=0.0)
    # Every row's third greedy token is a stop token: all rows stop, by step 3 at the latest.
    eos = sorted({int(t) for t in free.tokens[:, 2]})
    sampler = sampler_lib.Sampler(
        graphdef, eos_ids=eos, pad_id=0, max_new_tokens=NEW, temperature=0.0, length_bucket=BUCKET
    )
    out = generate_fresh(sampler, params, ps, jax.random.key(0))
    for b in range(4):
        first = next(j for j in range(NEW) if free.tokens[b, j] in eos)
        assert out.lengths[b] == first + 1 and out.stopped[b]
        np.testing.assert_array_equal(out.tokens[b, : first + 1], free.tokens[b, : first + 1])
        assert out.tokens[b, first] in eos
        assert (out.tokens[b, first + 1 :] == 0).all()
        assert (out.logprobs[b, first + 1 :] == 0).all()
        assert (out.entropies[b, first + 1 :] == 0).all()
    # The loop exits once every row is done; the stop token is in the cache.
    assert out.num_steps == out.lengths.max() <= 3
    np.testing.assert_array_equal(
        np.asarray(out.state.cache.lengths), np.asarray(lens) + out.lengths
    )


def test_rows_without_new_tokens_keep_their_logits(setup):
    _, params, sampler, _ = setup
    state = sampler.prefill(params, fresh_cache(4), prompts([5, 9, 3, 7], seed=9))
    before = np.asarray(state.last_logits)
    state = sampler.prefill(params, state, [[3, 4], [], [5], []])
    assert state.prefilled_b.tolist() == [2, 0, 1, 0]
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [7, 9, 4, 7])
    after = np.asarray(state.last_logits)
    np.testing.assert_array_equal(after[[1, 3]], before[[1, 3]])
    assert np.abs(after[[0, 2]] - before[[0, 2]]).max() > 1e-3


def test_array_tokens_with_lengths(setup):
    _, params, sampler, _ = setup
    ps = prompts([5, 9, 3, 7], seed=10)
    arr = np.full((4, 9), 77, np.int32)
    for b, p in enumerate(ps):
        arr[b, : len(p)] = p
    from_lists = sampler.prefill(params, fresh_cache(4), ps)
    from_array = sampler.prefill(params, fresh_cache(4), arr, lengths=[5, 9, 3, 7])
    np.testing.assert_allclose(
        np.asarray(from_array.last_logits), np.asarray(from_lists.last_logits), atol=ATOL
    )
    with pytest.raises(ValueError, match="lengths"):
        sampler.prefill(params, fresh_cache(4), arr, lengths=[5, 9, 3])
    with pytest.raises(ValueError, match="lengths"):
        sampler.prefill(params, fresh_cache(4), arr, lengths=[5, 10, 3, 7])


def test_cache_capacity(setup):
    _, params, sampler, _ = setup
    with pytest.raises(ValueError, match="capacity"):
        sampler.prefill(params, fresh_cache(4), prompts([5, CAPACITY + 1, 3, 7]))
    # A row with fewer than NEW free positions stops early and says it ran out (not eos).
    state = sampler.prefill(params, fresh_cache(4), prompts([5, CAPACITY - 4, 3, CAPACITY]))
    out = sampler.generate(params, state, jax.random.key(0))
    assert out.lengths.tolist() == [NEW, 4, NEW, 0]
    assert not out.stopped.any()
    np.testing.assert_array_equal(
        np.asarray(out.state.cache.lengths), [5 + NEW, CAPACITY, 3 + NEW, CAPACITY]
    )


def test_prompt_lengths_share_a_bucket(setup):
    _, params, sampler, _ = setup
    assert [sampler_lib.bucket_length(n, 64) for n in (1, 64, 65)] == [64, 64, 128]
    assert [sampler_lib.bucket_length(n, "pow2") for n in (1, 5, 64, 65)] == [1, 8, 64, 128]
    with pytest.raises(ValueError, match="length_bucket"):
        sampler_lib.bucket_length(3, 0)
    sampler.prefill(params, fresh_cache(4), prompts([40, 2, 3, 3]))  # bucket 48
    compiled = sampler.prefill_fn(None)._cache_size()
    for n in (33, 47, 48):
        state = sampler.prefill(params, fresh_cache(4), prompts([n, 1, 2, 3]))
        assert state.prefill_len == 48
    assert sampler.prefill_fn(None)._cache_size() == compiled


def test_nucleus_mask_hand_values():
    probs = jnp.asarray([[0.15, 0.5, 0.05, 0.3]])
    kept = lambda p: np.flatnonzero(np.asarray(sampler_lib.nucleus_mask(probs, p)[0])).tolist()
    assert kept(1e-6) == [1]  # the top token is always kept
    assert kept(0.5) == [1]  # 0.5 alone reaches 0.5
    assert kept(0.51) == [1, 3]
    assert kept(0.8) == [1, 3]
    assert kept(0.81) == [0, 1, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    # Ties are broken by id, so exactly the smallest set is kept.
    ties = jnp.full((1, 4), 0.25)
    assert np.asarray(sampler_lib.nucleus_mask(ties, 0.5)).sum() == 2


@pytest.mark.parametrize(
    "temperature, top_p, expected",
    [
        (1.0, 1.0, [0.15, 0.5, 0.05, 0.3]),
        (1.0, 0.8, [0.0, 0.625, 0.0, 0.375]),  # the nucleus {1, 3}, renormalised
        (0.5, 1.0, np.array([0.15, 0.5, 0.05, 0.3]) ** 2 / 0.365),  # p^(1/T), renormalised
    ],
)
def test_sampling_frequencies(temperature, top_p, expected):
    probs = np.asarray([0.15, 0.5, 0.05, 0.3])
    n = 40_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs)), (n, 4))
    ks = jax.random.split(jax.random.key(0), n)
    tok, logp, ent = jax.jit(
        lambda lg, k: sampler_lib.sample_logits(
            lg, k, temperature, top_p, greedy=False, nucleus=top_p < 1
        )
    )(logits, ks)
    tok = np.asarray(tok)
    freq = np.bincount(tok, minlength=4) / n
    # 4 standard errors of a frequency near 0.5 at n = 40k is 0.01.
    np.testing.assert_allclose(freq, expected, atol=0.01)
    # Log-probs and entropy are those of the tempered distribution before truncation.
    tempered = np.log(probs) / temperature
    tempered -= np.log(np.exp(tempered).sum())
    np.testing.assert_allclose(np.asarray(logp), tempered[tok], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), -(np.exp(tempered) * tempered).sum(), atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 4, 1000, 1024, 3000])
def test_inverse_cdf_matches_a_sequential_search(vocab):
    rng = np.random.default_rng(vocab)
    rows = 256
    weights = rng.random((rows, vocab)).astype(np.float32) ** 4
    weights[rng.random((rows, vocab)) < 0.5] = 0.0  # tokens that must never be drawn
    weights[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0  # every row has some mass
    u = rng.random(rows).astype(np.float32)
    u[:4] = [0.0, 0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
    got = np.asarray(jax.jit(sampler_lib.inverse_cdf)(jnp.asarray(weights), jnp.asarray(u)))
    assert (weights[np.arange(rows), got] > 0).all()
    # The exact answer: the first token whose cumulative weight exceeds u * total.
    cum = np.cumsum(weights.astype(np.float64), axis=-1)
    target = u * cum[:, -1]
    want = (cum <= target[:, None]).sum(-1)
    # Float32 sums may move a target that lies within rounding of a boundary across it.
    near = np.abs(cum - target[:, None]).min(-1) <= 1e-5 * cum[:, -1]
    assert (got == want)[~near].all()
    assert (~near).mean() > 0.9


def test_tokens_outside_the_nucleus_are_never_drawn():
    # Two top tokens of 1/52 each and 1,000 others of e^-3/52 (96% of the mass together):
    # with top_p = 0.03 the nucleus is the top two, and nothing else may ever be drawn.
    logits = np.full((1, 1002), -3.0, np.float32)
    logits[0, 500:502] = 0.0
    n = 5_000
    ks = jax.random.split(jax.random.key(1), n)
    tok, _, _ = jax.jit(
        lambda lg, k: sampler_lib.sample_logits(lg, k, 1.0, 0.03, greedy=False, nucleus=True)
    )(jnp.broadcast_to(jnp.asarray(logits), (n, 1002)), ks)
    counts = np.bincount(np.asarray(tok), minlength=1002)
    assert counts.sum() == counts[500] + counts[501]
    assert abs(counts[500] - counts[501]) < 4 * np.sqrt(n)  # 50/50 between the two


def test_temperature_scales_logits():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    ks = jax.random.split(jax.random.key(0), 1)
    tok, logp, ent = sampler_lib.sample_logits(logits, ks, 0.5, 1.0, greedy=False, nucleus=False)
    ref = jax.nn.log_softmax(logits[0] / 0.5)
    np.testing.assert_allclose(np.asarray(logp)[0], ref[tok[0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent)[0], -(jnp.exp(ref) * ref).sum(), atol=1e-6)


def test_bad_arguments_raise(setup):
    graphdef, params, sampler, _ = setup
    with pytest.raises(ValueError, match="top_p"):
        sampler_lib.Sampler(graphdef, eos_ids=(), pad_id=0, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sampler_lib.Sampler(graphdef, eos_ids=(), pad_id=0, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="rows"):
        sampler.prefill(params, fresh_cache(4), prompts([1, 2, 3]))
    with pytest.raises(ValueError, match="Token ids"):
        sampler.prefill(params, fresh_cache(4), [[1], [2], [CFG.vocab_size], [3]])
    state = sampler.prefill(params, fresh_cache(4), prompts([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="fork rows"):
        sampler.fork(state, [0, 4])
    with pytest.raises(ValueError, match="rng"):
        sampler.generate(params, state, keys(0, 1))
