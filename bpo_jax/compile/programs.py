"""The programs the tool compiles, lowered on abstract inputs: the update and the sampler's.

Parameters, optimizer state, caches and batches are `jax.ShapeDtypeStruct`s with
`NamedSharding`s on the mesh: nothing is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bpo_jax import builders, learner
from bpo_jax import config as config_lib
from bpo_jax.models import config as model_config
from bpo_jax.models import factory, lora, sharding
from bpo_jax.models.llama import KVCache, cache_axes
from bpo_jax.sampler import programs
from bpo_jax.sampler.core import offset_bucket


def validate_for_compile(raw) -> config_lib.ExperimentConfig:
    """`config.validate` for a compile-only run: no checkpoint is read, so none is required."""
    raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
    model = dict(raw["model"])
    if not model.get("hf_checkpoint"):
        model["hf_checkpoint"] = "(compile-only: no weights are read)"
    return config_lib.validate({**raw, "model": model})


def model_config_of(cfg: config_lib.ExperimentConfig) -> model_config.ModelConfig:
    """The architecture a run of `cfg` builds (a 7B/8B preset keeps its checkpoint's vocabulary)."""
    m = cfg.model
    dtype, param_dtype = builders.base_dtypes(cfg)  # LoRA: the base in the compute dtype.
    overrides = dict(max_seq_len=m.max_seq_len, dtype=dtype, param_dtype=param_dtype)
    if m.preset == "tiny":
        overrides["vocab_size"] = m.tokenizer_vocab_size
    return model_config.get_preset(m.preset, **overrides)


def _abstract(shape, dtype, mesh: Mesh, axes: Sequence[str | None]):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named_sharding(mesh, axes, shape))


def abstract_params(mcfg, mesh: Mesh, lcfg=None):
    """(graphdef, params as sharded `ShapeDtypeStruct`s, their shardings), with the adapters of
    `lcfg` (a `lora.LoraConfig`; None: none) over the base."""
    from flax import nnx

    model = factory.abstract_model(mcfg)
    if lcfg is not None:
        lora.apply_lora(model, lcfg, mesh=mesh, abstract=True)
    graphdef, state = nnx.split(model)
    specs = factory.param_specs(state, mesh)
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, specs
    )
    return graphdef, params, specs


def abstract_cache(mcfg, batch: int, capacity: int, mesh: Mesh) -> KVCache:
    """A `KVCache` of `ShapeDtypeStruct`s laid out as `init_cache(..., mesh=mesh)` lays it out."""
    k_shape = (batch, mcfg.num_kv_heads, mcfg.resolved_head_dim, capacity)
    v_shape = (batch, mcfg.num_kv_heads, capacity, mcfg.resolved_head_dim)
    k_axes, v_axes = cache_axes()
    layers = range(mcfg.num_layers)
    return KVCache(
        k=tuple(_abstract(k_shape, mcfg.dtype, mesh, k_axes) for _ in layers),
        v=tuple(_abstract(v_shape, mcfg.dtype, mesh, v_axes) for _ in layers),
        lengths=_abstract((batch,), jnp.int32, mesh, ("batch",)),
    )


def _replicated(x, mesh: Mesh):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


# ----------------------------------------------------------------------------- the programs


PREFILL_BOUNDS = ("none", "capacity")
# The programs the tool compiles: the update step, and the sampler's (`lower_sampler`).
SAMPLER_PROGRAMS = ("prefill", "suffix", "decode")
PROGRAMS = ("update", *SAMPLER_PROGRAMS)


def lower_update(cfg, mcfg, mesh: Mesh, length: int | None = None):
    """The RL update step at the config's minibatch, lowered (not compiled).

    `length` overrides the batch's sequence length (default: `update_length(cfg)`).
    """
    t = cfg.train
    updater, state = abstract_train_state(cfg, mcfg, mesh)
    length = update_length(cfg) if length is None else length
    rows = t.minibatch_size

    def per_token(dtype):
        return _abstract((rows, length), dtype, mesh, ("batch", "length"))

    batch = learner.Batch(
        tokens=per_token(jnp.int32),
        loss_mask=per_token(jnp.float32),
        advantages=per_token(jnp.float32),
        old_logprobs=per_token(jnp.float32),
        weights=_abstract((rows,), jnp.float32, mesh, ("batch",)),
    )
    extra = (per_token(jnp.float32),) if t.kl_coef > 0 else ()
    return updater.step_fn.lower(state, batch, *extra)


def abstract_train_state(cfg, mcfg, mesh: Mesh):
    """(the run's `learner.RLUpdater`, its `TrainState` as sharded `ShapeDtypeStruct`s)."""
    graphdef, params, specs = abstract_params(mcfg, mesh, builders.lora_config(cfg))
    updater = learner.RLUpdater(graphdef, cfg, 0, lambda *_: None, params=params)
    optimizer = updater.optimizer
    state_sh = learner.state_shardings(optimizer, params, specs)
    abstract_opt = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_opt,
        state_sh.opt_state,
    )
    step = _replicated(jax.ShapeDtypeStruct((), jnp.int32), mesh)
    return updater, learner.TrainState(params=params, opt_state=opt_state, step=step)


