r"""Compile-only proofs that an experiment's programs fit a TPU slice, from any machine.

May import: learner, models, parallel, run, sampler.

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
bandwidth). Needs `libtpu`, the `tpu-compile` extra (`pip install -e .[tpu-compile]`, or
`bash scripts/setup.sh tpu-compile`); the JAX backend of the run itself stays CPU.

Modules: `topology` (TPU generations, gcloud's slice names, libtpu's compile-only devices),
`programs` (the abstract inputs and the lowered programs), `report` (the compile, XLA's analyses,
the analytic FLOPs and roofline, the table), `cli` (the flags; `__main__` runs it).
"""

from bpo_jax.compile.cli import main
from bpo_jax.compile.programs import (
    PREFILL_BOUNDS,
    PROGRAMS,
    SAMPLER_PROGRAMS,
    abstract_cache,
    abstract_params,
    abstract_train_state,
    bytes_per_chip,
    lower_sampler,
    lower_update,
    model_config_of,
    prefill_calls,
    prefill_width,
    rollout_rows,
    turn_shape,
    update_length,
    validate_for_compile,
)
from bpo_jax.compile.report import (
    analyse,
    compile_report,
    fit_search,
    format_report,
    model_flops,
    out_of_memory,
)
from bpo_jax.compile.topology import CHIPS, Chip, GiB, Slice, parse_topology, topology_devices

__all__ = [
    "CHIPS",
    "PREFILL_BOUNDS",
    "PROGRAMS",
    "SAMPLER_PROGRAMS",
    "Chip",
    "GiB",
    "Slice",
    "abstract_cache",
    "abstract_params",
    "abstract_train_state",
    "analyse",
    "bytes_per_chip",
    "compile_report",
    "fit_search",
    "format_report",
    "lower_sampler",
    "lower_update",
    "main",
    "model_config_of",
    "model_flops",
    "out_of_memory",
    "parse_topology",
    "prefill_calls",
    "prefill_width",
    "rollout_rows",
    "topology_devices",
    "turn_shape",
    "update_length",
    "validate_for_compile",
]
