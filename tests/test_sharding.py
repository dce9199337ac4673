"""Logical-axis sharding: spec rules, mesh construction, and a sharded model on 8 CPU devices.

The 8-device check runs in a fresh interpreter, because the device count must be set before JAX
initialises and pytest's process has already initialised it with one CPU device.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from helpers import run_script_result
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from bpo_jax.models import sharding

MESH_128 = AbstractMesh((1, 2, 4), sharding.MESH_AXES)

# ----------------------------------------------------------------------------- logical_to_spec


def test_spec_without_shape_follows_rules():
    spec = sharding.logical_to_spec(("embed", "heads", "head_dim"))
    assert spec == PartitionSpec("fsdp", "tensor", None)


def test_mesh_axis_is_used_once():
    # batch takes (data, fsdp); embed also maps to fsdp but may not reuse it.
    spec = sharding.logical_to_spec(("batch", "length", "embed"), (4, 8, 64), MESH_128)
    assert spec == PartitionSpec(("data", "fsdp"), None, None)


def test_indivisible_dimension_is_replicated():
    # 2 KV heads over tensor=4: replicated rather than an invalid sharding.
    spec = sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), MESH_128)
    assert spec == PartitionSpec("fsdp", None, None)
    spec = sharding.logical_to_spec(("vocab", "embed"), (1001, 63), MESH_128)
    assert spec == PartitionSpec(None, None)


def test_manual_axes_neither_split_nor_count():
    """Inside a shard_map over `data` (the sampler's replicas), a replica's 64 rows split
    exactly over fsdp 64: `data` must not count in the divisibility, or the rows are replicated
    over fsdp (what made a 2 x v5litepod-64 prefill ask for 22.99 GiB of temporaries)."""
    mesh = AbstractMesh((2, 64, 1), sharding.MESH_AXES)
    spec = sharding.logical_to_spec(("batch", "length"), (64, 8), mesh, exclude={"data"})
    assert spec == PartitionSpec("fsdp", None)
    # Counting `data`, 64 rows do not divide data x fsdp = 128: fsdp would be dropped.
    assert sharding.logical_to_spec(("batch", "length"), (64, 8), mesh) == PartitionSpec(
        "data", None
    )


def test_partly_divisible_dimension_keeps_the_axes_that_divide():
    # A batch of 3 divides data=1 but not data*fsdp=2.
    spec = sharding.logical_to_spec(("batch", None), (3, 5), MESH_128)
    assert spec == PartitionSpec("data", None)


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(ValueError, match="'experts' has no sharding rule"):
        sharding.logical_to_spec(("embed", "experts"))


def test_custom_rules_by_argument_and_context():
    rules = (("embed", None), ("mlp", ("fsdp", "tensor")))
    spec = sharding.logical_to_spec(("embed", "mlp"), (64, 128), MESH_128, rules=rules)
    assert spec == PartitionSpec(None, ("fsdp", "tensor"))
    with sharding.axis_rules([("embed", "tensor"), ("mlp", ["data", "fsdp"])]):
        spec = sharding.logical_to_spec(("embed", "mlp"))
    assert spec == PartitionSpec("tensor", ("data", "fsdp"))
    assert sharding.current_rules() == sharding.DEFAULT_RULES


def test_config_rules_are_the_one_table_and_can_be_overridden():
    """Every experiment's `mesh.rules` is `DEFAULT_RULES`, loaded without importing JAX; a
    config that overrides the field gets its own rules through `axis_rules`."""
    script = textwrap.dedent(
        """
        import json, sys
        from bpo_jax.experiment import load_experiment
        out = {}
        for name in ("alfworld", "webshop", "swebench"):
            c = load_experiment(f"experiments/{name}.py").get_config("cpu")
            out[name] = [list(r) if isinstance(r, tuple) else r for r in c.mesh.rules]
        out["jax_imported"] = "jax" in sys.modules
        print(json.dumps(out))
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, env=env
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("jax_imported") is False
    default = json.loads(json.dumps(sharding.DEFAULT_RULES))
    assert out == dict.fromkeys(("alfworld", "webshop", "swebench"), default)

    from bpo_jax.experiment import load_experiment

    c = load_experiment(os.path.join(root, "experiments", "alfworld.py")).get_config("cpu")
    assert c.mesh.rules is sharding.DEFAULT_RULES
    c.mesh.rules = tuple((k, "tensor" if k == "embed" else v) for k, v in c.mesh.rules)
    with sharding.axis_rules(c.mesh.rules):
        assert sharding.logical_to_spec(("embed", "mlp")) == PartitionSpec("tensor", None)


def test_constrain_is_identity_outside_a_mesh():
    x = jax.numpy.ones((2, 3))
    assert sharding.constrain(x, ("batch", "embed")) is x


# ----------------------------------------------------------------------------- make_mesh


def test_make_mesh_axes_are_auto():
    mesh = sharding.make_mesh({"data": -1})
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
    "shape, match",
    [
        ({"model": 1}, "Unknown mesh axes"),
        ((1, 1), "must have 3 entries"),
        ((-1, -1, 1), "At most one mesh axis may be -1"),
        ((1, 2, 1), "needs 2 devices"),
        ((2, -1, 1), "cannot be split"),
    ],
)
def test_make_mesh_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(shape, devices=jax.devices()[:1])


# ----------------------------------------------------------------------------- 8 CPU devices

