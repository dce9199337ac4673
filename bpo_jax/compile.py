r"""Compile-only proofs that an experiment's programs fit a TPU slice, from any machine.

    python -m bpo_jax.compile --config=experiments/alfworld.py --topology=v5p-64 [--json=PATH]
        [--num_slices=N]  # N slices of it (multislice): the data axis over them (DCN)

lowers and compiles, for the named slice, the three programs a run spends its memory in: the
update step (`learner.make_train_step` with the clipped policy-gradient loss, at the config's
`train.minibatch_size` rows of `agent.max_prompt_tokens + agent.max_action_tokens` tokens, with
its microbatching, remat and logit chunking), and the sampler's prefill and decode (the real
`bpo_jax.sampler.programs`, at the rollout batch of `train.tasks_per_iter x train.group_size`
rows and a cache of the same length). Nothing is allocated: parameters, optimizer state, caches
and batches are `jax.ShapeDtypeStruct`s with `NamedSharding`s on a mesh of libtpu's compile-only
devices (`jax.experimental.topologies`), so a 7B model compiles for a 64-chip slice on a laptop.
XLA's own memory and cost analyses of each compiled program give the per-chip bytes (against
the chip's HBM), the FLOPs and bytes accessed, and a roofline time, max(FLOPs / peak, bytes /
bandwidth). Needs `libtpu` (requirements-dev.txt); the JAX backend of the run itself stays CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bpo_jax import config as config_lib
from bpo_jax import learner
from bpo_jax.models import config as model_config
from bpo_jax.models import factory, sharding
from bpo_jax.models.llama import KVCache, cache_axes
from bpo_jax.sampler import programs
from bpo_jax.sampler.core import offset_bucket

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation as libtpu and gcloud name it, with the facts a roofline needs.

    `cores_in_name`: TensorCores per chip counted by gcloud's accelerator-type suffix (v4 and
    v5p count cores, so v5p-64 is 32 chips; v5e and v6e count chips).
    """

    libtpu_name: str
    gcloud_prefix: str
    cores_in_name: int
    chip_config: str  # libtpu's chip config: one device per chip.
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    topologies: dict[int, str]  # chips -> libtpu topology


_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}

# Chip facts from Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4,
# /v5p, /v5e, /v6e), per chip: v4 32 GiB HBM2, 275 TFLOP/s bf16, 1,200 GB/s; v5p 95 GiB HBM2e,
# 459 TFLOP/s bf16, 2,765 GB/s; v5e 16 GiB HBM2, 197 TFLOP/s bf16, 819 GB/s; v6e (Trillium)
# 32 GiB HBM, 918 TFLOP/s bf16, 1,640 GB/s.
CHIPS = {
    "v4": Chip("v4", "v4", 2, "megacore", 32 * GiB, 275e12, 1200e9, _3D),
    "v5p": Chip("v5p", "v5p", 2, "default", 95 * GiB, 459e12, 2765e9, _3D),
    "v5e": Chip("v5e", "v5litepod", 1, "default", 16 * GiB, 197e12, 819e9, _2D),
    "v6e": Chip("v6e", "v6e", 1, "default", 32 * GiB, 918e12, 1640e9, _2D),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    accelerator_type: str
    chip: Chip
    chips: int

    @property
    def topology_name(self) -> str:
        return f"{self.chip.libtpu_name}:{self.chip.topologies[self.chips]}"


def parse_topology(accelerator_type: str) -> Slice:
    """A gcloud accelerator type (`v4-32`, `v5p-64`, `v5litepod-64`, `v6e-64`) as a `Slice`."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator_type)
    if m is None:
        raise ValueError(
            f"Unknown TPU accelerator type {accelerator_type!r}; expected gcloud's names, e.g. "
            "v4-32, v5p-64, v5litepod-64 (v5e), v6e-64."
        )
    prefix, count = m.group(1), int(m.group(2))
    chip = next(c for c in CHIPS.values() if prefix in (c.gcloud_prefix, c.libtpu_name))
    if count % chip.cores_in_name or count // chip.cores_in_name not in chip.topologies:
        sizes = sorted(n * chip.cores_in_name for n in chip.topologies)
        raise ValueError(f"No {prefix} slice of size {count}; known sizes: {sizes}.")
    return Slice(accelerator_type, chip, count // chip.cores_in_name)


def topology_devices(s: Slice, num_slices: int = 1) -> list:
    """libtpu's compile-only devices of `num_slices` such slices (multislice), one per chip."""
    from jax.experimental import topologies

    # Compile-only use touches no chip: several compiles (tests, sweeps) may load libtpu at
    # once, which its single-user lockfile would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    bounds = (1, 1, 1) if s.chips < 4 else (2, 2, 1)
    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=s.topology_name,
        chip_config_name=s.chip.chip_config,
        chips_per_host_bounds=bounds,
        num_slices=num_slices,
    )
    devices = list(desc.devices)
    if len(devices) != s.chips * num_slices:
        raise RuntimeError(
            f"libtpu gave {len(devices)} devices for {num_slices} x {s.topology_name}, not "
            f"{s.chips * num_slices}."
        )
    return devices


