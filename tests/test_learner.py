"""Losses and the jitted update step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import micro_model

from bpo_jax import learner


def _setup(vocab=64):
    return micro_model(vocab)


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


def _updater_setting(**train):
    from pathlib import Path

    from bpo_jax.config import validate
    from bpo_jax.experiment import load_experiment

    root = Path(__file__).resolve().parents[1]
    cfg = load_experiment(root / "experiments" / "alfworld.py").get_config("cpu")
    cfg.sampler.length_bucket = 8
    cfg.train.lr = 1e-3
    for k, v in train.items():
        cfg.train[k] = v
    return validate(cfg)


def _examples(n=24, signal=(1, 5, 6, 13, 22), seed=0):
    """`n` sequences of 7-30 tokens, a nonzero advantage only at the indices in `signal`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(7, 31))
        adv = float(rng.normal()) if i in signal else 0.0
        weight = 0.0 if i == 5 else float(rng.uniform(0.2, 1.5))  # One dead row with signal.
        tokens = rng.integers(1, 64, size=length).tolist()
        out.append(learner.Example(tokens, int(rng.integers(2, length - 2)), adv, weight))
    return out


def _run_update(cfg, graphdef, params, examples):
    updater = learner.RLUpdater(graphdef, cfg, 0, lambda *_: None)
    params = jax.tree.map(jnp.array, params)  # The update donates its state.
    state = learner.TrainState(
        params=params, opt_state=updater.optimizer.init(params), step=jnp.zeros((), jnp.int32)
    )
    return updater, *updater.update(state, examples, seed=(0, 0, 1))


@pytest.mark.parametrize(
    "loss_agg, microbatch, epochs",
    [("token_mean", 2, 2), ("seq_mean", 0, 1)],
)
def test_update_without_zero_advantage_rows_takes_the_same_steps(loss_agg, microbatch, epochs):
    """Leaving out the rows with A = 0 changes no step: the same parameters, step count, losses
    and gradient norms, including the minibatches that hold no row with A != 0."""
    _, graphdef, params = _setup()
    examples = _examples()
    runs = {}
    for skip in (False, True):
        cfg = _updater_setting(
            loss_agg=loss_agg,
            microbatch_size=microbatch,
            epochs=epochs,
            minibatch_size=4,
            skip_zero_advantage=skip,
        )
        runs[skip] = _run_update(cfg, graphdef, params, examples)
    (full, state_full, hist_full), (part, state_part, hist_part) = runs[False], runs[True]
    assert not full.skip_zero_rows and part.skip_zero_rows
    assert int(state_part.step) == int(state_full.step) == epochs * 6
    zero_steps = [h for h in hist_part if "entropy" not in h]
    assert len(zero_steps) >= 2 * epochs  # 6 minibatches, at most 4 of them with signal.
    assert all(h["grad_norm"] == 0 for h in zero_steps)
    for key in ("loss", "pg_loss", "grad_norm"):
        np.testing.assert_allclose(
            [h[key] for h in hist_part], [h[key] for h in hist_full], rtol=2e-5, atol=1e-8
        )
    assert max(h["grad_norm"] for h in hist_full) > 0
    # Float rounding of the gradients, through Adam's normalisation over 6-12 steps of 1e-3:
    # 2e-6 at most here; a wrong scale or a dropped step moves parameters by about 1e-3.
    for a, b in zip(jax.tree.leaves(state_part.params), jax.tree.leaves(state_full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)
    moved = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(state_full.params), jax.tree.leaves(params))
    )
    assert moved > 1e-4  # The comparison is between updates that did something.


def test_update_keeps_zero_advantage_rows_under_a_kl_term():
    _, graphdef, _ = _setup()
    cfg = _updater_setting(kl_coef=0.1, skip_zero_advantage=True)
    assert not learner.RLUpdater(graphdef, cfg, 0, lambda *_: None).skip_zero_rows


def test_host_loss_denominator_matches_the_padded_batch():
    examples = _examples(n=7, signal=range(7))
    for agg in learner.LOSS_AGGS:
        batch = learner.pad_batch(
            [e.tokens for e in examples],
            [e.action_start for e in examples],
            batch_size=8,
            length=32,
            pad_id=0,
            weights=[e.weight for e in examples],
        )
        want = float(learner.loss_denominator(batch, agg))
        np.testing.assert_allclose(learner.loss_denominator_of(examples, agg), want, rtol=1e-6)


def test_row_buckets():
    assert [learner.row_bucket(n, 64) for n in (1, 3, 8, 9, 17, 33, 64)] == [
        8,
        8,
        8,
        16,
        32,
        64,
        64,
    ]
    assert learner.row_bucket(40, 48) == 48  # Never past the minibatch.
    assert learner.row_bucket(3, 64, unit=16) == 16  # A multiple of the devices.
    assert learner.row_bucket(3, 4) == 4


_SHARDED_UPDATE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from flax import nnx
sys.path.insert(0, "tests")
from test_learner import _examples, _updater_setting
from bpo_jax import learner
from bpo_jax.models import config, factory, sharding

mcfg = config.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=2, max_seq_len=64)
mesh = sharding.make_mesh((2, 2, 2))
graphdef, params = nnx.split(factory.create_model(mcfg, mesh=mesh, seed=0))
examples = _examples(n=40, signal=(1, 5, 6, 13, 22, 30, 31))
out = {}
for skip in (False, True):
    cfg = _updater_setting(minibatch_size=8, skip_zero_advantage=skip)
    with jax.set_mesh(mesh):
        updater = learner.RLUpdater(graphdef, cfg, 0, lambda *_: None, params=params)
        p = jax.tree.map(jnp.copy, params)
        state = learner.TrainState(p, updater.optimizer.init(p), jnp.zeros((), jnp.int32))
        state, hist = updater.update(state, examples, seed=(0, 0, 1))
    out[skip] = (state, hist, updater.row_unit)
(a, ha, _), (b, hb, unit) = out[False], out[True]
diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a.params),
                                                        jax.tree.leaves(b.params)))
print("RESULT " + json.dumps({
    "diff": diff, "unit": unit, "steps": [int(a.step), int(b.step)],
    "zero_steps": sum("entropy" not in h for h in hb),
    "grad_norms": [[h["grad_norm"] for h in ha], [h["grad_norm"] for h in hb]],
    "devices": len(jax.tree.leaves(b.params)[0].sharding.device_set)}))
"""


def test_update_without_zero_advantage_rows_on_a_mesh():
    """The same on 8 CPU devices (data 2 x fsdp 2 x tensor 2): rows pad to multiples of the 4
    devices they split over, the loss scale goes in as a replicated scalar."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_UPDATE],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    assert out["devices"] == 8 and out["unit"] == 4
    assert out["steps"] == [5, 5] and out["zero_steps"] >= 1
    np.testing.assert_allclose(out["grad_norms"][1], out["grad_norms"][0], rtol=2e-5, atol=1e-8)
    assert out["diff"] < 2e-5
