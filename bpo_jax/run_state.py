"""Everything a run carries between phases and across restarts, with one checkpoint layout.

A `RunState` is the policy's train state (parameters, optimizer state, update counter), the
KL reference parameters (when `train.kl_coef > 0`), PPO's critic (when the algorithm has one),
the run's PRNG key, the rollouts' running statistics, and JSON metadata: the phase ("bc" or
"rl"), the behaviour-cloning step, the RL iteration and the seed. Training, resume and the
gradient probe all build it with `initial_state` and read and write it with `save` /
`restore`, so the checkpoint layout exists once:

  checkpoint step = train.step
    state: {"train_state", "rng", ["ref_params"], ["critic"]}   (Orbax pytree)
    meta:  {"phase", "bc_step", "iteration", "seed", "rollout"}  (JSON)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from bpo_jax import learner
from bpo_jax.io.checkpoint import Checkpointer, abstract_like
from bpo_jax.models import lora
from bpo_jax.rl import RolloutState

PHASES = ("bc", "rl")
log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
    """A run's state (see the module docstring).

    Attributes:
      train: the policy's `learner.TrainState`.
      rng: the run's PRNG key (evaluations and rollouts fold indices into it).
      ref_params: the frozen KL reference policy, or None.
      critic: a `critic.Critic` (its `state` pytree is checkpointed), or None.
      rollout: the rollouts' running statistics (`rl.RolloutState`), saved in `meta`.
      meta: JSON metadata: phase, bc_step, iteration, seed.
    """

    train: learner.TrainState
    rng: jax.Array
    ref_params: Any
    critic: Any
    rollout: RolloutState
    meta: dict

    @property
    def phase(self) -> str:
        return self.meta["phase"]

    @property
    def iteration(self) -> int:
        return int(self.meta["iteration"])

    @property
    def step(self) -> int:
        return int(self.train.step)

    def replace(self, **changes) -> RunState:
        return dataclasses.replace(self, **changes)

    def tree(self) -> dict:
        """The checkpointed pytree. With LoRA the train state's parameters are the adapters
        only: the frozen base is not saved (it is rebuilt from its source, `meta["lora_base"]`,
        and joined to them on restore)."""
        train = self.train
        if lora.has_lora(train.params):
            train = train.replace(params=lora.split_adapters(train.params)[0])
        out = {"train_state": train, "rng": self.rng}
        if self.ref_params is not None:
            out["ref_params"] = self.ref_params
        if self.critic is not None:
            out["critic"] = self.critic.state
        return out

    def save(self, ckpt: Checkpointer, force: bool = True) -> bool:
        meta = dict(self.meta, rollout=self.rollout.dump())
        return ckpt.save(self.step, self.tree(), meta, force=force)

    def restore(self, ckpt: Checkpointer, step: int | None = None) -> RunState:
        """This state (a template of the right structure and shardings) filled from `ckpt`.

        Without `step`, the newest intact step: a damaged newer one is reported in one line and
        set aside (`Checkpointer.restore_intact`).
        """
        abstract = abstract_like(self.tree())
        if step is None:
            step, restored, meta = ckpt.restore_intact(abstract)
        else:
            step, restored, meta = ckpt.restore(step, abstract_state=abstract)
        if self.critic is not None:
            self.critic.state = restored["critic"]
        base = self.meta.get("lora_base")
        if base is not None and meta.get("lora_base", base) != base:
            log.warning(
                "The checkpoint's adapters were trained over %r; they are restored over %r.",
                meta["lora_base"],
                base,
            )
        rollout = self.rollout.loaded(meta.pop("rollout", {}))
        train = restored["train_state"]
        if lora.has_lora(self.train.params):  # The adapters, onto this state's frozen base.
            base = lora.split_adapters(self.train.params)[1]
            train = train.replace(params=lora.merge(base, train.params))
        return dataclasses.replace(
            self,
            train=train,
            rng=restored["rng"],
            ref_params=restored.get("ref_params"),
            rollout=rollout,
            meta={**self.meta, **meta},
        )


def initial_state(cfg, params, optimizer, critic=None) -> RunState:
    """A fresh run's state: BC phase, step 0, the run's seed.

    Args:
      cfg: the `config.ExperimentConfig`.
      params: the policy's initial parameters (already sharded).
      optimizer: the optax transformation whose state the train state holds (BC and RL share
        one structure, `learner.make_optimizer`, so either phase restores into this template).
      critic: PPO's `critic.Critic`, or None.
    """
    use_ref = cfg.train.kl_coef > 0
    meta = {"phase": "bc", "bc_step": 0, "iteration": 0, "seed": cfg.seed}
    if lora.has_lora(params):
        m = cfg.model
        meta["lora_base"] = m.hf_checkpoint or m.gguf or f"{m.preset} (random, seed {cfg.seed})"
    return RunState(
        train=learner.TrainState(
            params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32)
        ),
        rng=jax.random.key(cfg.seed),
        # With LoRA: zeroed adapters (the reference is the base, adapters off; no model copy).
        ref_params=learner.reference_params(params) if use_ref else None,
        critic=critic,
        rollout=RolloutState.create(cfg),
        meta=meta,
    )
