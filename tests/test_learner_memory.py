"""The update's memory savers change no numbers: chunked log-probs, remat, gradient
accumulation, and the explicit optimizer-state shardings; and the replication check."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import micro_model

from bpo_jax import learner
from bpo_jax.models import sharding
from bpo_jax.models.llama import REMAT_POLICIES


def _setup(vocab=96, tie=True):
    _, graphdef, params = micro_model(vocab, tie_embeddings=tie)
    return graphdef, params


def _whole_logits_fn(graphdef):
    """The reference scorer: the model's full [B, L, V] logits, as the learner had it."""

    def fn(params, tokens):
        return nnx.merge(graphdef, params)(tokens)

    return fn


@pytest.mark.parametrize("chunk", [0, 5, 8, 64])
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_logprobs_match_full_logits_values_and_gradients(chunk, tie):
    graphdef, params = _setup(tie=tie)
    tokens = jax.random.randint(jax.random.key(1), (3, 23), 0, 96)
    ref_fn = _whole_logits_fn(graphdef)
    fn = learner.make_model_fn(graphdef, logits_chunk=chunk)
    want = learner.token_logprobs(ref_fn, params, tokens, 0.7)
    got = learner.token_logprobs(fn, params, tokens, 0.7)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)

    def objective(score_fn):
        def f(p):
            logp, ent = learner.token_logprobs(score_fn, p, tokens, 0.7)
            # A mean over the tokens, as the losses take (so gradients are O(1)).
            return jnp.mean(logp * jnp.linspace(-1, 1, 23)) + jnp.mean(ent)

        return jax.grad(f)(params)

    for a, b in zip(jax.tree.leaves(objective(ref_fn)), jax.tree.leaves(objective(fn))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_chunked_logprobs_keep_no_full_logits():
    """Neither the forward nor the backward pass of a chunked score holds [B, L, V] floats."""
    graphdef, params = _setup(vocab=4096)
    tokens = jnp.zeros((2, 257), jnp.int32)
    full_bytes = 2 * 256 * 4096 * 4

    def temp_bytes(chunk, grad):
        fn = learner.make_model_fn(graphdef, logits_chunk=chunk)

        def loss(p):
            return jnp.sum(learner.token_logprobs(fn, p, tokens)[0])

        compiled = jax.jit(jax.grad(loss) if grad else loss).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # Whole: the forward pass holds the logits, the backward pass several copies of them.
    assert temp_bytes(0, grad=False) >= full_bytes
    assert temp_bytes(32, grad=False) < full_bytes / 2
    assert temp_bytes(32, grad=True) < temp_bytes(0, grad=True) - 3 * full_bytes


@pytest.mark.parametrize("remat", sorted(REMAT_POLICIES))
def test_remat_policies_give_the_same_gradients(remat):
    graphdef, params = _setup()
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 96)

    def grads(policy):
        fn = learner.make_model_fn(graphdef, remat=policy)
        return jax.grad(lambda p: jnp.sum(learner.token_logprobs(fn, p, tokens)[0]))(params)

    for a, b in zip(jax.tree.leaves(grads("none")), jax.tree.leaves(grads(remat))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    with pytest.raises(ValueError, match="Unknown remat policy"):
        learner.make_model_fn(graphdef, remat="some")


def _pg_batch(rng, rows=8, length=12):
    tokens = rng.integers(1, 96, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.float32)
    for r in range(rows):
        start, stop = rng.integers(2, 6), rng.integers(6, length + 1)
        mask[r, start:stop] = 1
    weights = rng.uniform(0.2, 2.0, rows).astype(np.float32)
    weights[-1] = 0.0  # a padding row
    adv = (rng.normal(size=(rows, 1)) * mask).astype(np.float32)
    old = (rng.normal(size=(rows, length)) * 0.1 - 4.0).astype(np.float32) * mask
    return learner.Batch(tokens, mask, adv, old, weights)


@pytest.mark.parametrize(
    "loss_agg, kl",
    [
        ("token_mean", False),
        pytest.param("seq_mean", False, marks=pytest.mark.slow),
        pytest.param("token_mean", True, marks=pytest.mark.slow),
    ],
)
def test_gradient_accumulation_equals_the_whole_minibatch(loss_agg, kl):
    graphdef, params = _setup()
    batch = _pg_batch(np.random.default_rng(0))
    extra = (jnp.asarray(batch.old_logprobs - 0.05),) if kl else ()
    # Plain SGD: the parameters then differ by the gradients' difference (Adam's first step,
    # about lr * sign(g), would blow a rounding difference of a near-zero gradient up to lr).
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))

    def loss(fn, p, b, ref=None):
        return learner.pg_loss(
            fn, p, b, clip_eps=0.2, loss_agg=loss_agg, kl_coef=0.1 if kl else 0.0, ref_logprobs=ref
        )

    def run(microbatch, remat="none", chunk=0, scan=False):
        state = learner.TrainState(
            params=jax.tree.map(jnp.copy, params),
            opt_state=opt.init(params),
            step=jnp.zeros((), jnp.int32),
        )
        step = learner.make_train_step(
            graphdef,
            opt,
            loss,
            microbatch_size=microbatch,
            loss_agg=loss_agg,
            remat=remat,
            logits_chunk=chunk,
            scan_layers=scan,
        )
        return step(state, batch, *extra)

    ref_state, ref_m = run(0)
    cases = [(2, "none", 0, False), (4, "full", 5, True), (1, "dots_saveable", 0, False)]
    for microbatch, remat, chunk, scan in cases:
        state, m = run(microbatch, remat, chunk, scan)
        for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
        for key in ("loss", "grad_norm", "param_norm"):
            np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must divide"):
        run(3)


