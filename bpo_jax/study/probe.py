r"""Gradient-variance probe: how noisy is each estimator's policy gradient at matched spend?

At fixed parameters, for every algorithm, M independent rollout batches of the same tasks are
played; each batch gives one gradient per task (the training loss's gradient over that task's
sequences, at ratio 1), and the batch gradient is their mean. Reported per algorithm, against
the reference (the first algorithm, `rloo` by default, whose estimator does not rescale the
gradient as GRPO's std normalisation does):
  - `trace_var`: `E||g - E g||^2` of the batch gradient (the trace of its covariance; unbiased
    over M), its ratio to the reference and a 95% percentile bootstrap CI of the ratio (each
    algorithm's batches resampled on their own);
  - `per_task`: the same per task (a task's gradient over the M batches), ratios and CIs;
  - `norm_var`, `noise_to_signal`, `mean_grad_norm`, as before.

Matched spend: the reference's batches are played first; its measured mean cost per task (in
`rollout.budget_unit`) becomes the explicit budget of every tree algorithm, and its episodes
warm the length model and the entropy threshold. Tree algorithms then play `warmup_batches`
unrecorded batches (the branch rule's rate moves towards spending the budget) before their M.
The realised spend ratio (the algorithm's mean cost per task over the reference's) is reported
per algorithm and per task; outside [0.95, 1.05] it is flagged (`spend_warning`, and the
`warnings` of probe.json), because a ratio
at unequal spend says little about the estimator.

A model's gradient is kept as a count sketch of `sketch_dim` coordinates (a random signed
hash of the parameters: inner products and squared norms are unbiased, with a relative error
of about sqrt(2 / sketch_dim)); `exact_trace_var` is the exact batch-level trace, streamed.
M = 64 batches by default: with M = 6, 95% of estimates of a true ratio of 1.34 fall in
[0.63, 2.79]; with M = 64, in [1.09, 1.64] (issue 13).

  python -m bpo_jax.study.probe --config=experiments/alfworld.py:cpu --workdir=runs/alfworld_cpu \
      --algos=rloo,bpo --batches=64

reads the run's latest checkpoint (the policy after BC/RL), writes `probe.json` in the workdir
and the `probe/*` ratios into its metrics, and prints one line per recorded batch. Each recorded
batch is kept in `probe_batches/` as it finishes (`ProbeStore`): re-running an interrupted probe
resumes after its last batch. A workdir without a checkpoint probes the run that
`--config.init_from` names (a sweep's probe of its behaviour-cloning start, `Sweep.probe`), and
gets the probe's `config.json` (the record `bpo_jax.study.tables` reads the seed from).

`run_probe` takes any policy and gradient function: tests/test_probe.py runs it on the tabular
MDPs with an exact softmax-table gradient.

The sampling (batches, gradients, `ProbeStore`) is `bpo_jax.study.probe_sample`, the statistics
and the report `bpo_jax.study.probe_stats`; this module is the probe's flow and its command.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import numpy as np

from bpo_jax import cli, learner
from bpo_jax.algorithms import ALGORITHMS
from bpo_jax.builders import make_agent, make_critic
from bpo_jax.config import ExperimentConfig, validate
from bpo_jax.io import files
from bpo_jax.parallel import platforms
from bpo_jax.rollout.design import Design, parse_steps
from bpo_jax.study.probe_sample import (
    BatchSampler,
    ModelGradients,
    ProbeStore,
    batch_gradient,
    count_sketch,
    make_grad_fn,
)
from bpo_jax.study.probe_stats import StreamedTrace, add_ratios, algorithm_statistics, write_report

# What tests and callers use from the probe's module.
__all__ = [
    "ModelGradients",
    "ProbeStore",
    "StreamedTrace",
    "batch_gradient",
    "count_sketch",
    "make_grad_fn",
    "run_probe",
]


def run_probe(
    pool,
    policy,
    tasks,
    cfg: ExperimentConfig,
    algos,
    num_batches: int,
    rng,
    gradients,
    *,
    encode=None,
    critic_for=None,
    params=None,
    warmup_batches: int = 2,
    num_resamples: int = 2000,
    seed: int = 0,
    store: ProbeStore | None = None,
    progress=None,
    variants: Sequence[str] = (),
) -> dict:
    """Plays `num_batches` recorded batches per algorithm at matched spend; returns the stats.

    Args:
      pool, policy, tasks: what `play_forest` plays (one batch = every task once).
      cfg: the experiment; `train.algo` is replaced by each of `algos`.
      algos: algorithm names; the first is the reference (its measured spend sets the trees'
        budget).
      num_batches: M, batches recorded per algorithm (>= 2).
      rng: a JAX key.
      gradients: `fn(forest, adv, weights, cfg) -> float[num_tasks, D]`, each task's gradient
        (flattened or sketched; `ModelGradients` for a language model). It may set
        `exact_batch` (a pytree) for the streamed exact trace.
      encode: the prompt encoder (default: the agent's, from `policy.tokenizer` and cfg).
      critic_for: `fn(cfg) -> critic` for algorithms that need one (PPO).
      params: the parameters the critic reads.
      warmup_batches: unrecorded batches a tree algorithm plays first (rate adaptation).
      num_resamples, seed: the bootstrap's.
      store: where recorded batches are kept as they finish; a probe that finds batches there
        resumes after them (`ProbeStore`).
      progress: `fn(line)` called once per recorded batch (seconds, spend, leaves).
      variants: tree algorithms whose estimators are also applied to the first tree
        algorithm's forests (`bpo_traj`, `bpo_shrink`: the same trees and spend, another
        baseline), reported like the others and marked `same_forests_as`.

    Returns:
      {algo: statistics}; `spend_warning` is set where the spend is not matched.
    """
    if len(algos) < 1 or any(a not in ALGORITHMS for a in (*algos, *variants)):
        raise ValueError(f"algos must name algorithms in {sorted(ALGORITHMS)}, got {algos}.")
    trees = [a for a in algos if ALGORITHMS[a].branches]
    if variants and (not trees or not all(ALGORITHMS[v].branches for v in variants)):
        raise ValueError(f"variants {variants} need tree algorithms, and one in algos {algos}.")
    if set(variants) & set(algos):
        raise ValueError(f"variants {variants} are played on their own in algos {algos}.")
    if num_batches < 2:
        raise ValueError(f"num_batches must be >= 2 for a variance, got {num_batches}.")
    if encode is None:  # The run's own turn format (tiny or chat).
        encode = make_agent(cfg, policy.tokenizer)
    boot = np.random.default_rng(seed)
    sampler = BatchSampler(
        pool,
        policy,
        encode,
        tasks,
        cfg,
        rng,
        gradients,
        critic_for=critic_for,
        params=params,
        warmup_batches=warmup_batches,
        store=store,
        progress=progress,
    )
    results, grams, per_task_grams = {}, {}, {}
    budget = None  # The reference's measured cost per task: the trees' budget.
    for ai, algo in enumerate(algos):
        acfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, algo=algo))
        matched = budget if ALGORITHMS[algo].branches else None
        if matched is not None:
            acfg = dataclasses.replace(
                acfg, rollout=dataclasses.replace(cfg.rollout, budget=matched)
            )
        own = tuple(variants) if trees and algo == trees[0] else ()
        recorded = sampler.record(ai, algo, acfg, num_batches, matched, own)
        results[algo], grams[algo], per_task_grams[algo] = algorithm_statistics(
            algo, algos[0], recorded, budget, matched
        )
        for v, rec in recorded.variants.items():
            results[v], grams[v], per_task_grams[v] = algorithm_statistics(
                v, algos[0], rec, budget, matched
            )
            results[v]["same_forests_as"] = algo
        if ai == 0:
            budget = results[algo]["task_cost_mean"]
    add_ratios(results, grams, per_task_grams, [*algos, *variants], boot, num_resamples)
    return results


def _width(params) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, leaf in leaves:
        if "embed_tokens" in jax.tree_util.keystr(path):
            return int(leaf.shape[-1])
    raise ValueError("Cannot find the embedding to size the value head.")


PROG = "python -m bpo_jax.study.probe"


def check_arguments(config, workdir: str, algos: str, batches: int, variants: Sequence[str] = ()):
    """The command line's mistakes, before any model is built: a config field, an unknown
    algorithm, too few batches, a --workdir (or the run `init_from` names) without the trained
    policy it reads. Returns the validated config and the algorithms.

    Raises:
      ValueError: naming the flag or field and its value.
    """
    cfg = validate(config)
    names = [a.strip() for a in algos.split(",") if a.strip()]
    unknown = sorted(set(names) - set(ALGORITHMS))
    if not names or unknown:
        raise ValueError(
            f"--algos={algos}: name algorithms of {sorted(ALGORITHMS)}, comma-separated (the "
            f"first is the reference){f'; unknown: {unknown}' if unknown else ''}."
        )
    if batches < 2:
        raise ValueError(f"--batches must be >= 2 for a variance, got {batches}.")
    bad = [v for v in variants if v not in ALGORITHMS or not ALGORITHMS[v].branches or v in names]
    if bad or (variants and not any(ALGORITHMS[a].branches for a in names)):
        raise ValueError(
            f"--variants={','.join(variants)}: name tree algorithms not in --algos, applied to "
            f"the first tree algorithm of --algos ({names}){f'; not usable: {bad}' if bad else ''}."
        )
    source = files.as_path(workdir)
    if not (source / "checkpoints").is_dir() and cfg.init_from:
        source = files.as_path(cfg.init_from)
    if not (source / "checkpoints").is_dir():
        raise ValueError(
            f"--workdir={workdir}: no checkpoints/ in {source}; the probe reads a trained run's "
            "policy (train first, or set config.init_from to a run that has one)."
        )
    return cfg, names


@dataclasses.dataclass
class Start:
    """A trained run's policy at its latest checkpoint, as a probe or a pilot plays it."""

    tokenizer: object
    graphdef: object
    params: object
    step: int
    policy: object


