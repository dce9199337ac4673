"""The command line: `python -m bpo_jax.compile --config=... --topology=...` (see the package)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from bpo_jax import cli
from bpo_jax.compile.programs import PREFILL_BOUNDS, PROGRAMS, turn_shape, validate_for_compile
from bpo_jax.compile.report import compile_report, format_report
from bpo_jax.compile.topology import parse_topology
from bpo_jax.experiment import define_config_flag, unknown_field

PROG = "python -m bpo_jax.compile"


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The command line, checked: the config validated, the slice parsed."""

    cfg: Any
    topology: str
    num_slices: int
    programs: list[str]
    sampler: str
    prefill_bound: str
    turn_prefix: int | None
    json: str | None
    fit: bool = True


def _flags(argv: Sequence[str]) -> flags.FlagValues:
    flags_ = flags.FlagValues()
    define_config_flag(flags_, sys_argv=argv)
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
    flags.DEFINE_bool(
        "fit",
        True,
        "Where the update or the prefill does not fit, compile it again at half the "
        "microbatch (train.microbatch_size) or half the prefill chunk (sampler.prefill_chunk) "
        "until it fits, and say which setting does (--nofit: report the config's own only).",
        flag_values=flags_,
    )
    return flags_


def parse_arguments(argv: Sequence[str], flags_: flags.FlagValues | None = None) -> Arguments:
    """Parses and checks `argv` (program name first) before anything is compiled.

    Raises:
      ValueError: naming the flag and its bad value (a config field, an unknown program or
        slice, a slice count below 1, a turn prefix outside the prompt, a --json folder that
        does not exist); absl's `flags.Error` for a flag that does not parse.
    """
    flags_ = flags_ or _flags(argv)
    flags_(list(argv))
    if flags_.config is None:
        raise ValueError("--config is required, e.g. --config=experiments/alfworld.py.")
    cfg = validate_for_compile(flags_.config)
    unknown = sorted(set(flags_.programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"--programs: unknown {unknown}; choose from {list(PROGRAMS)}.")
    parse_topology(flags_.topology)  # ValueError naming the known slices.
    if flags_.num_slices < 1:
        raise ValueError(f"--num_slices must be >= 1, got {flags_.num_slices}.")
    if flags_.turn_prefix is not None:
        try:
            turn_shape(cfg, flags_.turn_prefix)
        except ValueError as e:
            raise ValueError(f"--turn_prefix={flags_.turn_prefix}: {e}") from e
    if flags_.json and not Path(flags_.json).absolute().parent.is_dir():
        raise ValueError(f"--json={flags_.json}: its folder does not exist.")
    return Arguments(
        cfg,
        flags_.topology,
        flags_.num_slices,
        list(flags_.programs),
        flags_.sampler,
        flags_.prefill_bound,
        flags_.turn_prefix,
        flags_.json,
        flags_.fit,
    )


def run(args: Arguments) -> int:
    """Compiles and reports: 0 when every program fits (with `fit`: at the config's setting or
    at the one the report gives), else 1."""
    options = {k: getattr(args, k) for k in ("sampler", "prefill_bound", "turn_prefix", "fit")}
    report = compile_report(args.cfg, args.topology, args.programs, args.num_slices, **options)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(p["fits"] for p in report["programs"].values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool on `argv` (default `sys.argv`): 0 when every program fits, else 1."""
    return run(parse_arguments(list(sys.argv if argv is None else argv)))


def command_line() -> int:
    """`python -m bpo_jax.compile`: `main`, a mistake in the arguments ending in one line and
    exit status 2 (`bpo_jax.cli`) before anything is compiled."""
    argv = list(sys.argv)
    flags_ = _flags(argv)
    with cli.start_up_errors(PROG):
        try:
            args = parse_arguments(argv, flags_)
        except (flags.Error, KeyError, AttributeError) as e:
            if cli.wants_traceback(argv):
                raise
            cli.fail(unknown_field(flags_, argv) or cli.one_line(e), PROG)
    return run(args)
