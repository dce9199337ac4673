"""LoRA (`bpo_jax.models.lora`): adapters over a frozen base.

A fresh adapter (B = 0) leaves the model exactly as it was; the adapters' gradient equals
autodiff of a hand-written forward pass whose weights are W + alpha / r * A @ B in the fused
layouts; an update moves the adapters only (the optimizer holds no state for the base); the KL
reference is the base; checkpoints hold the adapters only; adapters are sharded by their logical
axes on a mesh of fake CPU devices; and a short CPU run trains with LoRA.
"""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bpo_jax import learner
from bpo_jax.learner.batch import pad_batch
from bpo_jax.learner.losses import pg_loss
from bpo_jax.models import config, lora
from bpo_jax.models.llama import Transformer, init_cache

CFG = config.tiny(vocab_size=64, num_layers=2)
ROOT = Path(__file__).resolve().parents[1]


LCFG = lora.LoraConfig(4, 8.0)


def _model(lcfg=LCFG, randomize_b=False):
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    base = nnx.clone(model)
    lora.apply_lora(model, lcfg, seed=1)
    if randomize_b:
        graphdef, state = nnx.split(model)
        adapters, rest = lora.split_adapters(state)
        keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(adapters))))
        adapters = jax.tree.map(
            lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
        )
        model = nnx.merge(graphdef, lora.merge(rest, adapters))
    return base, model


TOKENS = jax.random.randint(jax.random.key(3), (2, 40), 1, 64)


def test_fresh_adapters_leave_the_model_exactly_as_it_was():
    base, model = _model()
    want, _ = base(TOKENS)
    got, _ = model(TOKENS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want_scanned, _ = base(TOKENS, scan_layers=True, remat="full")
    got, _ = model(TOKENS, scan_layers=True, remat="full")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_scanned))
    cache = init_cache(CFG, 2, capacity=48)
    got, cache = model(TOKENS[:, :30], cache=cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, :30]), atol=1e-6, rtol=0)


def test_adapter_shapes_axes_and_counts():
    _, model = _model(lora.LoraConfig(4, 8.0, targets=("q", "v", "down")))
    state = nnx.state(model, nnx.LoRAParam)
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    assert sorted(k.split("/", 2)[2] for k in flat if k.startswith("layers/0/")) == [
        "mlp/down_lora_a",
        "mlp/down_lora_b",
        "self_attn/q_lora_a",
        "self_attn/q_lora_b",
        "self_attn/v_lora_a",
        "self_attn/v_lora_b",
    ]
    q_b = flat["layers/0/self_attn/q_lora_b"]
    assert q_b.shape == (4, 2, 2, 32) and q_b.logical_axes == (None, "kv_heads", None, "head_dim")
    assert flat["layers/1/mlp/down_lora_a"].logical_axes == ("mlp", None)
    assert all(v.get_value().dtype == jnp.float32 for v in flat.values())


def _merged_forward(base, adapters, scale, tokens):
    """The base model with each targeted weight replaced by W + scale * A @ B, written out by
    hand in the fused layouts (qkv_proj [D, K, G + 2, E], gate_up_proj [D, 2, F])."""
    graphdef, state = nnx.split(base)
    flat = dict(nnx.to_flat_state(state))
    g = CFG.num_heads // CFG.num_kv_heads
    new = {k: v.get_value() for k, v in flat.items()}
    for i in range(CFG.num_layers):

        def ab(name, i=i):
            a = adapters[f"layers/{i}/{name}_lora_a"]
            b = adapters[f"layers/{i}/{name}_lora_b"]
            return scale * (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1))

        at, mlp = ("layers", i, "self_attn"), ("layers", i, "mlp")
        qkv = new[at + ("qkv_proj",)]
        d, k, _, e = qkv.shape
        qkv = qkv.at[:, :, :g].add(ab("self_attn/q").reshape(d, k, g, e))
        qkv = qkv.at[:, :, g].add(ab("self_attn/k").reshape(d, k, e))
        qkv = qkv.at[:, :, g + 1].add(ab("self_attn/v").reshape(d, k, e))
        new[at + ("qkv_proj",)] = qkv
        new[at + ("o_proj",)] = new[at + ("o_proj",)] + ab("self_attn/o").reshape(
            new[at + ("o_proj",)].shape
        )
        gate_up = new[mlp + ("gate_up_proj",)]
        gate_up = gate_up.at[:, 0].add(ab("mlp/gate")).at[:, 1].add(ab("mlp/up"))
        new[mlp + ("gate_up_proj",)] = gate_up
        new[mlp + ("down_proj",)] = new[mlp + ("down_proj",)] + ab("mlp/down")
    merged = nnx.from_flat_state([(k, flat[k].replace(v)) for k, v in new.items()])
    return nnx.merge(graphdef, merged)(tokens)[0]


def test_gradient_equals_autodiff_of_a_hand_written_low_rank_forward():
    base, model = _model(randomize_b=True)
    graphdef, state = nnx.split(model)
    adapters, rest = lora.split_adapters(state)
    names = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(adapters)]
    scale = 8.0 / 4
    weights = jax.random.normal(jax.random.key(4), (2, 40, 64))

    def loss_adapters(ad):
        logits = nnx.merge(graphdef, lora.merge(rest, ad))(TOKENS, scan_layers=True)[0]
        return jnp.sum(jax.nn.log_softmax(logits) * weights)

    def loss_by_hand(flat_ad):
        logits = _merged_forward(base, dict(zip(names, flat_ad)), scale, TOKENS)
        return jnp.sum(jax.nn.log_softmax(logits) * weights)

    flat_values = [v.get_value() for _, v in nnx.to_flat_state(adapters)]
    np.testing.assert_allclose(
        float(loss_adapters(adapters)), float(loss_by_hand(flat_values)), rtol=1e-5
    )
    got = [v.get_value() for _, v in nnx.to_flat_state(jax.grad(loss_adapters)(adapters))]
    want = jax.grad(loss_by_hand)(flat_values)
    for name, g, w in zip(names, got, want):
        assert float(jnp.abs(w).max()) > 0, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4, err_msg=name)


