"""A sweep's plan: the sweep file's `Sweep` (algorithms, seeds, ablations, probe), and the runs it
expands to, each with its name and its main job's flags.

Nothing here starts a process: `bpo_jax.study.sweep_run` runs the plan, `bpo_jax.study.sweep`
is the command (its docstring says what a sweep does).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import flags

from bpo_jax.experiment import define_config_flag, load_experiment, unknown_field


@dataclasses.dataclass(frozen=True)
class Ablation:
    """A named set of config overrides, e.g. `Ablation("k4", {"rollout.num_branches": 4})`.

    Attributes:
      name: appended to the algorithm in run names (`bpo_k4/seed_0`); letters, digits, `_`.
      overrides: config field (dotted, below `config.`) -> value.
      algos: the algorithms it applies to; empty = all of the sweep's.
    """

    name: str
    overrides: Mapping[str, Any]
    algos: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Probe:
    """The gradient-variance probe (`bpo_jax.study.probe`) of a sweep's start policy: every
    algorithm's gradient at the same parameters, the first algorithm the reference.

    Attributes:
      algos: the algorithms probed; the first is the reference (RLOO: no std normalisation).
      batches: recorded rollout batches per algorithm.
      name: '' for the probe of the sweep's own configuration (`probe/shared`, or
        `probe/seed_<n>`); else a probe with its own `overrides` (`probe/<name>`, or
        `probe/<name>_seed_<n>`), e.g. a fixed design a pilot chose.
      overrides: config overrides on top of the sweep's (field -> value).
      variants: tree estimators also applied to the first tree algorithm's forests (the
        probe's `--variants`: the same trees under another baseline).
      predicted: the design's predicted BPO/RLOO trace ratio (from a pilot), for the record.
      reason: why this design, for the record (probe.json's `design`).
    """

    algos: tuple[str, ...] = ("rloo", "bpo")
    batches: int = 64
    name: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    variants: tuple[str, ...] = ()
    predicted: float | None = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What a sweep file's `get_sweep()` returns.

    Attributes:
      config: experiment file and variants, relative to the working directory,
        e.g. 'experiments/alfworld.py:cpu' (the sweep adds `algo=<name>` to the variants).
      algos: algorithm names (config.ALGOS).
      seeds: `config.seed` values; every algorithm runs every seed (paired seeds).
      overrides: config overrides every run gets (field -> value).
      ablations: extra run sets beside the plain algorithms.
      shared_bc: behaviour cloning runs once per seed (`bc/seed_<n>`, no RL), and every run of
        that seed starts RL from its policy (`init_from`): paired seeds share their start.
      bc_once: with shared_bc, one behaviour cloning run (`bc/shared`, at the first seed) starts
        every run of every seed.
      share_evals: runs share evaluation results (`eval.cache_dir` in the sweep's folder).
      probe: with shared_bc, the probe of each start (`probe/shared`, or `probe/seed_<n>`),
        run as soon as its start is done; its `probe.json` is Table 2's record. A tuple: each
        of them (their names differ).
    """

    config: str
    algos: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ablations: tuple[Ablation, ...] = ()
    shared_bc: bool = False
    bc_once: bool = False
    share_evals: bool = False
    probe: Probe | tuple[Probe, ...] | None = None

    @property
    def probes(self) -> tuple[Probe, ...]:
        if self.probe is None:
            return ()
        return self.probe if isinstance(self.probe, tuple) else (self.probe,)


# The shared behaviour-cloning run of a seed trains no RL iterations, and its own evaluations
# are not results (every run that starts from it evaluates that policy before RL itself): one
# training game keeps them short.
BC_OVERRIDES = {"train.iterations": 0, "env.eval_split": "train", "eval.num_tasks": 1}
BC_GROUP = "bc"
BC_SHARED = f"{BC_GROUP}/shared"  # The one start of a `bc_once` sweep.
EVAL_CACHE = "eval_cache"  # The sweep folder's shared evaluations (`share_evals`).
PROBE_GROUP = "probe"  # The probes of the starts (`Sweep.probe`).


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its name, and the flags of its main job (without `--workdir`)."""

    name: str
    algo: str
    seed: int
    ablation: str  # '' for the plain algorithm.
    config: str  # --config value, variants included.
    overrides: tuple[str, ...]  # --config.<field>=<value> flags.
    init_from: str = ""  # Name of the run (in the same sweep) whose policy RL starts from.
    share_evals: bool = False  # Evaluations go through the sweep's cache (`EVAL_CACHE`).
    probe_flags: tuple[str, ...] = ()  # Set for a probe (`bpo_jax.study.probe`), not a main job.

    @property
    def is_probe(self) -> bool:
        return bool(self.probe_flags)

    def command(
        self, workdir: Path, module: str = "bpo_jax.main", probe_module: str = "bpo_jax.study.probe"
    ) -> list[str]:
        run_dir = workdir / self.name
        module = probe_module if self.is_probe else module
        init = [f"--config.init_from={workdir / self.init_from}"] if self.init_from else []
        if self.share_evals:
            init.append(f"--config.eval.cache_dir={workdir / EVAL_CACHE}")
        return [
            sys.executable,
            "-m",
            module,
            f"--config={self.config}",
            f"--workdir={run_dir}",
            *self.overrides,
            *init,
            *self.probe_flags,
        ]


def format_value(value: Any) -> str:
    """A config value as config_flags parses it from the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    if isinstance(value, (int, float, str)):
        return str(value) if isinstance(value, str) else repr(value)
    raise TypeError(f"override value {value!r} of type {type(value).__name__} is not a flag value")


def _check_name(name: str, what: str) -> None:
    if not name or not all(ch.isalnum() or ch == "_" for ch in name):
        raise ValueError(f"{what} {name!r} must be letters, digits and '_' (it names a folder).")


def expand(sweep: Sweep) -> list[Run]:
    """The sweep's runs, seed by seed, then algorithm, then ablation, with unique names."""
    if not sweep.algos or not sweep.seeds:
        raise ValueError(f"a sweep needs algorithms and seeds, got {sweep.algos}, {sweep.seeds}.")
    path, _, variants = sweep.config.partition(":")
    if "algo=" in variants:
        raise ValueError(
            f"sweep config {sweep.config!r} sets algo= itself; list algorithms in Sweep.algos."
        )
    for algo in sweep.algos:
        _check_name(algo, "algorithm")
    for ab in sweep.ablations:
        _check_name(ab.name, "ablation name")
        unknown = set(ab.algos) - set(sweep.algos)
        if unknown:
            raise ValueError(
                f"ablation {ab.name!r} names algorithms {sorted(unknown)} "
                f"that the sweep does not run ({sweep.algos})."
            )
    sets = [("", {}, ())] + [(ab.name, dict(ab.overrides), ab.algos) for ab in sweep.ablations]
    for own in (BC_GROUP, PROBE_GROUP):
        if sweep.shared_bc and own in sweep.algos:
            raise ValueError(f"with shared_bc the run group {own!r} is the sweep's own.")
    if "init_from" in sweep.overrides:
        raise ValueError("overrides must not set init_from; use Sweep.shared_bc.")
    if sweep.bc_once and not sweep.shared_bc:
        raise ValueError("Sweep.bc_once needs shared_bc=True (it says how the start is shared).")
    if sweep.share_evals and "eval.cache_dir" in sweep.overrides:
        raise ValueError("overrides must not set eval.cache_dir; share_evals sets the sweep's.")
    for pr in sweep.probes:
        if not sweep.shared_bc:
            raise ValueError("Sweep.probe needs shared_bc=True: it probes the shared start.")
        if not pr.algos or pr.batches < 2:
            raise ValueError(f"Sweep.probe needs algorithms and >= 2 batches: {pr}.")
    if len({pr.name for pr in sweep.probes}) < len(sweep.probes):
        raise ValueError("Sweep.probe: two probes of the same name.")
    runs, names = [], set()
    shares = sweep.share_evals

    def bc_run(name: str, seed: int) -> Run:
        fields = {**dict(sweep.overrides), **BC_OVERRIDES, "seed": int(seed)}
        flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
        config = f"{path}:{variants + ',' if variants else ''}algo={sweep.algos[0]}"
        names.add(name)
        return Run(name, BC_GROUP, int(seed), "", config, flags_, share_evals=shares)

    def probe_run(start: str, seed: int, pr: Probe) -> Run:
        fields = {**dict(sweep.overrides), **dict(pr.overrides), "seed": int(seed)}
        flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
        config = f"{path}:{variants + ',' if variants else ''}algo={sweep.algos[0]}"
        own = start.split("/", 1)[1]
        if pr.name:
            own = pr.name if start == BC_SHARED else f"{pr.name}_{own}"
        name = f"{PROBE_GROUP}/{own}"
        probe = (f"--algos={','.join(pr.algos)}", f"--batches={pr.batches}")
        if pr.variants:
            probe += (f"--variants={','.join(pr.variants)}",)
        if pr.predicted is not None:
            probe += (f"--predicted={pr.predicted}",)
        if pr.reason:
            probe += (f"--design_reason={pr.reason}",)
        names.add(name)
        return Run(name, PROBE_GROUP, int(seed), "", config, flags_, start, probe_flags=probe)

    if sweep.bc_once:
        runs.append(bc_run(BC_SHARED, sweep.seeds[0]))
        runs += [probe_run(BC_SHARED, sweep.seeds[0], pr) for pr in sweep.probes]
    for seed in sweep.seeds:
        bc_name = BC_SHARED if sweep.bc_once else ""
        if sweep.shared_bc and not sweep.bc_once:
            bc_name = f"{BC_GROUP}/seed_{seed}"
            runs.append(bc_run(bc_name, seed))
            runs += [probe_run(bc_name, seed, pr) for pr in sweep.probes]
        for algo in sweep.algos:
            for ab_name, ab_overrides, ab_algos in sets:
                if ab_algos and algo not in ab_algos:
                    continue
                name = f"{algo}_{ab_name}/seed_{seed}" if ab_name else f"{algo}/seed_{seed}"
                if name in names:
                    raise ValueError(
                        f"run name {name!r} twice: seeds and ablations must be unique."
                    )
                names.add(name)
                fields = {**dict(sweep.overrides), **ab_overrides, "seed": int(seed)}
                if "train.algo" in fields:
                    raise ValueError("overrides must not set train.algo; list it in Sweep.algos.")
                flags_ = tuple(f"--config.{k}={format_value(v)}" for k, v in fields.items())
                config = f"{path}:{variants + ',' if variants else ''}algo={algo}"
                runs.append(Run(name, algo, int(seed), ab_name, config, flags_, bc_name, shares))
    return runs


def load_sweep(path: str | Path) -> Sweep:
    """Imports a sweep file and returns its `get_sweep()`."""
    module = load_experiment(path)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"sweep file {path} defines no get_sweep().")
    sweep = module.get_sweep()
    if not isinstance(sweep, Sweep):
        raise TypeError(
            f"{path}: get_sweep() returned {type(sweep).__name__}, not bpo_jax.study.sweep.Sweep."
        )
    return sweep


def resolve_config(run: Run):
    """The run's ConfigDict, parsed exactly as the main job parses its flags.

    Raises:
      ValueError: naming the run and what in its config or overrides the parse refused (a
        field the experiment does not have, a value of the wrong type, a bad variant).
    """
    argv = ["sweep", f"--config={run.config}", *run.overrides]
    fv = flags.FlagValues()
    define_config_flag(fv, sys_argv=argv)
    try:
        fv(argv)
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
        why = unknown_field(fv, argv) or " ".join(str(e.args[0] if e.args else e).split())
        raise ValueError(f"sweep run {run.name}: {why}") from e
    return fv.config