# ----------------------------------------------------------------------------- abstract inputs


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
    overrides = dict(
        max_seq_len=m.max_seq_len,
        dtype=config_lib.DTYPES[m.dtype],
        param_dtype=config_lib.DTYPES[m.param_dtype],
    )
    if m.preset == "tiny":
        overrides["vocab_size"] = m.tokenizer_vocab_size
    return model_config.get_preset(m.preset, **overrides)


def _abstract(shape, dtype, mesh: Mesh, axes: Sequence[str | None]):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named_sharding(mesh, axes, shape))


def abstract_params(mcfg, mesh: Mesh):
    """(graphdef, params as sharded `ShapeDtypeStruct`s, their shardings)."""
    from flax import nnx

    graphdef, state = nnx.split(factory.abstract_model(mcfg))
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
    graphdef, params, specs = abstract_params(mcfg, mesh)
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
    graphdef, params, _ = abstract_params(mcfg, mesh)
    rows = rollout_rows(cfg) if rows is None else rows
    capacity = cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens
    cache = abstract_cache(mcfg, rows, capacity, mesh)
    row_mesh = mesh if rows % mesh.shape["data"] == 0 and mesh.shape["data"] > 1 else None
    last = _abstract((rows, mcfg.vocab_size), jnp.float32, mesh, ("batch", "vocab"))
    prompt = learner.round_up(cfg.agent.max_prompt_tokens, cfg.sampler.length_bucket)
    tokens = _abstract((rows, prompt), jnp.int32, mesh, ("batch", "length"))
    num_new = _abstract((rows,), jnp.int32, mesh, ("batch",))
    prefill = programs.prefill_program(graphdef, row_mesh, donate=True)
    out = {}
    if "prefill" in programs_:
        bound = None if prefill_bound == "none" else capacity
        out["prefill"] = prefill.lower(params, cache, last, tokens, num_new, offset_bound=bound)
    if "suffix" in programs_:
        prefix, new = turn_shape(cfg, turn_prefix)
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


def model_flops(
    cfg, mcfg, program: str, chips: int, rows: int | None = None, turn_prefix: int | None = None
) -> float:
    """Per-chip FLOPs of a program from the architecture (matmuls and attention).

    XLA's cost analysis counts a loop's body once (the layer scan, the microbatch scan, the
    LM-head chunks, the decode loop), so for programs with loops its FLOPs are a lower bound;
    the roofline takes the larger of the two. Update: forward, backward (twice the forward) and,
    with `remat="full"`, the layers' forward once more; attention is causal (half the [T, T]
    products). Prefill: T tokens per row attending over the cache. Suffix: the new tokens of
    `turn_shape` per row, each attending over the prefix and the new tokens. Decode:
    `max_action_tokens` steps, each one token per row over the full cache. `rows`: the sampler's
    rows (default: the rollout batch).
    """
    d, e, v = mcfg.hidden_size, mcfg.resolved_head_dim, mcfg.vocab_size
    h, k, f, n = mcfg.num_heads, mcfg.num_kv_heads, mcfg.intermediate_size, mcfg.num_layers
    layer_params = n * (d * (h + 2 * k) * e + h * e * d + 3 * d * f)  # all layers
    rows_rollout = rollout_rows(cfg) if rows is None else rows
    capacity = cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens
    if program == "update":
        rows, t = cfg.train.minibatch_size, update_length(cfg)
        layers = 2 * layer_params * rows * t + n * 4 * h * e * rows * t * t / 2
        head = 2 * d * v * rows * t
        recompute = layers + head if cfg.model.remat == "full" else head
        total = 3 * (layers + head) + recompute
    elif program == "prefill":
        t = learner.round_up(cfg.agent.max_prompt_tokens, cfg.sampler.length_bucket)
        rows = rows_rollout
        total = 2 * layer_params * rows * t + n * 4 * h * e * rows * t * capacity + 2 * d * v * rows
    elif program == "suffix":
        prefix, t = turn_shape(cfg, turn_prefix)
        rows = rows_rollout
        attend = n * 4 * h * e * rows * t * (prefix + t)
        total = 2 * layer_params * rows * t + attend + 2 * d * v * rows
    elif program == "decode":
        rows = rows_rollout
        step = 2 * layer_params * rows + n * 4 * h * e * rows * capacity + 2 * d * v * rows
        total = step * cfg.agent.max_action_tokens
    else:
        raise ValueError(f"Unknown program {program!r}.")
    return float(total) / chips


