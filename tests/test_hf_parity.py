"""Parity with Hugging Face transformers: checkpoints saved by HF load into identical models.

Small random Qwen2 (q/k/v biases, tied and untied embeddings) and Llama (grouped-query
attention, explicit head_dim, Llama-3.1 RoPE scaling that moves every frequency) models are
saved with `save_pretrained` and loaded with `load_hf_checkpoint`; logits must match at 1e-4.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from bpo_jax.models import config, hf_import
from bpo_jax.models.config import RopeScaling
from bpo_jax.models.llama import init_cache, rope_frequencies

ATOL = 1e-4
BATCH, LENGTH = 2, 24

_QWEN2 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10_000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Far below the test length, so the scaling changes every frequency the test uses.
    original_max_position_embeddings=8,
)
CASES = {
    "qwen2_untied": ("qwen2", dict(_QWEN2, tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(_QWEN2, tie_word_embeddings=True)),
    # The Qwen2 sizes but a width of 48, with head_dim 16 (!= hidden_size / heads, so
    # head_dim must be read from the config).
    "llama_gqa_rope_scaling": (
        "llama",
        dict(
            _QWEN2,
            hidden_size=48,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_parameters=_LLAMA3_ROPE,
            tie_word_embeddings=False,
        ),
    ),
}


# Module-level so that models of equal architecture share one compilation.
_forward = nnx.jit(lambda model, tokens: model(tokens))
_step = nnx.jit(lambda model, tokens, cache, num_new: model(tokens, cache=cache, num_new_b=num_new))


def _hf_model(model_type: str, kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    if model_type == "qwen2":
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    else:
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    model = model_cls(config_cls(attn_implementation="eager", **kwargs)).float().eval()
    # HF initialises norms to 1 and biases to 0; randomise everything so that a parameter mapped
    # to the wrong place, or not at all, changes the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1 if name.endswith("bias") else 0.05)
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 128, (BATCH, LENGTH)).astype(np.int32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case's HF model, saved once: {name: (HF model, checkpoint dir)}."""
    out = {}
    for name, (model_type, kwargs) in CASES.items():
        hf = _hf_model(model_type, kwargs)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path, safe_serialization=True)
        out[name] = (hf, path)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, saved, tokens):
    """(name, HF model, our config, our model, HF logits)."""
    hf, path = saved[request.param]
    cfg, model = hf_import.load_hf_checkpoint(path)
    return request.param, hf, cfg, model, _hf_logits(hf, tokens)


def test_logits_match_hf(case, tokens):
    _, _, _, model, want = case
    got, cache = _forward(model, jnp.asarray(tokens))
    assert cache is None
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def test_config_is_read_from_the_checkpoint(case):
    name, hf, cfg, _, _ = case
    assert cfg.num_layers == hf.config.num_hidden_layers
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4
    assert cfg.param_dtype == jnp.float32 and cfg.max_seq_len == 64
    assert cfg.tie_embeddings == (name == "qwen2_tied")
    assert cfg.qkv_bias == name.startswith("qwen2")
    if name.startswith("llama"):
        assert cfg.resolved_head_dim == 16 and cfg.rms_norm_eps == 1e-5
        assert cfg.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 8)
        # The scaling is not a no-op at this size: every frequency moves.
        scaled = rope_frequencies(cfg)
        plain = rope_frequencies(cfg.replace(rope_scaling=None))
        assert np.all(np.abs(scaled - plain) > 1e-3 * plain)
    else:
        assert cfg.rope_scaling is None


# Tied and untied Qwen2 differ only in the head, which the cache does not touch.
@pytest.mark.parametrize("case", ["qwen2_untied", "llama_gqa_rope_scaling"], indirect=True)
def test_cached_decoding_matches_hf(case, tokens):
    _, _, cfg, model, want = case
    check_cached_decoding(cfg, model, tokens, want)


def check_cached_decoding(cfg, model, tokens, want) -> None:
    """Ragged prefill, a chunked append and single-token decoding, all through the KV cache, give
    the full forward's logits `want` (also Qwen3's test)."""
    cache = init_cache(cfg, BATCH, capacity=32)
    # Row 0 prefills 10 tokens; row 1 only 6, right-padded with junk that must not leak.
    prefill = tokens[:, :10].copy()
    prefill[1, 6:] = 127
    logits, cache = _step(model, jnp.asarray(prefill), cache, jnp.asarray([10, 6]))
    np.testing.assert_allclose(np.asarray(logits[0]), want[0, :10], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1, :6]), want[1, :6], atol=ATOL, rtol=0)
    # Both rows append 10 tokens (the prefill's shape, so no new compilation), each after its
    # own context.
    chunk = np.stack([tokens[0, 10:20], tokens[1, 6:16]])
    logits, cache = _step(model, jnp.asarray(chunk), cache, jnp.asarray([10, 10]))
    np.testing.assert_allclose(np.asarray(logits[0]), want[0, 10:20], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1]), want[1, 6:16], atol=ATOL, rtol=0)
    # Then one token at a time.
    for i in range(4):
        pair = np.array([[tokens[0, 20 + i]], [tokens[1, 16 + i]]])
        logits, cache = _step(model, jnp.asarray(pair), cache, jnp.asarray([1, 1]))
        np.testing.assert_allclose(np.asarray(logits[0, 0]), want[0, 20 + i], atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(logits[1, 0]), want[1, 16 + i], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [24, 20])


