"""Losses and the jitted update step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bpo_jax import learner
from bpo_jax.models.config import tiny
from bpo_jax.models.llama import Transformer


def _setup(vocab=64):
    cfg = tiny(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_seq_len=64,
    )
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


def test_pad_batch_masks_actions_only():
    b = learner.pad_batch(
        [[5, 6, 7, 8], [5, 9]], [2, 1], batch_size=3, length=6, pad_id=0, advantages=[1.5, -2.0]
    )
    np.testing.assert_array_equal(
        b.loss_mask, [[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(b.advantages[0], [0, 0, 1.5, 1.5, 0, 0])
    np.testing.assert_array_equal(b.weights, [1, 1, 0])
    with pytest.raises(ValueError, match="more than the batch length"):
        learner.pad_batch([[1] * 7], [1], batch_size=1, length=6, pad_id=0)


def test_token_logprobs_match_manual_softmax():
    _, graphdef, params = _setup()
    tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 64)
    logp, ent = learner.make_logprob_fn(graphdef)(params, tokens)
    logits, _ = nnx.merge(graphdef, params)(tokens)
    ref = jax.nn.log_softmax(logits, -1)
    want = jnp.take_along_axis(ref[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(logp[:, 1:], want, atol=1e-5)
    assert np.all(logp[:, 0] == 0)
    assert np.all(ent[:, 1:] > 0) and np.all(ent <= np.log(64) + 1e-4)


def test_pg_loss_at_ratio_one_is_minus_mean_advantage_weighted_logprob_gradient():
    """At old == current log-probs the clipped surrogate's gradient is the vanilla PG."""
    _, graphdef, params = _setup()
    fn = learner.make_model_fn(graphdef)
    seqs = [[3, 4, 5, 6, 7], [3, 4, 8, 9]]
    batch = learner.pad_batch(
        seqs, [2, 2], batch_size=2, length=8, pad_id=0, advantages=[1.0, -0.5]
    )
    old, _ = learner.token_logprobs(fn, params, jnp.asarray(batch.tokens))
    batch = learner.Batch(
        batch.tokens,
        batch.loss_mask,
        batch.advantages,
        np.asarray(old) * batch.loss_mask,
        batch.weights,
    )
    g_pg = jax.grad(
        lambda p: learner.pg_loss(fn, p, batch, clip_eps=0.2, loss_agg="token_mean")[0]
    )(params)

    def vanilla(p):
        lp, _ = learner.token_logprobs(fn, p, jnp.asarray(batch.tokens))
        return -jnp.sum(lp * batch.advantages * batch.loss_mask) / jnp.sum(batch.loss_mask)

    g_ref = jax.grad(vanilla)(params)
    for a, b in zip(jax.tree.leaves(g_pg), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_pg_loss_clips_large_ratios():
    _, graphdef, params = _setup()
    fn = learner.make_model_fn(graphdef)
    batch = learner.pad_batch(
        [[3, 4, 5, 6]], [2], batch_size=1, length=4, pad_id=0, advantages=[1.0]
    )
    cur, _ = learner.token_logprobs(fn, params, jnp.asarray(batch.tokens))
    # Old policy much less likely -> ratio >> 1 + eps -> clipped, no gradient for A > 0.
    batch = learner.Batch(
        batch.tokens,
        batch.loss_mask,
        batch.advantages,
        (np.asarray(cur) - 2.0) * batch.loss_mask,
        batch.weights,
    )
    loss, m = learner.pg_loss(fn, params, batch, clip_eps=0.2, loss_agg="token_mean")
    assert float(m["clip_frac"]) == 1.0
    np.testing.assert_allclose(float(loss), -1.2, rtol=1e-6)
    g = jax.grad(lambda p: learner.pg_loss(fn, p, batch, clip_eps=0.2, loss_agg="token_mean")[0])(
        params
    )
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) == 0.0


def test_train_step_reduces_bc_loss_and_reports_grad_norm():
    _, graphdef, params = _setup()
    opt = learner.make_optimizer(1e-2, grad_clip=1.0)
    state = learner.TrainState(
        params=params, opt_state=opt.init(params), step=jnp.zeros((), jnp.int32)
    )
    step = learner.make_train_step(graphdef, opt, learner.bc_loss)
    batch = learner.pad_batch([[3, 4, 5, 6, 7, 2]] * 4, [3] * 4, batch_size=4, length=8, pad_id=0)
    losses = []
    for _ in range(20):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        assert np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0
    assert losses[-1] < 0.5 * losses[0]
    assert int(state.step) == 20
