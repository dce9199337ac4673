"""The command line: `python -m bpo_jax.compile --config=... --topology=...` (see the package)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bpo_jax.compile.programs import PREFILL_BOUNDS, PROGRAMS, validate_for_compile
from bpo_jax.compile.report import compile_report, format_report


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool on `argv` (default `sys.argv`): 0 when every program fits, else 1."""
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
