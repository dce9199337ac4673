"""Config specs check their own fields; allowed values come from the registries."""

import dataclasses
import math
from pathlib import Path

import pytest

from bpo_jax import config as config_lib
from bpo_jax.algorithms import ALGORITHMS, Algorithm, get_algorithm, register_algorithm
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from bpo_jax.rollout.branching import SELECTORS, register_selector

ROOT = Path(__file__).resolve().parents[1]


def cpu_config():
    return load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")


def float_fields():
    for name, cls in config_lib.SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.type == "float":
                yield f"{name}.{f.name}"


@pytest.mark.parametrize("field", list(float_fields()))
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_every_float_field_rejects_non_finite_values(field, bad):
    cfg = cpu_config()
    section, name = field.split(".")
    cfg[section][name] = bad
    with pytest.raises(ValueError, match=rf"config\.{section}\.{name} must be finite"):
        validate(cfg)


def test_float_fields_are_the_expected_ones():
    # A guard that the parametrisation above sees every float field (including these).
    fields = set(float_fields())
    for f in ("bc.lr", "train.lr", "train.kl_coef", "sampler.temperature", "train.adv_eps"):
        assert f in fields
    assert "env.invalid_action_penalty" in fields


def test_allowed_values_follow_the_registries():
    cfg = cpu_config()
    cfg.rollout.selector = "my_rule"
    with pytest.raises(ValueError, match="config.rollout.selector must be one of"):
        validate(cfg)

    @register_selector("my_rule")
    class MyRule(SELECTORS["interval"]):
        pass

    try:
        assert validate(cfg).rollout.selector == "my_rule"
    finally:
        del SELECTORS["my_rule"]


def test_a_registered_algorithm_is_a_valid_train_algo():
    cfg = cpu_config()
    cfg.train.algo = "rloo_tree"
    with pytest.raises(ValueError, match="config.train.algo must be one of"):
        validate(cfg)
    register_algorithm(Algorithm("rloo_tree", "tree", "rloo", uses_normalize=True))
    try:
        v = validate(cfg)
        assert v.algorithm.branches and v.algorithm.estimator == "rloo"
    finally:
        del ALGORITHMS["rloo_tree"]
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(Algorithm("bpo", "tree", "bpo"))
    with pytest.raises(ValueError, match="unknown algorithm 'sarsa'"):
        get_algorithm("sarsa")


def test_algorithm_checks_refuse_meaningless_settings():
    cfg = cpu_config()
    cfg.train.algo = "grpo"
    cfg.train.normalize = "sibling_std"
    with pytest.raises(ValueError, match="config.train.normalize='sibling_std' has no effect"):
        validate(cfg)
    cfg.train.algo = "bpo"
    assert validate(cfg).train.normalize == "sibling_std"
    cfg.rollout.root_group = 1
    with pytest.raises(ValueError, match="config.rollout.root_group must be >= 2 for"):
        validate(cfg)
    cfg.train.algo = "rloo"  # Independent groups do not use the root group.
    assert validate(cfg).rollout.root_group == 1


def test_estimator_options_come_from_the_train_section():
    t = validate(cpu_config()).train
    assert get_algorithm("rloo").estimator_options(t) == {"normalize": "none", "eps": t.adv_eps}
    assert get_algorithm("ppo").estimator_options(t) == {
        "gamma": t.gamma,
        "lam": t.gae_lambda,
        "eps": t.adv_eps,
    }
    assert get_algorithm("ppo").needs_critic and get_algorithm("gigpo").uses_obs_ids


def test_missing_and_unknown_fields_are_named():
    cfg = cpu_config().to_dict()
    del cfg["train"]["lr"]
    with pytest.raises(ValueError, match=r"config.train is missing field\(s\) \['lr'\]"):
        validate(cfg)
    cfg = cpu_config().to_dict()
    cfg["rollout"]["branchs"] = 3
    with pytest.raises(ValueError, match=r"config.rollout has unknown field\(s\) \['branchs'\]"):
        validate(cfg)


def test_specs_are_frozen_and_check_on_replace():
    v = validate(cpu_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.train.lr = 1.0
    with pytest.raises(ValueError, match="config.train.lr must be > 0"):
        dataclasses.replace(v.train, lr=0.0)
    with pytest.raises(ValueError, match=r"config.sampler.prefill_chunk must be 0 or a multiple"):
        dataclasses.replace(v.sampler, prefill_chunk=v.sampler.length_bucket + 1)
    assert dataclasses.replace(v.sampler, prefill_chunk=2 * v.sampler.length_bucket)


def test_random_init_presets_need_no_checkpoint_and_the_others_do():
    from bpo_jax.models.config import get_preset

    cfg = cpu_config()
    cfg.model.preset = "small"
    assert validate(cfg).model.preset == "small"
    small, tiny = get_preset("small"), get_preset("tiny")
    assert (small.num_layers, small.hidden_size) == (6, 256)
    assert small.vocab_size == tiny.vocab_size and small.rope_theta == tiny.rope_theta
    cfg.model.preset = "qwen2_5_7b"
    with pytest.raises(ValueError, match="hf_checkpoint is required for preset 'qwen2_5_7b'"):
        validate(cfg)