def test_export_inverts_import(case):
    name, hf, _, model, _ = case
    exported = hf_import.export_hf_state_dict(model)
    reference = {k: v.numpy() for k, v in hf.state_dict().items()}
    if name == "qwen2_tied":
        assert "lm_head.weight" not in exported
        reference.pop("lm_head.weight")
    assert sorted(exported) == sorted(reference)
    for key, value in exported.items():
        np.testing.assert_array_equal(value, reference[key], err_msg=key)


def test_sharded_checkpoint_with_index(tmp_path, tokens):
    hf = _hf_model(*CASES["qwen2_untied"], seed=1)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    with open(tmp_path / "model.safetensors.index.json") as fh:
        shards = set(json.load(fh)["weight_map"].values())
    assert len(shards) > 2
    assert not (tmp_path / "model.safetensors").exists()
    _, model = hf_import.load_hf_checkpoint(tmp_path)
    got, _ = _forward(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_bfloat16_checkpoint(tmp_path):
    hf = _hf_model(*CASES["qwen2_tied"], seed=2).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    reference = {k: v.float().numpy() for k, v in hf.state_dict().items()}

    cfg, model = hf_import.load_hf_checkpoint(tmp_path)
    assert cfg.param_dtype == jnp.bfloat16 and cfg.dtype == jnp.bfloat16
    assert model.layers[0].self_attn.qkv_proj[...].dtype == jnp.bfloat16
    for key, value in hf_import.export_hf_state_dict(model).items():
        np.testing.assert_array_equal(value.astype(np.float32), reference[key], err_msg=key)

    cfg, model = hf_import.load_hf_checkpoint(tmp_path, param_dtype=jnp.float32, max_seq_len=16)
    assert cfg.param_dtype == jnp.float32 and cfg.dtype == jnp.bfloat16 and cfg.max_seq_len == 16
    up_proj = model.layers[1].mlp.gate_up_proj[...][:, 1]  # [D, 2, F]: gate, then up
    assert up_proj.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(up_proj), reference["model.layers.1.mlp.up_proj.weight"].T
    )


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def broken_checkpoint(saved, tmp_path):
    """A writable copy of the untied Qwen2 checkpoint and its tensors."""
    _, path = saved["qwen2_untied"]
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    return tmp_path, load_file(os.path.join(tmp_path, "model.safetensors"))


def _rewrite(path, tensors):
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(broken_checkpoint):
    path, tensors = broken_checkpoint
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.self_attn\.k_proj\.bias"):
        hf_import.load_hf_checkpoint(path)


def test_unexpected_tensor_is_named(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"Unexpected tensor 'model\.layers\.0\.self_attn\.o_proj"):
        hf_import.load_hf_checkpoint(path)


def test_shape_mismatch_names_tensor_and_shapes(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape \(95, 64\).*\(96, 64\)"):
        hf_import.load_hf_checkpoint(path)


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config()))
    with pytest.raises(FileNotFoundError, match="No model.safetensors"):
        hf_import.load_hf_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- config_from_hf


def _hf_config(**kwargs):
    return {"model_type": "llama", **{k: v for k, v in CASES["qwen2_untied"][1].items()}, **kwargs}


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        hf_import.config_from_hf(_hf_config(model_type="mistral"))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_features_are_rejected(extra, match):
    with pytest.raises(ValueError, match=match):
        hf_import.config_from_hf(_hf_config(**extra))


def test_legacy_rope_keys_and_overrides():
    # transformers < 5 writes rope_theta and rope_scaling (with "type" or "rope_type") on top.
    legacy = _hf_config(
        rope_theta=500_000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        torch_dtype="bfloat16",
        max_position_embeddings=131_072,
    )
    cfg = hf_import.config_from_hf(legacy, max_seq_len=4096)
    assert cfg.rope_theta == 500_000.0
    assert cfg.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=8192)
    assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.bfloat16
    assert cfg.max_seq_len == 4096  # the override caps max_position_embeddings...
    assert hf_import.config_from_hf(legacy, max_seq_len=10**7).max_seq_len == 131_072  # ...only
    assert not hf_import.config_from_hf(legacy).qkv_bias
    default = hf_import.config_from_hf(_hf_config(rope_scaling={"rope_type": "default"}))
    assert default.rope_scaling is None and default.rope_theta == 10_000.0
    with pytest.raises(ValueError, match="Unknown ModelConfig overrides"):
        hf_import.config_from_hf(legacy, num_experts=8)


def test_published_configs_map_to_presets():
    # The fields of the published config.json files (transformers 4.x layout) that matter here.
    qwen2_5_7b = {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    llama3_1_8b = {
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    assert hf_import.config_from_hf(qwen2_5_7b) == config.qwen2_5_7b()
    assert hf_import.config_from_hf(llama3_1_8b) == config.llama3_1_8b(head_dim=128)
