"""Typed, validated views of an experiment's ConfigDict.

The launcher turns the ConfigDict into frozen dataclasses once, at start-up, so that a bad
value fails immediately with a message naming the field, rather than an hour into a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from bpo_jax.models.config import PRESETS

# Algorithm -> (rollout topology, advantage estimator). Every algorithm resets a task once and
# forks its rollouts; "tree" algorithms also branch online (bpo_jax.rollout).
ALGOS = {
    "grpo": ("independent", "grpo"),
    "rloo": ("independent", "rloo"),
    "gigpo": ("independent", "gigpo"),
    "ppo": ("independent", "gae"),
    "bpo": ("tree", "bpo"),
    "treerl": ("tree", "treerl"),
}
SELECTORS = ("entropy", "uniform", "interval", "posthoc_topk")
STEP_WEIGHTINGS = ("trajectory", "path_mass", "uniform")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LOSS_AGGS = ("token_mean", "seq_mean")
SANDBOX_BACKENDS = ("fork", "replay", "criu", "inprocess")


def _check(cond: bool, field: str, value: Any, what: str):
    if not cond:
        raise ValueError(f"config.{field} {what}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    preset: str
    hf_checkpoint: str
    tokenizer: str
    tokenizer_vocab_size: int
    max_seq_len: int
    dtype: str
    param_dtype: str


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    data: int
    fsdp: int
    tensor: int
    rules: tuple


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    name: str
    data_root: str
    train_split: str
    eval_split: str
    task_types: tuple[str, ...]
    num_train_tasks: int
    max_steps: int
    invalid_action_penalty: float
    num_workers: int
    sandbox_backend: str
    task_options: Mapping[str, Any]  # Extra arguments of the environment's task loader.
    env_options: Mapping[str, Any]  # Extra arguments of the environment's constructor.


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    history_turns: int
    max_prompt_tokens: int
    max_action_tokens: int


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    temperature: float
    top_p: float
    length_bucket: int


@dataclasses.dataclass(frozen=True)
class BCSpec:
    steps: int
    batch_size: int
    lr: float


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    algo: str
    iterations: int
    tasks_per_iter: int
    group_size: int
    lr: float
    weight_decay: float
    b1: float
    b2: float
    grad_clip: float
    clip_eps: float
    kl_coef: float
    epochs: int
    minibatch_size: int
    loss_agg: str
    step_weighting: str
    adv_eps: float
    normalize: str  # none | sibling_std (bpo / rloo advantages divided by the sibling std).
    gamma: float  # PPO: discount over turns.
    gae_lambda: float  # PPO: GAE lambda over turns.
    value_lr: float  # PPO: learning rate of the value head.
    value_epochs: int  # PPO: value-head passes over each batch.


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    root_group: int
    num_branches: int
    branch_budget: int
    max_depth: int
    selector: str
    entropy_quantile: float
    entropy_window: int
    entropy_reduce: str
    branch_prob: float
    interval: int
    budget: float
    budget_unit: str


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    num_tasks: int
    every: int


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    every: int
    max_to_keep: int


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


def _section(cls, raw: Mapping[str, Any], name: str):
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = fields - set(raw)
    if missing:
        raise ValueError(f"config.{name} is missing field(s) {sorted(missing)}.")
    extra = set(raw) - fields
    if extra:
        raise ValueError(
            f"config.{name} has unknown field(s) {sorted(extra)}; known: {sorted(fields)}."
        )
    values = {}
    for f in dataclasses.fields(cls):
        v = raw[f.name]
        if isinstance(v, list):
            v = tuple(v)
        values[f.name] = v
    return cls(**values)


def validate(config: Mapping[str, Any]) -> ExperimentConfig:
    """Checks every field of an experiment config and returns its typed, frozen form.

    Raises:
      ValueError: naming the first invalid field, its value and what was expected.
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    sections = {
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
    for name in ("seed", "log_every", *sections):
        if name not in raw:
            raise ValueError(f"config.{name} is missing.")
    parsed = {name: _section(cls, raw[name], name) for name, cls in sections.items()}
    cfg = ExperimentConfig(seed=int(raw["seed"]), log_every=int(raw["log_every"]), **parsed)

    m = cfg.model
    _check(m.preset in PRESETS, "model.preset", m.preset, f"must be one of {sorted(PRESETS)}")
    _check(
        m.preset == "tiny" or bool(m.hf_checkpoint),
        "model.hf_checkpoint",
        m.hf_checkpoint,
        f"is required for preset {m.preset!r} (random init of a 7B/8B policy cannot act); pass "
        "--config.model.hf_checkpoint=/path/to/hf_model_dir",
    )
    _check(
        m.tokenizer_vocab_size >= 64,
        "model.tokenizer_vocab_size",
        m.tokenizer_vocab_size,
        "must be >= 64",
    )
    _check(m.max_seq_len > 0, "model.max_seq_len", m.max_seq_len, "must be positive")
    _check(m.dtype in DTYPES, "model.dtype", m.dtype, f"must be one of {sorted(DTYPES)}")
    _check(
        m.param_dtype in DTYPES,
        "model.param_dtype",
        m.param_dtype,
        f"must be one of {sorted(DTYPES)}",
    )

    for axis in ("data", "fsdp", "tensor"):
        v = getattr(cfg.mesh, axis)
        _check(v == -1 or v >= 1, f"mesh.{axis}", v, "must be >= 1 or -1 (take the rest)")
    _check(
        [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) <= 1,
        "mesh",
        cfg.mesh,
        "may have at most one axis set to -1",
    )

    e = cfg.env
    _check(e.max_steps >= 1, "env.max_steps", e.max_steps, "must be >= 1")
    _check(e.num_train_tasks >= 0, "env.num_train_tasks", e.num_train_tasks, "must be >= 0")
    _check(
        e.invalid_action_penalty >= 0,
        "env.invalid_action_penalty",
        e.invalid_action_penalty,
        "must be >= 0 (it is subtracted)",
    )
    _check(e.num_workers >= 1, "env.num_workers", e.num_workers, "must be >= 1")
    _check(
        e.sandbox_backend in SANDBOX_BACKENDS,
        "env.sandbox_backend",
        e.sandbox_backend,
        f"must be one of {SANDBOX_BACKENDS}",
    )

    a = cfg.agent
    _check(a.history_turns >= 0, "agent.history_turns", a.history_turns, "must be >= 0")
    _check(a.max_action_tokens >= 1, "agent.max_action_tokens", a.max_action_tokens, "must be >= 1")
    _check(
        a.max_prompt_tokens >= 16, "agent.max_prompt_tokens", a.max_prompt_tokens, "must be >= 16"
    )
    _check(
        a.max_prompt_tokens + a.max_action_tokens <= m.max_seq_len,
        "agent.max_prompt_tokens",
        a.max_prompt_tokens,
        f"plus agent.max_action_tokens ({a.max_action_tokens}) must fit in model.max_seq_len "
        f"({m.max_seq_len})",
    )

    s = cfg.sampler
    _check(
        s.temperature > 0,
        "sampler.temperature",
        s.temperature,
        "must be > 0 (RL rollouts are sampled; evaluation is greedy regardless)",
    )
    _check(0 < s.top_p <= 1, "sampler.top_p", s.top_p, "must be in (0, 1]")
    _check(s.length_bucket >= 1, "sampler.length_bucket", s.length_bucket, "must be >= 1")

    _check(cfg.bc.steps >= 0, "bc.steps", cfg.bc.steps, "must be >= 0")
    _check(cfg.bc.batch_size >= 1, "bc.batch_size", cfg.bc.batch_size, "must be >= 1")
    _check(cfg.bc.lr > 0, "bc.lr", cfg.bc.lr, "must be > 0")

    t = cfg.train
    _check(t.algo in ALGOS, "train.algo", t.algo, f"must be one of {sorted(ALGOS)}")
    _check(t.iterations >= 0, "train.iterations", t.iterations, "must be >= 0")
    _check(t.tasks_per_iter >= 1, "train.tasks_per_iter", t.tasks_per_iter, "must be >= 1")
    _check(
        t.group_size >= 2,
        "train.group_size",
        t.group_size,
        "must be >= 2 (a group baseline needs siblings)",
    )
    _check(t.lr > 0, "train.lr", t.lr, "must be > 0")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    _check(0 <= t.b1 < 1, "train.b1", t.b1, "must be in [0, 1)")
    _check(0 <= t.b2 < 1, "train.b2", t.b2, "must be in [0, 1)")
    _check(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables)")
    _check(t.clip_eps > 0, "train.clip_eps", t.clip_eps, "must be > 0")
    _check(t.kl_coef >= 0, "train.kl_coef", t.kl_coef, "must be >= 0")
    _check(t.epochs >= 1, "train.epochs", t.epochs, "must be >= 1")
    _check(t.minibatch_size >= 1, "train.minibatch_size", t.minibatch_size, "must be >= 1")
    _check(t.loss_agg in LOSS_AGGS, "train.loss_agg", t.loss_agg, f"must be one of {LOSS_AGGS}")
    _check(
        t.step_weighting in STEP_WEIGHTINGS,
        "train.step_weighting",
        t.step_weighting,
        f"must be one of {STEP_WEIGHTINGS}",
    )
    _check(t.adv_eps > 0, "train.adv_eps", t.adv_eps, "must be > 0")
    _check(
        t.normalize in ("none", "sibling_std"),
        "train.normalize",
        t.normalize,
        "must be 'none' or 'sibling_std'",
    )
    _check(0 <= t.gamma <= 1, "train.gamma", t.gamma, "must be in [0, 1]")
    _check(0 <= t.gae_lambda <= 1, "train.gae_lambda", t.gae_lambda, "must be in [0, 1]")
    _check(t.value_lr > 0, "train.value_lr", t.value_lr, "must be > 0")
    _check(t.value_epochs >= 1, "train.value_epochs", t.value_epochs, "must be >= 1")

    r = cfg.rollout
    _check(
        r.root_group >= 2,
        "rollout.root_group",
        r.root_group,
        "must be >= 2 (without a root group the steps before the first branch point have no "
        "siblings and get no gradient)",
    )
    _check(r.num_branches >= 2, "rollout.num_branches", r.num_branches, "must be >= 2")
    _check(r.branch_budget >= 0, "rollout.branch_budget", r.branch_budget, "must be >= 0")
    _check(r.max_depth >= 0, "rollout.max_depth", r.max_depth, "must be >= 0")
    _check(r.selector in SELECTORS, "rollout.selector", r.selector, f"must be one of {SELECTORS}")
    _check(
        0 <= r.entropy_quantile <= 1,
        "rollout.entropy_quantile",
        r.entropy_quantile,
        "must be in [0, 1]",
    )
    _check(r.entropy_window >= 1, "rollout.entropy_window", r.entropy_window, "must be >= 1")
    _check(
        r.entropy_reduce in ("first", "mean", "max"),
        "rollout.entropy_reduce",
        r.entropy_reduce,
        "must be one of ('first', 'mean', 'max')",
    )
    _check(0 <= r.branch_prob <= 1, "rollout.branch_prob", r.branch_prob, "must be in [0, 1]")
    _check(r.interval >= 1, "rollout.interval", r.interval, "must be >= 1")
    _check(r.budget >= 0, "rollout.budget", r.budget, "must be >= 0 (0 = auto)")
    _check(
        r.budget_unit in ("tokens", "env_steps"),
        "rollout.budget_unit",
        r.budget_unit,
        "must be 'tokens' or 'env_steps'",
    )

    _check(cfg.eval.num_tasks >= 0, "eval.num_tasks", cfg.eval.num_tasks, "must be >= 0")
    _check(cfg.eval.every >= 0, "eval.every", cfg.eval.every, "must be >= 0")
    _check(cfg.checkpoint.every >= 1, "checkpoint.every", cfg.checkpoint.every, "must be >= 1")
    _check(
        cfg.checkpoint.max_to_keep >= 1,
        "checkpoint.max_to_keep",
        cfg.checkpoint.max_to_keep,
        "must be >= 1",
    )
    _check(cfg.log_every >= 1, "log_every", cfg.log_every, "must be >= 1")
    return cfg