def _batch(rows=4, length=24):
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(1, 64, length)) for _ in range(rows)]
    return pad_batch(
        seqs,
        [length // 2] * rows,
        batch_size=rows,
        length=length,
        pad_id=0,
        advantages=[1.0, -1.0, 0.5, -0.5],
        weights=[1.0] * rows,
    )


@pytest.mark.parametrize("microbatch", [0, 2])
def test_an_update_changes_the_adapters_only(microbatch):
    _, model = _model(randomize_b=True)
    graphdef, params = nnx.split(model)
    optimizer = learner.make_optimizer(1e-2)
    opt_state = optimizer.init(params)
    adapters, base = lora.split_adapters(params)
    # Adam's two moments of each adapter, none of the base.
    moments = len(jax.tree.leaves(opt_state)) - 1  # Less Adam's step count.
    assert moments == 2 * len(jax.tree.leaves(adapters))

    def loss(fn, p, batch):
        return pg_loss(fn, p, batch, clip_eps=0.2, loss_agg="token_mean")

    step = learner.make_train_step(graphdef, optimizer, loss, microbatch_size=microbatch)
    batch = _batch()
    old_lp, _ = learner.make_logprob_fn(graphdef)(params, batch.tokens)
    batch = dataclasses.replace(batch, old_logprobs=old_lp * batch.loss_mask)
    state = learner.TrainState(params, opt_state, jnp.zeros((), jnp.int32))
    adapters, base = jax.tree.map(np.asarray, (adapters, base))  # The step donates its input.
    new, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) > 0
    assert jax.tree.structure(new.params) == jax.tree.structure(params)
    new_adapters, new_base = lora.split_adapters(new.params)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(new_base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(new_adapters))
    ]
    assert all(changed)


def test_reference_is_the_base_without_a_copy():
    base, model = _model(randomize_b=True)
    graphdef, params = nnx.split(model)
    ref = learner.reference_params(params)
    assert len(jax.tree.leaves(ref)) == len(jax.tree.leaves(lora.split_adapters(params)[0]))
    full = learner.full_reference(params, ref)
    got = nnx.merge(graphdef, full)(TOKENS)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base(TOKENS)[0]))
    # Without LoRA the reference is a copy of the policy, used as it is.
    plain = nnx.state(base)
    assert learner.full_reference(plain, learner.reference_params(plain)) is not plain


def test_config_fields():
    from bpo_jax.config import validate
    from bpo_jax.experiment import load_experiment

    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    assert validate(cfg).model.lora.rank == 0
    cfg.model.lora.rank = 8
    cfg.model.lora.targets = ("q", "v")
    v = validate(cfg)
    assert (v.model.lora.rank, v.model.lora.targets) == (8, ("q", "v"))
    cfg.model.lora.dropout = 0.1
    with pytest.raises(ValueError, match="config.model.lora.dropout must be 0"):
        validate(cfg)


_SHARDED = textwrap.dedent(
    """
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    from flax import nnx
    from bpo_jax.models import config, lora, sharding
    from bpo_jax.models.factory import create_model

    cfg = config.tiny(vocab_size=64, num_layers=2)
    mesh = sharding.make_mesh((2, 2, 2))
    with jax.set_mesh(mesh):
        model = create_model(cfg, mesh=mesh)
        lora.apply_lora(model, lora.LoraConfig(4, 8.0), mesh=mesh)
        out = {}
        for key, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
            if key[1] == 0:
                out["/".join(map(str, key[2:]))] = str(var.get_value().sharding.spec)
        tokens = jax.numpy.ones((4, 16), jax.numpy.int32)
        graphdef, state = nnx.split(model)
        jax.jit(lambda s: nnx.merge(graphdef, s)(tokens, scan_layers=True)[0])(state)
    print("RESULT " + json.dumps(out))
    """
)


def test_adapters_are_sharded_by_their_logical_axes():
    """On a (data 2, fsdp 2, tensor 2) mesh of fake CPU devices: A's input axis as its weight's,
    B's output axes as its weight's, the rank axis unsplit; a scanned forward pass runs."""
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    specs = json.loads(line[0][len("RESULT ") :])
    assert specs["self_attn/q_lora_a"] == "P('fsdp', None)"
    assert specs["self_attn/q_lora_b"] == "P(None, 'tensor', None, None)"
    assert specs["self_attn/o_lora_a"] == "P('tensor', None, None)"
    assert specs["self_attn/o_lora_b"] == "P(None, 'fsdp')"
    assert specs["mlp/gate_lora_b"] == "P(None, 'tensor')"
    assert specs["mlp/down_lora_a"] == "P('tensor', None)"


def test_optimizer_without_lora_is_unchanged():
    base, _ = _model()
    params = nnx.state(base, nnx.Param)
    inner = optax.chain(optax.clip_by_global_norm(float("inf")), optax.adamw(1e-3))
    got = learner.make_optimizer(1e-3).init(params)
    assert jax.tree.structure(got) == jax.tree.structure(inner.init(params))
