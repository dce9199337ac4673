"""Parameter counts of the full-size presets (at zero memory) and config validation."""

import jax
import pytest
from flax import nnx

from bpo_jax.models import config
from bpo_jax.models.factory import abstract_model
from bpo_jax.models.llama import count_params


@pytest.mark.parametrize(
    "preset, expected",
    [("qwen2_5_7b", 7_615_616_512), ("llama3_1_8b", 8_030_261_248), ("smollm2_135m", 134_515_008)],
)
def test_full_size_parameter_counts(preset, expected):
    model = abstract_model(config.get_preset(preset))
    assert count_params(nnx.state(model, nnx.Param)) == expected


def test_tiny_parameter_count_by_hand():
    cfg = config.tiny()
    d, f, v, e = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.resolved_head_dim
    h, k = cfg.num_heads, cfg.num_kv_heads
    attn = d * h * e + 2 * d * k * e + h * e * d + (h + 2 * k) * e  # projections + q/k/v biases
    layer = attn + 3 * d * f + 2 * d
    expected = v * d + cfg.num_layers * layer + d  # tied: no lm_head
    assert count_params(nnx.state(abstract_model(cfg), nnx.Param)) == expected
    untied = count_params(nnx.state(abstract_model(cfg.replace(tie_embeddings=False)), nnx.Param))
    assert untied == expected + d * v


def test_model_state_holds_only_params():
    # Every array of the model's state is a Param with logical axes: nothing else (e.g. RoPE
    # tables) may ride along, or abstract models and checkpoints would carry stray leaves.
    state = nnx.state(abstract_model(config.tiny(num_layers=1)))
    flat = list(nnx.to_flat_state(state))
    assert flat
    for path, var in flat:
        assert isinstance(var, nnx.Param), path
        assert len(var.get_metadata()["logical_axes"]) == len(var.get_value().shape), path
    assert len(jax.tree.leaves(state)) == len(flat)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"hidden_size": 130, "num_heads": 4}, "not divisible by num_heads"),
        ({"head_dim": 15}, "even for RoPE"),
        ({"vocab_size": 0}, "vocab_size must be positive"),
        ({"num_layers": -1}, "num_layers must be positive"),
        ({"max_seq_len": 0}, "max_seq_len must be positive"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        config.tiny(**overrides)


def test_explicit_head_dim_allows_indivisible_width():
    cfg = config.tiny(hidden_size=130, num_heads=4, head_dim=32)
    assert cfg.resolved_head_dim == 32


def test_unknown_preset():
    with pytest.raises(ValueError, match="Unknown model preset 'gpt5'"):
        config.get_preset("gpt5")