_SHARDED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile

    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from bpo_jax.models import config, factory, hf_import, llama, sharding

    assert len(jax.devices()) == 8, jax.devices()
    cfg = config.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=4, tie_embeddings=False)
    mesh = sharding.make_mesh((1, 2, 4))
    model = factory.create_model(cfg, mesh=mesh, seed=0)

    def layout(x):
        return {"devices": len(x.sharding.device_set), "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape), "spec": str(x.sharding.spec)}

    def max_diff(a, b):
        diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))),
                             nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))
        return max(jax.tree.leaves(diffs))

    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    out = {"layouts": {
        "qkv_proj": layout(attn.qkv_proj[...]), "o_proj": layout(attn.o_proj[...]),
        "gate_up_proj": layout(mlp.gate_up_proj[...]), "down_proj": layout(mlp.down_proj[...]),
        "embed_tokens": layout(model.embed_tokens[...]), "lm_head": layout(model.lm_head[...]),
    }}

    # 2 KV heads do not divide tensor=4: qkv_proj's heads are replicated, its embed still sharded.
    _, abstract_state = nnx.split(factory.abstract_model(cfg.replace(num_kv_heads=2)))
    specs = factory.param_specs(abstract_state, mesh)
    out["kv2_qkv_proj_spec"] = str(specs["layers"][0]["self_attn"]["qkv_proj"].get_value().spec)

    # The same seed without a mesh gives the same parameters.
    plain = factory.create_model(cfg, seed=0)
    out["init_diff"] = max_diff(plain, model)

    # Reference: the very same parameter values, gathered onto one device.
    graphdef, state = nnx.split(model)
    one = jax.devices()[0]
    reference = nnx.merge(graphdef, jax.tree.map(lambda x: jax.device_put(x, one), state))
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    forward = nnx.jit(lambda m, t: m(t)[0])
    want = np.asarray(forward(reference, tokens))

    with jax.set_mesh(mesh):
        got = forward(model, tokens)
    out["logits_devices"] = len(got.sharding.device_set)
    out["forward_diff"] = float(np.max(np.abs(np.asarray(got) - want)))

    # Cached path under the mesh: prefill 10 tokens, then decode the rest one at a time.
    @nnx.jit
    def step(m, t, cache):
        return m(t, cache=cache)

    with jax.set_mesh(mesh):
        cache = llama.init_cache(cfg, 4, capacity=16)
        pieces = []
        logits, cache = step(model, tokens[:, :10], cache)
        pieces.append(np.asarray(logits))
        for i in range(10, 16):
            logits, cache = step(model, tokens[:, i:i + 1], cache)
            pieces.append(np.asarray(logits))
    out["cache_diff"] = float(np.max(np.abs(np.concatenate(pieces, axis=1) - want)))

    # A Hugging Face checkpoint loads sharded on arrival, with the same values.
    with tempfile.TemporaryDirectory() as tmp:
        save_file(hf_import.export_hf_state_dict(model), os.path.join(tmp, "model.safetensors"))
        hf_config = {
            "model_type": "qwen2", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": False, "max_position_embeddings": 64, "dtype": "float32"}
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_config, fh)
        _, loaded = hf_import.load_hf_checkpoint(tmp, mesh=mesh)
    qkv = loaded.layers[0].self_attn.qkv_proj[...]
    out["loaded_qkv_proj"] = layout(qkv)
    out["load_diff"] = max_diff(loaded, model)
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sharded_run():
    return run_script_result(_SHARDED_SCRIPT, timeout=300)


def test_parameters_are_created_sharded(sharded_run):
    layouts = sharded_run["layouts"]
    expected_shards = {
        "qkv_proj": [32, 1, 3, 16],  # [D, K, G + 2, E] over (fsdp, tensor, -, -)
        "o_proj": [1, 16, 32],  # [H, E, D] over (tensor, -, fsdp)
        "gate_up_proj": [32, 2, 32],  # [D, 2, F] over (fsdp, -, tensor)
        "down_proj": [32, 32],  # [F, D] over (tensor, fsdp)
        "embed_tokens": [64, 32],  # [V, D] over (tensor, fsdp)
        "lm_head": [32, 64],  # [D, V] over (fsdp, tensor)
    }
    for name, shard in expected_shards.items():
        layout = layouts[name]
        assert layout["devices"] == 8, (name, layout)
        assert layout["shard"] == shard, (name, layout)
        assert layout["shard"] != layout["shape"], (name, layout)


def test_indivisible_heads_are_replicated(sharded_run):
    assert sharded_run["kv2_qkv_proj_spec"] == str(PartitionSpec("fsdp", None, None, None))


def test_sharded_init_matches_unsharded_init(sharded_run):
    assert sharded_run["init_diff"] < 1e-6


def test_sharded_forward_matches_single_device(sharded_run):
    assert sharded_run["logits_devices"] == 8
    assert sharded_run["forward_diff"] < 1e-5


def test_sharded_cached_decode_matches_single_device(sharded_run):
    assert sharded_run["cache_diff"] < 1e-5


def test_checkpoint_loads_sharded(sharded_run):
    assert sharded_run["loaded_qkv_proj"]["devices"] == 8
    assert sharded_run["loaded_qkv_proj"]["shard"] == [32, 1, 3, 16]
    assert sharded_run["loaded_qkv_proj"]["spec"] == sharded_run["layouts"]["qkv_proj"]["spec"]
    assert sharded_run["load_diff"] == 0.0


def test_update_rows_that_do_not_split_over_the_batch_devices_warn(caplog):
    from types import SimpleNamespace

    from bpo_jax.learner.host import warn_if_rows_replicated
    from bpo_jax.models.axes import DEFAULT_RULES

    cfg = SimpleNamespace(mesh=SimpleNamespace(rules=DEFAULT_RULES))
    mesh = AbstractMesh((2, 64, 1), sharding.MESH_AXES)
    with caplog.at_level("WARNING"):
        assert warn_if_rows_replicated(64, mesh, cfg)
        assert "Use a multiple of 128" in caplog.text
        assert not warn_if_rows_replicated(128, mesh, cfg)
