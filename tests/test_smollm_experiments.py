"""`model=smollm2_135m`: every experiment file runs SmolLM2-135M-Instruct from its GGUF file in
the chat format, at verl-agent's lengths (cut for two cores with `cpu`), float32 or bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import set_fields

from bpo_jax.agent.episode import EpisodeText
from bpo_jax.agent.presets import CPU_CHAT, VERL_AGENT
from bpo_jax.builders import build_model, build_tokenizer, make_agent, make_policy
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"alfworld": "alfworld", "webshop": "webshop", "swebench": "swe"}
FIRST_OBSERVATION = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
    "around you, you see a bed 1, a drawer 2, a drawer 1, a dresser 1, and a shelf 1.\n\n"
    "Your task is to: put a cellphone in bed."
)


def smollm_config(experiment: str, arg: str = "cpu,model=smollm2_135m", **fields):
    cfg = load_experiment(ROOT / "experiments" / f"{experiment}.py").get_config(arg)
    return set_fields(cfg, fields) if fields else cfg


@pytest.mark.parametrize("experiment", sorted(ENVS))
@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "full"])
def test_variant_validates(experiment, cpu):
    v = validate(
        smollm_config(experiment, "cpu,model=smollm2_135m" if cpu else "model=smollm2_135m")
    )
    m, a = v.model, v.agent
    assert (m.preset, m.gguf, m.hf_checkpoint) == ("smollm2_135m", "smollm2_135m_instruct", "")
    assert a.format == "chat" and v.bc.steps == 0 and not v.eval.initial
    lengths = (CPU_CHAT if cpu else VERL_AGENT).get(ENVS[experiment])
    if lengths is not None:
        assert a.max_prompt_tokens == lengths["max_prompt_tokens"]
        assert a.max_action_tokens == lengths["max_action_tokens"]
        assert a.history_turns == lengths["history_turns"]
        assert v.env.max_steps == lengths["max_steps"]
    assert a.max_prompt_tokens + a.max_action_tokens <= m.max_seq_len
    assert (m.dtype, m.param_dtype) == (("float32", "float32") if cpu else ("bfloat16", "float32"))


def test_bfloat16_and_conflicting_weights():
    cfg = smollm_config("alfworld", **{"model.dtype": "bfloat16", "model.param_dtype": "bfloat16"})
    assert validate(cfg).model.param_dtype == "bfloat16"
    cfg = smollm_config("alfworld", **{"model.hf_checkpoint": "/some/folder"})
    with pytest.raises(ValueError, match=r"config\.model\.gguf .* both name the weights"):
        validate(cfg)


def test_builders_load_the_model_and_act(tmp_path):
    """The run's builders load weights, tokenizer and template from the GGUF file, and the chat
    agent's prompt runs through the policy (bfloat16: tests/test_gguf.py)."""
    v = validate(smollm_config("alfworld", **{"agent.max_action_tokens": 8}))
    tok = build_tokenizer(v, tmp_path, demos=None)
    assert not (tmp_path / "tokenizer.model").exists()  # Nothing trained.
    mcfg, model = build_model(v, tok, mesh=None)
    assert mcfg.max_seq_len == v.model.max_seq_len and mcfg.param_dtype == jnp.float32
    agent = make_agent(v, tok)
    ids = agent.encode(EpisodeText.start(FIRST_OBSERVATION, actions=["go to bed 1", "look"]))
    assert tok.decode(ids, skip_special=False).startswith("<|im_start|>system\n")
    graphdef, params = nnx.split(model)
    policy = make_policy(v, graphdef, params, tok, mcfg)
    (sample,) = policy.sample(policy.prefill([ids]), jax.random.key(0), greedy=True)
    assert 0 < len(sample.token_ids) <= 8 and sample.text == tok.decode(sample.token_ids)


@pytest.mark.slow  # 4 minutes on 2 busy shared cores (2026-12-05; 6 at CPU_CHAT's lengths).
def test_alfworld_evaluates_the_real_model(tmp_path):
    """The main job with the real model and no network: one evaluation game, two steps.

    Prompts of up to 256 tokens (the chat agent cuts the observation to fit) and answers of up
    to 16: the prefill and decode of a turn are most of the test's time, and the lengths are not
    what it checks (`test_variant_validates` checks the variant's own)."""
    from bpo_jax.train import train_and_evaluate

    fields = {
        "train.iterations": 0,
        "eval.num_tasks": 1,
        "env.max_steps": 2,
        "agent.max_prompt_tokens": 256,
        "agent.max_action_tokens": 16,
    }
    summary = train_and_evaluate(smollm_config("alfworld", **fields), tmp_path)
    assert summary["eval_tasks"] == 1 and summary["iterations"] == 0
    assert 0.0 <= summary["success_before_rl"] <= 1.0