def analyse(compiled, s: Slice, analytic_flops: float, loop_trips: int = 1) -> dict:
    """Per-chip bytes, FLOPs and roofline seconds of a compiled program.

    Args:
      compiled: the compiled program.
      s: the slice.
      analytic_flops: `model_flops` of the program.
      loop_trips: how many times the program's main loop runs, which XLA's per-iteration
        counts are multiplied by (decode: its steps).
    """
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    argument = int(mem.argument_size_in_bytes)
    temp = int(mem.temp_size_in_bytes)
    # Donated arguments alias their outputs: an updated state occupies the input's buffers.
    total = argument + int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes) + temp
    total += int(mem.generated_code_size_in_bytes)
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    compute = max(flops * loop_trips, analytic_flops) / s.chip.peak_bf16_flops
    memory = accessed * loop_trips / s.chip.hbm_bytes_per_s
    return {
        "argument_bytes": argument,
        "temp_bytes": temp,
        "total_bytes": total,
        "fits": total <= s.chip.hbm_bytes,
        "flops": flops,
        "model_flops": analytic_flops,
        "bytes_accessed": accessed,
        "roofline_seconds": max(compute, memory),
    }


_REQUIRED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\)")


def out_of_memory(error: Exception, analytic_flops: float) -> dict:
    """The report of a program XLA refused to compile for lack of HBM (RESOURCE_EXHAUSTED).

    XLA stops before it has a memory or cost analysis: the temporaries it says it needs (its
    message rounds them to 0.01 of its unit) are all there is; the other sizes are unknown (None).
    """
    m = _REQUIRED.search(str(error))
    temp = None
    if m is not None:
        temp = int(float(m.group(1)) * (1 << (10 * "KMGT".index(m.group(2)) + 10)))
    return {
        "argument_bytes": None,
        "temp_bytes": temp,
        "total_bytes": None,
        "fits": False,
        "flops": None,
        "model_flops": analytic_flops,
        "bytes_accessed": None,
        "roofline_seconds": None,
        "error": _first_line(error),
    }


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def compile_report(
    cfg,
    accelerator_type: str,
    programs_: Sequence[str] = ("update", "prefill", "decode"),
    num_slices: int = 1,
    sampler: str = "slice",
    prefill_bound: str = "capacity",
    turn_prefix: int | None = None,
) -> dict:
    """Compiles the named programs of `cfg` for `num_slices` slices; returns the JSON report.

    With several slices (gcloud's multislice: `num_slices` slices of `accelerator_type`) the
    mesh's data axis spans them over DCN (`sharding.make_mesh`); the roofline does not model
    DCN bandwidth.

    `sampler`: "slice" compiles prefill and decode over the whole mesh at the whole rollout
    batch, with the parameters in the train state's sharding: a one-process run's layout, and
    what a multi-host run with `mesh.sampler="slice"` runs (`bpo_jax.multihost.slice_sampler`: every
    host's rows in one program; its batch is hosts x the power-of-two bucket of a host's rows,
    `policy.batch_bucket`, the rollout batch itself when each host's rows are a power of two,
    as at every setting the README reports); "host" as a multi-host run with
    `mesh.sampler="host"` samples (`bpo_jax.multihost.shares`):
    on one host's own chips (`distributed.process_mesh`, e.g. 4 of a v5litepod-64's 64) at that
    host's rows (`rollout_rows`), with the parameters copied there (`distributed.to_local`)
    while the global train state (parameters and optimizer state over the slice) stays
    resident: its per-chip bytes (`resident_bytes`) count towards `fits`.

    `prefill_bound`: the prefill's attention bound (`lower_sampler`).

    With "suffix" and "decode" among the programs, `report["turn"]` estimates one agent turn
    with prefix reuse (`turn_shape(cfg, turn_prefix)`): the suffix's roofline plus the decode's,
    beside the same without reuse (the whole prompt's prefill plus the decode) when "prefill"
    was compiled too.
    """
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}.")
    if sampler not in ("slice", "host"):
        raise ValueError(f"sampler must be 'slice' or 'host', got {sampler!r}.")
    s = parse_topology(accelerator_type)
    devices = topology_devices(s, num_slices)
    chips = s.chips * num_slices
    mesh = sharding.make_mesh(cfg.mesh.axes, devices=devices, dcn_data=cfg.mesh.dcn_data)
    mcfg = model_config_of(cfg)
    # The start-up check a run makes: no large parameter left unsplit on this mesh.
    sharding.check_replication(abstract_params(mcfg, mesh)[1])
    sampler_mesh, rows, resident = mesh, rollout_rows(cfg), 0
    if sampler == "host":
        from bpo_jax.parallel import distributed

        hosts = len({d.process_index for d in devices})
        sampler_mesh = distributed.process_mesh(mesh, 0)
        rows = rollout_rows(cfg, hosts)
        with jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
            resident = bytes_per_chip(abstract_train_state(cfg, mcfg, mesh)[1])
    out = {}
    seconds = {}  # Wall seconds on this machine: lowering (all programs), then each compile.
    with jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        lowered = {}
        start = time.perf_counter()
        if "update" in programs_:
            lowered["update"] = lower_update(cfg, mcfg, mesh)
        wanted = [p for p in programs_ if p in SAMPLER_PROGRAMS]
        if wanted:
            with jax.set_mesh(sampler_mesh):
                lowered |= lower_sampler(
                    cfg, mcfg, sampler_mesh, rows, prefill_bound, turn_prefix, wanted
                )
        seconds["lower"] = time.perf_counter() - start
        _progress(f"lowered {', '.join(lowered)} in {seconds['lower']:.0f} s")
        for name in programs_:
            trips = cfg.agent.max_action_tokens if name == "decode" else 1
            on_sampler = name != "update"
            flops = model_flops(
                cfg,
                mcfg,
                name,
                sampler_mesh.size if on_sampler else chips,
                rows=rows,
                turn_prefix=turn_prefix,
            )
            start = time.perf_counter()
            try:
                compiled = lowered[name].compile()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                seconds[name] = time.perf_counter() - start
                _progress(f"{name} does not fit ({seconds[name]:.0f} s): {_first_line(e)}")
                out[name] = out_of_memory(e, flops)
                continue
            seconds[name] = time.perf_counter() - start
            _progress(f"compiled {name} in {seconds[name]:.0f} s")
            out[name] = analyse(compiled, s, flops, trips)
            if sampler == "host" and on_sampler:
                p = out[name]
                p["resident_bytes"] = resident
                p["total_bytes"] += resident
                p["fits"] = p["total_bytes"] <= s.chip.hbm_bytes
    report = {
        "topology": accelerator_type,
        "num_slices": num_slices,
        "chips": chips,
        "hbm_bytes_per_chip": s.chip.hbm_bytes,
        "mesh": dict(mesh.shape),
        "programs": out,
        "wall_seconds": seconds,
    }
    report["prefill_bound"] = prefill_bound
    roofline = {k: p.get("roofline_seconds") for k, p in out.items()}
    if roofline.get("suffix") is not None and roofline.get("decode") is not None:
        prefix, new = turn_shape(cfg, turn_prefix)
        report["turn"] = {
            "prefix_tokens": prefix,
            "new_tokens": new,
            "roofline_seconds": roofline["suffix"] + roofline["decode"],
        }
        if roofline.get("prefill") is not None:
            whole = roofline["prefill"] + roofline["decode"]
            report["turn"]["roofline_seconds_no_reuse"] = whole
    if sampler == "host":
        report["sampler"] = {
            "mode": "host",
            "mesh": dict(sampler_mesh.shape),
            "rows": rows,
            "resident_bytes": resident,
        }
    return report