def policy_source(cfg: ExperimentConfig, workdir) -> object:
    """The run whose policy is read: the workdir's own, else (a sweep's probe of its start, in a
    folder of its own) the run `init_from` names."""
    workdir = files.as_path(workdir)
    if not (workdir / "checkpoints").is_dir() and cfg.init_from:
        return files.as_path(cfg.init_from)
    return workdir


def load_start(cfg: ExperimentConfig, source, mesh) -> Start:
    """The policy of the run at `source` (inside `jax.set_mesh(mesh)` and the axis rules)."""
    from flax import nnx

    from bpo_jax import builders
    from bpo_jax.io.checkpoint import Checkpointer
    from bpo_jax.run_state import initial_state

    if not (cfg.model.tokenizer or cfg.model.hf_checkpoint or cfg.model.gguf):
        if not (source / "tokenizer.model").exists():
            raise FileNotFoundError(f"No tokenizer.model in {source}: train first.")
    tokenizer = builders.build_tokenizer(cfg, source, demos=[])
    mcfg, model = builders.build_model(cfg, tokenizer, mesh)
    graphdef, params = nnx.split(model)
    ckpt = Checkpointer(source / "checkpoints")
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"No checkpoint in {source / 'checkpoints'}: train first.")
    # The run's own state layout (critic and KL reference included), restored as it was saved.
    critic = builders.make_critic(cfg, graphdef, mcfg.hidden_size, tokenizer.pad_id)
    optimizer = learner.make_optimizer(1.0, 0.0, 0.9, 0.999, cfg.train.grad_clip)
    state = initial_state(cfg, params, optimizer, critic).restore(ckpt)
    ckpt.close()
    params = state.train.params
    policy = builders.make_policy(cfg, graphdef, params, tokenizer, mcfg, mesh)
    return Start(tokenizer, graphdef, params, int(state.step), policy)


