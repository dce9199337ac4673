"""The report of a compile: XLA's memory and cost analyses, the analytic FLOPs, the roofline.

`compile_report` compiles the programs of `programs` for a slice and reads each one's per-chip
bytes, FLOPs and bytes accessed; `format_report` prints the report as a table.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Sequence

import jax

from bpo_jax import learner
from bpo_jax.compile.programs import (
    SAMPLER_PROGRAMS,
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
)
from bpo_jax.compile.topology import GiB, Slice, parse_topology, topology_devices
from bpo_jax.learner.host import batch_devices
from bpo_jax.models import sharding


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
    fit: bool = False,
) -> dict:
    """Compiles the named programs of `cfg` for `num_slices` slices; returns the JSON report.

    `fit`: where the update or the prefill does not fit, compile it again at half the
    microbatch (`train.microbatch_size`: gradient accumulation, the same update) or half the
    prefill chunk (`sampler.prefill_chunk`: the same contexts), until it fits or cannot be
    halved (`fit_search`); the report gives the setting that fits and what was tried.

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

        def compiled_report(name, cfg_, lowered_):
            on_sampler = name != "update"
            new = turn_shape(cfg_, turn_prefix)[1] if name == "suffix" else 0
            trips = {
                "decode": cfg_.agent.max_action_tokens,
                "prefill": prefill_calls(cfg_),
                "suffix": -(-new // (cfg_.sampler.prefill_chunk or new or 1)),
            }
            # The prefill's columns per call, where a prompt runs in chunks.
            chunked = name == "prefill" and cfg_.sampler.prefill_chunk
            chunk = {"prefill_chunk": prefill_width(cfg_)} if chunked else {}
            flops = model_flops(
                cfg_,
                mcfg,
                name,
                sampler_mesh.size if on_sampler else chips,
                rows=rows,
                turn_prefix=turn_prefix,
            )
            start = time.perf_counter()
            try:
                compiled = lowered_.compile()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
                _progress(f"{name} does not fit ({seconds[name]:.0f} s): {_first_line(e)}")
                return out_of_memory(e, flops) | chunk
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
            _progress(f"compiled {name} in {seconds[name]:.0f} s")
            p = analyse(compiled, s, flops, trips.get(name, 1)) | chunk
            if sampler == "host" and on_sampler:
                p["resident_bytes"] = resident
                p["total_bytes"] += resident
                p["fits"] = p["total_bytes"] <= s.chip.hbm_bytes
            return p

        def lower_at(name, cfg_):
            if name == "update":
                return lower_update(cfg_, mcfg, mesh)
            with jax.set_mesh(sampler_mesh):
                return lower_sampler(
                    cfg_, mcfg, sampler_mesh, rows, prefill_bound, turn_prefix, [name]
                )[name]

        for name in programs_:
            out[name] = compiled_report(name, cfg, lowered[name])
            if fit and not out[name]["fits"]:
                out[name] = fit_search(
                    name,
                    cfg,
                    out[name],
                    lambda c, n=name: compiled_report(n, c, lower_at(n, c)),
                    batch_devices(mesh, cfg),
                )
                if "setting" in out[name]:
                    _progress(f"{name} fits with {_overrides(out[name]['setting'])}")
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


def fit_search(name: str, cfg, first: dict, compile_at, row_devices: int = 1) -> dict:
    """The update's microbatch or the prefill's chunk at which `name` fits, by
    `compile_at(cfg)` (a report), trying at each step the largest valid setting at most half
    the last; `first` is its report at `cfg`'s own setting.

    Returns the fitting report with `setting` (the config fields that make it fit) and `tried`
    (each setting before it: its per-chip bytes or XLA's refusal), or `first` with `tried`
    when nothing halves to a fit. A microbatch stays a divisor of the minibatch and at least
    the `row_devices` its rows split over; a chunk stays a multiple of `sampler.length_bucket`.
    """
    tried = []

    def attempt(setting: dict, report: dict) -> None:
        tried.append(
            {
                "setting": setting,
                "fits": report["fits"],
                "total_bytes": report.get("total_bytes"),
                "temp_bytes": report.get("temp_bytes"),
            }
        )

    t, sp = cfg.train, cfg.sampler
    if name == "update":
        field, current = "train.microbatch_size", t.microbatch_size or t.minibatch_size
        # Rows split evenly over the devices (else they are replicated: warn_if_rows_replicated)
        # and microbatches that divide the minibatch.
        valid = [
            n
            for n in range(current - 1, 0, -1)
            if n % row_devices == 0 and t.minibatch_size % n == 0
        ]
        apply = lambda n: dataclasses.replace(  # noqa: E731
            cfg, train=dataclasses.replace(t, microbatch_size=n)
        )
    elif name == "prefill":
        field, current = "sampler.prefill_chunk", prefill_width(cfg)
        valid = list(range(current - sp.length_bucket, 0, -sp.length_bucket))
        apply = lambda n: dataclasses.replace(  # noqa: E731
            cfg, sampler=dataclasses.replace(sp, prefill_chunk=n)
        )
    else:
        return {**first, "tried": []}  # Its rows and cache are the experiment's own.
    attempt({field: current}, first)
    while True:
        # The largest valid setting at most half the last one tried.
        below = [n for n in valid if n <= current // 2]
        if not below:
            return {**first, "tried": tried}
        current = below[0]
        report = compile_at(apply(current))
        if report["fits"]:
            return {**report, "setting": {field: current}, "tried": tried}
        attempt({field: current}, report)


def _tried(p: dict) -> str:
    """What `fit_search` tried before the setting that fits (or that nothing fit)."""
    parts = []
    for t in p["tried"]:
        ((field, value),) = t["setting"].items()
        if t["total_bytes"] is not None:
            size = f"{t['total_bytes'] / GiB:.2f} GiB"
        elif t["temp_bytes"] is not None:
            size = f"does NOT fit, {t['temp_bytes'] / GiB:.2f} GiB of temporaries"
        else:
            size = "does NOT fit"
        parts.append(f"{field}={value}: {size}")
    head = f"fits at {_overrides(p['setting'])}" if "setting" in p else "no halving fits"
    return f"{head} (tried {'; '.join(parts)})"


def _overrides(setting: dict) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in setting.items())


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
    settings = {}
    for name, p in report["programs"].items():
        if p.get("tried"):
            lines.append(f"  {name}: {_tried(p)}")
        settings |= p.get("setting", {})
    if settings:
        lines.append(f"fits with {_overrides(settings)}")
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