def _progress(message: str) -> None:
    print(f"[compile] {message}", file=sys.stderr, flush=True)


def format_report(report: dict) -> str:
    hbm = report["hbm_bytes_per_chip"]
    lines = [
        f"{report['num_slices']} x {report['topology']}: {report['chips']} chips, "
        f"{hbm / GiB:.1f} GiB HBM per chip, "
        f"mesh {report['mesh']}",
    ]
    if "sampler" in report:
        r = report["sampler"]
        lines.append(
            f"sampler on one host: mesh {r['mesh']}, {r['rows']} rows, with the train state's "
            f"{r['resident_bytes'] / GiB:.2f} GiB per chip resident (in its totals)"
        )
    lines += [
        f"{'program':<8} {'args GiB':>9} {'temp GiB':>9} {'total GiB':>10} {'fits':>5} "
        f"{'TFLOP':>9} {'model TFLOP':>12} {'GB accessed':>12} {'roofline s':>11}",
    ]
    for name, p in report["programs"].items():
        if "error" in p:
            lines.append(f"{name:<8} does NOT fit: {p['error']}")
            continue
        lines.append(
            f"{name:<8} {p['argument_bytes'] / GiB:>9.2f} {p['temp_bytes'] / GiB:>9.2f} "
            f"{p['total_bytes'] / GiB:>10.2f} {'yes' if p['fits'] else 'NO':>5} "
            f"{p['flops'] / 1e12:>9.2f} {p['model_flops'] / 1e12:>12.2f} "
            f"{p['bytes_accessed'] / 1e9:>12.2f} "
            f"{p['roofline_seconds']:>11.4f}"
        )
    if "turn" in report:
        t = report["turn"]
        line = (
            f"one turn with prefix reuse ({t['prefix_tokens']} tokens cached, {t['new_tokens']} "
            f"new, then the action): roofline {t['roofline_seconds']:.4f} s"
        )
        if "roofline_seconds_no_reuse" in t:
            line += f" ({t['roofline_seconds_no_reuse']:.4f} s prefilling the whole prompt)"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from absl import flags
    from ml_collections import config_flags

    flags_ = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "Experiment config file.", flag_values=flags_)
    flags.DEFINE_string("topology", "v5p-64", "gcloud accelerator type.", flag_values=flags_)
    flags.DEFINE_integer(
        "num_slices", 1, "Slices of --topology (multislice over DCN).", flag_values=flags_
    )
    flags.DEFINE_string("json", None, "Write the report as JSON here.", flag_values=flags_)
    flags.DEFINE_list(
        "programs",
        ["update", "prefill", "decode"],
        f"Programs to compile, of {', '.join(PROGRAMS)} (suffix: a later turn's prefill with "
        "prefix reuse; with decode, the report estimates a turn).",
        flag_values=flags_,
    )
    flags.DEFINE_integer(
        "turn_prefix",
        None,
        "suffix: tokens of the prompt a turn continues from cache (default 3/4 of "
        "agent.max_prompt_tokens).",
        flag_values=flags_,
    )
    flags.DEFINE_enum(
        "sampler",
        "slice",
        ["slice", "host"],
        "slice: prefill and decode over the whole slice at the whole rollout batch, parameters "
        "in the train sharding (what --config.mesh.sampler=slice runs); host: on one host's "
        "chips at its share of the tasks, as --config.mesh.sampler=host runs.",
        flag_values=flags_,
    )
    flags.DEFINE_enum(
        "prefill_bound",
        "capacity",
        list(PREFILL_BOUNDS),
        "The prefill's static attention bound: capacity (the largest the sampler passes: each "
        "query block over the whole cache) or none (all queries over the whole cache in one "
        "block, a program no run executes; reports before 2026-12-02 used it).",
        flag_values=flags_,
    )
    flags_(list(sys.argv if argv is None else argv))
    cfg = validate_for_compile(flags_.config)
    unknown = sorted(set(flags_.programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"--programs: unknown {unknown}; choose from {list(PROGRAMS)}.")
    report = compile_report(
        cfg,
        flags_.topology,
        flags_.programs,
        flags_.num_slices,
        sampler=flags_.sampler,
        prefill_bound=flags_.prefill_bound,
        turn_prefix=flags_.turn_prefix,
    )
    print(format_report(report))
    if flags_.json:
        Path(flags_.json).write_text(json.dumps(report, indent=2))
    return 0 if all(p["fits"] for p in report["programs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
