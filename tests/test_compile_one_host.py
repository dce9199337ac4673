"""One-host slices (v5litepod-8, v4-8, v6e-8) for 7B/8B RL: what LoRA keeps resident.

The fast tests build the update's train state abstractly (`jax.eval_shape`, no memory): with
`model.lora.rank > 0` the base is stored in the compute dtype, the optimizer holds Adam moments
of the adapters only, and the resident state of Qwen2.5-7B drops from about 91 GB (float32
weights and two float32 moments) to about 15 GB. The `full_compile` tests compile the ALFWorld
update, prefill and decode with LoRA for the one-host slices (minutes each).
"""

import math

import jax
import jax.numpy as jnp
import pytest
from libtpu_fixtures import require_libtpu

from bpo_jax import compile as compile_tool
from bpo_jax.compile.programs import abstract_train_state, bytes_per_chip, model_config_of
from bpo_jax.experiment import load_experiment
from bpo_jax.models import sharding
from bpo_jax.models.lora import TARGETS, adapter_shapes


def _cfg(model: str, rank: int):
    raw = load_experiment("experiments/alfworld.py").get_config(f"model={model}")
    raw.model.lora.rank = rank
    return compile_tool.validate_for_compile(raw)


def _state(model: str, rank: int):
    cfg = _cfg(model, rank)
    mcfg = model_config_of(cfg)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    with jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        return mcfg, abstract_train_state(cfg, mcfg, mesh)[1]


@pytest.mark.parametrize("model", ["qwen2_5_7b", "qwen3_8b"])
def test_lora_state_holds_adam_moments_of_the_adapters_only(model):
    mcfg, full = _state(model, 0)
    _, lo = _state(model, 16)
    n_base = sum(x.size for x in jax.tree.leaves(full.params))
    sizes = [adapter_shapes(mcfg, t, 16) for t in TARGETS]
    n_adapters = mcfg.num_layers * sum(
        math.prod(a_shape) + math.prod(b_shape) for (a_shape, _), (b_shape, _) in sizes
    )
    lo_params = jax.tree.leaves(lo.params)
    assert sum(x.size for x in lo_params) == n_base + n_adapters
    # The base in bfloat16, the adapters in float32.
    assert {x.dtype for x in lo_params} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(lo.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapters
    full_bytes, lora_bytes = bytes_per_chip(full), bytes_per_chip(lo)
    assert full_bytes == pytest.approx(12 * n_base, rel=1e-6)  # float32 weights, mu and nu.
    assert lora_bytes == pytest.approx(2 * n_base + 12 * n_adapters, rel=1e-6)
    assert lora_bytes < full_bytes / 5


@pytest.mark.slow
@pytest.mark.full_compile  # Deselected by default (pyproject addopts): -m full_compile runs it.
@pytest.mark.parametrize(
    "model,topology",
    [("qwen3_8b", "v5litepod-8"), ("qwen2_5_7b", "v5litepod-8"), ("llama3_1_8b", "v6e-8")],
)
def test_lora_fits_one_host(model, topology):
    """ALFWorld with LoRA rank 16 at the paper's rows and lengths: update, prefill and decode
    fit a one-host slice (python -m bpo_jax.compile ... --config.model.lora.rank=16)."""
    require_libtpu()
    report = compile_tool.compile_report(_cfg(model, 16), topology)
    print(compile_tool.format_report(report))
    assert set(report["programs"]) == {"update", "prefill", "decode"}
    for name, p in report["programs"].items():
        assert p["fits"], (name, p.get("error"), p["total_bytes"], p["temp_bytes"])