def design_record(cfg: ExperimentConfig, predicted: float | None, reason: str = "") -> dict | None:
    """A fixed design's record (`rollout.selector=steps`): its tree, the first-order model's
    predicted BPO/RLOO trace (from a pilot, `bpo_jax.study.pilot`) and where that came from."""
    r = cfg.rollout
    if r.selector != "steps":
        return None
    design = Design(r.root_group, r.num_branches, parse_steps(r.branch_steps))
    out = {"tree": design.tree, "group_size": cfg.train.group_size, "predicted_ratio": predicted}
    return out | ({"reason": reason} if reason else {})


def main(argv):
    from absl import flags
    from absl import logging as absl_logging

    from bpo_jax import builders
    from bpo_jax.models import sharding

    f = flags.FLAGS
    with cli.start_up_errors(PROG):
        cfg, algos = check_arguments(f.config, f.workdir, f.algos, f.batches, f.variants)
    platforms.quiet_start()  # Before anything touches a device.
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint operation.
    workdir = files.as_path(f.workdir)
    train_tasks, _ = builders.select_tasks(cfg)
    tasks = train_tasks[: cfg.train.tasks_per_iter]
    mesh = sharding.make_mesh(cfg.mesh.axes, dcn_data=cfg.mesh.dcn_data)
    source = policy_source(cfg, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "config.json").exists():
        files.write_text(
            workdir / "config.json", json.dumps(f.config.to_dict(), indent=2, default=str)
        )
    predicted = f.predicted if f.predicted is not None else None
    with builders.make_pool(cfg) as pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        start = load_start(cfg, source, mesh)
        tokenizer, graphdef, params, policy = (
            start.tokenizer,
            start.graphdef,
            start.params,
            start.policy,
        )
        step = start.step
        # Recorded batches are kept as they finish: a re-run of this command resumes after them.
        identity = {
            "config": f.config.to_dict(),
            "algos": algos,
            "batches": f.batches,
            "warmup_batches": f.warmup_batches,
            "sketch_dim": f.sketch_dim,
            "variants": list(f.variants),
            "tasks": [t.task_id for t in tasks],
            "source": str(source),
            "update_step": int(step),
        }
        store = ProbeStore(workdir / "probe_batches", identity)
        results = run_probe(
            pool,
            policy,
            tasks,
            cfg,
            algos,
            f.batches,
            jax.random.key(cfg.seed + 7),
            ModelGradients(graphdef, params, tokenizer.pad_id, cfg, f.sketch_dim),
            critic_for=lambda c: make_critic(c, graphdef, _width(params), tokenizer.pad_id),
            params=params,
            warmup_batches=f.warmup_batches,
            seed=cfg.seed,
            store=store,
            progress=lambda line: print(line, flush=True),
            variants=tuple(f.variants),
        )
    design = design_record(cfg, predicted, f.design_reason)
    names = [*algos, *f.variants]
    write_report(workdir, step, [t.task_id for t in tasks], results, names, design)


if __name__ == "__main__":
    from absl import flags

    from bpo_jax.experiment import define_config_flag, unknown_field

    define_config_flag()
    flags.DEFINE_string("workdir", None, "A trained run's directory (its checkpoint is read).")
    flags.DEFINE_string(
        "algos", "rloo,bpo", "Comma-separated algorithms; the first is the reference."
    )
    flags.DEFINE_integer("batches", 64, "Recorded rollout batches per algorithm.")
    flags.DEFINE_integer("warmup_batches", 2, "Unrecorded batches of a tree algorithm first.")
    flags.DEFINE_integer("sketch_dim", 2**15, "Coordinates of each gradient's count sketch.")
    flags.DEFINE_float(
        "predicted", None, "The design's predicted BPO/RLOO trace (a pilot's), for the record."
    )
    flags.DEFINE_string("design_reason", "", "Why this design (for the record).")
    flags.DEFINE_list(
        "variants", [], "Tree estimators also applied to the first tree algorithm's forests."
    )
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, PROG, explain=unknown_field)
