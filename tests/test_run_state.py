"""RunState: one checkpoint layout for training, resume and the probe."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from bpo_jax import learner
from bpo_jax.builders import make_critic
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from bpo_jax.io.checkpoint import Checkpointer
from bpo_jax.models import config as model_config
from bpo_jax.models.factory import create_model
from bpo_jax.run_state import initial_state

ROOT = Path(__file__).resolve().parents[1]


def setting(**train):
    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    for k, v in train.items():
        cfg.train[k] = v
    cfg = validate(cfg)
    mcfg = model_config.get_preset("tiny", vocab_size=64, max_seq_len=64, num_layers=1)
    graphdef, params = nnx.split(create_model(mcfg, seed=0))
    optimizer = learner.make_optimizer(1e-3)
    return cfg, graphdef, params, optimizer, mcfg


def leaves_equal(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a) == len(b)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def test_ppo_state_with_reference_round_trips(tmp_path):
    cfg, graphdef, params, optimizer, mcfg = setting(algo="ppo", kl_coef=0.1)
    critic = make_critic(cfg, graphdef, mcfg.hidden_size, pad_id=0)
    state = initial_state(cfg, params, optimizer, critic)
    assert state.phase == "bc" and state.iteration == 0 and state.meta["seed"] == cfg.seed
    assert set(state.tree()) == {"train_state", "rng", "ref_params", "critic"}
    # Change every part, so the restore cannot pass by returning the template.
    bumped = jax.tree.map(lambda x: x + 1.0, state.train.params)
    state.critic.state = jax.tree.map(lambda x: x + 2.0, state.critic.state)
    state.rollout.lengths.add(7)
    state.rollout.costs.record(3, 12)
    state = state.replace(
        train=learner.TrainState(bumped, state.train.opt_state, state.train.step + 5),
        rng=jax.random.key(99),
        meta={**state.meta, "phase": "rl", "iteration": 4},
    )
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert state.save(ckpt)
        ckpt.wait()
        fresh_critic = make_critic(cfg, graphdef, mcfg.hidden_size, pad_id=0)
        template = initial_state(cfg, params, optimizer, fresh_critic)
        restored = template.restore(ckpt)
    assert restored.step == 5 and restored.phase == "rl" and restored.iteration == 4
    assert leaves_equal(restored.train.params, bumped)
    assert leaves_equal(restored.ref_params, params)
    assert leaves_equal(fresh_critic.state, state.critic.state)
    assert restored.critic is fresh_critic
    assert leaves_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))
    assert list(restored.rollout.lengths.lengths) == [7]
    assert restored.rollout.costs.tokens_per_action == 4.0
    assert "rollout" not in restored.meta


def test_a_layout_mismatch_is_reported(tmp_path):
    cfg, graphdef, params, optimizer, mcfg = setting(algo="grpo")
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        initial_state(cfg, params, optimizer).save(ckpt)
        ckpt.wait()
        ppo, *_ = setting(algo="ppo")
        critic = make_critic(ppo, graphdef, mcfg.hidden_size, pad_id=0)
        with pytest.raises(ValueError, match="does not match abstract_state"):
            initial_state(ppo, params, optimizer, critic).restore(ckpt)
