"""Qwen3: parity with transformers' Qwen3ForCausalLM, and the presets' sizes.

Small random Qwen3 models (per-head q/k RMSNorm before RoPE, no q/k/v bias, head_dim 16 !=
hidden_size / num_heads, tied and untied embeddings) are saved with `save_pretrained` and loaded
with `load_hf_checkpoint`; logits must match at 1e-4 in float32, through a whole forward pass
and through the KV cache. The presets' parameter counts equal those of transformers' Qwen3 at
the checkpoints' config numbers (built on the meta device: no memory).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from test_hf_parity import _QWEN2, ATOL, BATCH, LENGTH, _forward, _hf_logits, check_cached_decoding

from bpo_jax.models import config, hf_import
from bpo_jax.models.factory import abstract_model
from bpo_jax.models.llama import count_params

# The Qwen2 parity sizes, with head_dim 16: not hidden_size / heads, so read from the config, as
# for Qwen3-0.6B and 4B.
_SMALL = dict(_QWEN2, head_dim=16, rope_theta=10_000.0)
CASES = {"qwen3_tied": True, "qwen3_untied": False}

# The HF checkpoints' config.json numbers (Qwen/Qwen3-*): (hidden, intermediate, layers,
# heads, kv heads, tied).
CHECKPOINTS = {
    "qwen3_8b": (4096, 12_288, 36, 32, 8, False),
    "qwen3_4b": (2560, 9728, 36, 32, 8, True),
    "qwen3_1_7b": (2048, 6144, 28, 16, 8, True),
    "qwen3_0_6b": (1024, 3072, 28, 16, 8, True),
}


def _hf_qwen3(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen3Config(
        attn_implementation="eager", tie_word_embeddings=tied, **_SMALL
    )
    model = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
    # Norms (q_norm and k_norm included) away from 1, so that a norm mapped to the wrong place,
    # or skipped, changes the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 128, (BATCH, LENGTH)).astype(np.int32)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, tokens):
    """(name, HF model, our config, our model, HF logits)."""
    hf = _hf_qwen3(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    cfg, model = hf_import.load_hf_checkpoint(path)
    return request.param, hf, cfg, model, _hf_logits(hf, tokens)


def test_logits_match_hf(case, tokens):
    _, _, cfg, model, want = case
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.resolved_head_dim == 16
    got, _ = _forward(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def test_the_norms_matter(case, tokens):
    """Without q_norm / k_norm the same weights give other logits: the test above checks them."""
    _, _, cfg, model, want = case
    model = nnx.clone(model)  # The module's other tests share the loaded model.
    norm = model.layers[0].self_attn.q_norm.weight
    norm[...] = jnp.ones_like(norm[...])
    got, _ = _forward(model, jnp.asarray(tokens))
    assert np.abs(np.asarray(got) - want).max() > 100 * ATOL


@pytest.mark.parametrize("case", ["qwen3_untied"], indirect=True)
def test_cached_decoding_matches_hf(case, tokens):
    _, _, cfg, model, want = case
    check_cached_decoding(cfg, model, tokens, want)


def test_export_inverts_import(case):
    name, hf, _, model, _ = case
    exported = hf_import.export_hf_state_dict(model)
    reference = {k: v.numpy() for k, v in hf.state_dict().items()}
    if name == "qwen3_tied":
        reference.pop("lm_head.weight")
    assert sorted(exported) == sorted(reference)
    for key, value in exported.items():
        np.testing.assert_array_equal(value, reference[key], err_msg=key)


def test_attention_bias_is_refused():
    hf = transformers.Qwen3Config(attention_bias=True, **_SMALL).to_dict()
    with pytest.raises(ValueError, match="attention_bias"):
        hf_import.config_from_hf(hf)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_preset_matches_hf_checkpoint_config(name):
    d, f, layers, h, k, tied = CHECKPOINTS[name]
    cfg = config.get_preset(name)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (d, f, layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings) == (h, k, tied)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.resolved_head_dim == 128
    assert cfg.vocab_size == 151_936 and cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    hf_cfg = transformers.Qwen3Config(
        vocab_size=151_936,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=h,
        num_key_value_heads=k,
        head_dim=128,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    want = sum(p.numel() for p in hf.parameters())  # Tied: the shared matrix counted once.
    got = count_params(nnx.state(abstract_model(cfg), nnx.Param))
    assert got == want
    count = int(config.PRESETS[name].__doc__.split(": ")[1].split(" ")[0].replace(",", ""))
    assert count == want, f"{name}'s docstring says {count:,} parameters, the model has {want:,}"


@pytest.mark.parametrize("experiment", ["alfworld", "webshop", "swebench"])
def test_experiments_take_the_qwen3_variant(experiment):
    from bpo_jax.compile import model_config_of, validate_for_compile
    from bpo_jax.config import validate
    from bpo_jax.experiment import load_experiment

    raw = load_experiment(f"experiments/{experiment}.py").get_config("model=qwen3_8b")
    raw.model.hf_checkpoint = "/path/to/Qwen3-8B"
    assert validate(raw).model.preset == "qwen3_8b"
    raw.model.lora.rank = 16
    mcfg = model_config_of(validate_for_compile(raw))
    assert mcfg.qk_norm and mcfg.num_layers == 36
    # With LoRA the frozen base is stored in the compute dtype (bfloat16), not float32.
    assert mcfg.param_dtype == jnp.bfloat16