_SHARDED_SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from flax import nnx
    from bpo_jax import learner
    from bpo_jax.models import config, factory, sharding

    cfg = config.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=4, tie_embeddings=False)
    mesh = sharding.make_mesh((1, 4, 2))
    graphdef, params = nnx.split(factory.create_model(cfg, mesh=mesh, seed=0))
    opt = learner.make_optimizer(1e-3, grad_clip=1.0)
    specs = jax.tree.map(lambda x: x.sharding, params)
    sh = learner.state_shardings(opt, params, specs)
    mu = sh.opt_state[1][0].mu
    out = {
        "mu_down": str(mu["layers"][0]["mlp"]["down_proj"].get_value().spec),
        "param_down": str(params["layers"][0]["mlp"]["down_proj"].get_value().sharding.spec),
        "count": str(sh.opt_state[1][0].count.spec),
    }
    with jax.set_mesh(mesh):
        state = learner.TrainState(params, opt.init(params), jnp.zeros((), jnp.int32))
        step = learner.make_train_step(graphdef, opt, learner.bc_loss, microbatch_size=4,
                                       shardings=sh, remat="full", logits_chunk=8)
        batch = learner.pad_batch([[3, 4, 5, 6, 7, 2]] * 8, [3] * 8, batch_size=8, length=16,
                                  pad_id=0)
        state, m = step(state, batch)
    new_mu = state.opt_state[1][0].mu["layers"][0]["mlp"]["down_proj"].get_value()
    out["stepped_mu_down"] = str(new_mu.sharding.spec)
    out["loss"] = float(m["loss"])
    sharding.check_replication(params)
    rules = tuple((k, None if k == "mlp" else v) for k, v in sharding.DEFAULT_RULES)
    with sharding.axis_rules(rules):
        bad = factory.create_model(cfg, mesh=mesh, seed=0)
    try:
        sharding.check_replication(nnx.state(bad))
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    print(json.dumps(out))
    """
)


def test_optimizer_state_is_sharded_like_the_parameters_and_replication_is_checked():
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mu_down"] == out["param_down"] == out["stepped_mu_down"]
    assert out["mu_down"] != "P()"
    assert out["count"] == "P()"
    assert np.isfinite(out["loss"])
    # Unsplit MLP weights on a mesh with tensor=2: the check names them.
    assert out["error"] is not None and "gate_up_proj" in out["error"]


def test_replicated_bytes_counts_what_the_mesh_could_split():
    mesh = jax.sharding.AbstractMesh((1, 4, 2), sharding.MESH_AXES)
    p = jax.sharding.PartitionSpec

    def leaf(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=jax.NamedSharding(mesh, spec))

    params = {
        "full": leaf((8, 8), p("fsdp", "tensor")),
        "half": leaf((8, 8), p("fsdp", None)),
        "none": leaf((4,), p()),
    }
    total, worst = sharding.replicated_bytes(params)
    assert total == (64 + 64 + 4) * 4
    assert dict(worst) == {"['half']": 64 * 4 // 2, "['none']": 16 - 16 // 8}
    with pytest.raises(ValueError, match=r"\['half'\]"):
        sharding.check_replication(params)
    sharding.check_replication(params, max_fraction=0.5)