def bytes_per_chip(tree) -> int:
    """The largest per-device footprint of a pytree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def update_length(cfg) -> int:
    """The longest update sequence: a full prompt and action, rounded up to the length bucket."""
    a = cfg.agent
    return learner.round_up(a.max_prompt_tokens + a.max_action_tokens, cfg.sampler.length_bucket)


def rollout_rows(cfg, hosts: int | None = None) -> int:
    """Rows of the sampler's calls: the rollout batch (`tasks_per_iter x group_size`), or with
    `hosts`, the rows one host samples in a multi-host run: its largest share of the tasks
    (`mesh.task_shards`, 0 = one share per host) times `group_size`."""
    t = cfg.train
    if hosts is None:
        return t.tasks_per_iter * t.group_size
    shares = cfg.mesh.task_shards or hosts
    return -(-t.tasks_per_iter // shares) * t.group_size


def prefill_width(cfg) -> int:
    """Columns of one prefill call of a whole prompt: the longest prompt rounded up to the length
    bucket, or `sampler.prefill_chunk` when that is shorter (the prompt then runs in chunks)."""
    prompt = learner.round_up(cfg.agent.max_prompt_tokens, cfg.sampler.length_bucket)
    chunk = cfg.sampler.prefill_chunk
    return min(prompt, chunk) if chunk else prompt


def prefill_calls(cfg) -> int:
    """Prefill calls of the longest prompt: 1, or its chunks with `sampler.prefill_chunk`."""
    prompt = learner.round_up(cfg.agent.max_prompt_tokens, cfg.sampler.length_bucket)
    return -(-prompt // prefill_width(cfg))


def turn_shape(cfg, prefix: int | None = None) -> tuple[int, int]:
    """(cached prefix, new tokens) of a later turn's prefill with prefix reuse (`suffix`).

    With prefix reuse (`sampler.PrefixCache`, the policy's default) a turn prefills only what
    follows the context it continues: the task's head, and the history still in place. How long
    that is depends on the prompts; `prefix` (default: three quarters of the longest prompt,
    the proportions of `bench_sampler.py --shape=paper_turn`) stands for it. The new tokens are
    the rest of the longest prompt, rounded up to the sampler's length bucket.
    """
    longest = cfg.agent.max_prompt_tokens
    prefix = 3 * longest // 4 if prefix is None else int(prefix)
    if not 0 < prefix < longest:
        raise ValueError(f"The turn's prefix must lie in (0, {longest}) tokens, got {prefix}.")
    return prefix, learner.round_up(longest - prefix, cfg.sampler.length_bucket)


def lower_sampler(
    cfg,
    mcfg,
    mesh: Mesh,
    rows: int | None = None,
    prefill_bound: str = "capacity",
    turn_prefix: int | None = None,
    programs_: Sequence[str] = ("prefill", "decode"),
) -> dict:
    """The sampler's programs at `rows` rows (default: the rollout batch), lowered, by name.

    "prefill": a whole prompt from an empty cache; "suffix": a later turn's prefill with prefix
    reuse, `turn_shape(cfg, turn_prefix)`: each row's new tokens after its cached prefix, under
    the attention bound the sampler passes for that context (`sampler.offset_bucket`);
    "decode": `max_action_tokens` sampled tokens.

    `prefill_bound`: the prefill's static `offset_bound`. "none": every query attends to the
    whole cache in one block (no bound); "capacity": the bound the sampler passes when some row
    has a (nearly) full cache (`offset_bucket` never exceeds the capacity), the most the
    sampler's own prefills attend to: each of the query blocks (`llama._causal_blocks`) over the
    whole cache. The sampler always passes a bound (`Sampler.prefill`: `offset_bucket`), so
    "capacity" (the default) is the largest prefill a run executes; "none" is a program no run
    executes, kept to compare with reports made before the default changed.
    """
    if prefill_bound not in PREFILL_BOUNDS:
        raise ValueError(f"prefill_bound must be one of {PREFILL_BOUNDS}, got {prefill_bound!r}.")
    graphdef, params, _ = abstract_params(mcfg, mesh, builders.lora_config(cfg))
    rows = rollout_rows(cfg) if rows is None else rows
    capacity = cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens
    cache = abstract_cache(mcfg, rows, capacity, mesh)
    row_mesh = mesh if rows % mesh.shape["data"] == 0 and mesh.shape["data"] > 1 else None
    last = _abstract((rows, mcfg.vocab_size), jnp.float32, mesh, ("batch", "vocab"))
    prompt = prefill_width(cfg)
    tokens = _abstract((rows, prompt), jnp.int32, mesh, ("batch", "length"))
    num_new = _abstract((rows,), jnp.int32, mesh, ("batch",))
    prefill = programs.prefill_program(graphdef, row_mesh, donate=True)
    out = {}
    if "prefill" in programs_:
        bound = None if prefill_bound == "none" else capacity
        out["prefill"] = prefill.lower(params, cache, last, tokens, num_new, offset_bound=bound)
    if "suffix" in programs_:
        prefix, new = turn_shape(cfg, turn_prefix)
        new = min(new, cfg.sampler.prefill_chunk or new)  # A chunk of it, as the sampler runs it.
        suffix = _abstract((rows, new), jnp.int32, mesh, ("batch", "length"))
        bound = offset_bucket(prefix, capacity)
        out["suffix"] = prefill.lower(params, cache, last, suffix, num_new, offset_bound=bound)
    if "decode" not in programs_:
        return out
    decode = programs.generate_program(graphdef, row_mesh, eos_ids=(0,), pad_id=0, donate=True)
    key = _replicated(jax.eval_shape(lambda: jax.random.key(0)), mesh)
    scalar = _replicated(jax.ShapeDtypeStruct((), jnp.float32), mesh)
    out["decode"] = decode.lower(
        params,
        cache,
        last,
        key,
        scalar,
        scalar,
        num_new=cfg.agent.max_action_tokens,
        greedy=False,
        nucleus=cfg.sampler.top_p < 1.0,
    )
    return out
