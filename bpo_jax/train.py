"""The training run: setup, behaviour cloning, RL, final evaluation, as explicit phases.

`bpo_jax.main` calls `train_and_evaluate`; so do the tests. Each phase is a function that takes
the run's fixed parts (`Run`: tasks, pool, policy, updater, files) and its `RunState`, and
returns the new state; every phase resumes from the latest checkpoint in
`<workdir>/checkpoints`:
  1. `setup`: expert demos (`bc.demos`, cached JSON) -> tokenizer (trained for the tiny
     policy) -> model -> a fresh `RunState`, or the checkpointed one;
  2. `behaviour_cloning`: greedy evaluation of the initial policy (unless `eval.initial` is
     off), then `bc.steps` steps of cloning the demos (may be 0);
  3. `reinforcement_learning`: greedy evaluation "before RL", then `train.iterations`
     iterations (`bpo_jax.rl`);
  4. `final_evaluation`: greedy evaluation "after RL", and `summary.json` with RL's effect
     on the evaluation games (a paired interval), its compute, and `curves.png`
     (`bpo_jax.report`).
Evaluations are stored in `<workdir>/evals.json` so that a resumed run does not repeat them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx

from bpo_jax import learner, report
from bpo_jax.agent.demos import bc_examples, demos_path, inadmissible_turn_fn, load_or_play
from bpo_jax.algorithms import get_algorithm
from bpo_jax.builders import (
    agent_notes,
    build_model,
    build_tokenizer,
    make_critic,
    make_policy,
    make_pool,
    select_tasks,
)
from bpo_jax.config import ExperimentConfig, validate
from bpo_jax.evaluation import EVAL_SEEDS, EvalLog, evaluate, pooled
from bpo_jax.io import files
from bpo_jax.io.checkpoint import Checkpointer
from bpo_jax.io.eval_cache import EvalCache
from bpo_jax.io.metrics import BRANCH_PARTS_FILE, MetricWriter, progress
from bpo_jax.models import sharding
from bpo_jax.parallel import distributed
from bpo_jax.rl import rl_iteration
from bpo_jax.run_state import RunState, initial_state
from bpo_jax.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What a run builds once and every phase reads: fixed for the run's lifetime."""

    cfg: ExperimentConfig
    workdir: epath.Path  # Local (absolute) or a bucket URL: `bpo_jax.io.files`.
    pool: Any
    train_tasks: list
    eval_tasks: dict  # split -> tasks
    demos: list
    tokenizer: Any
    graphdef: Any
    policy: Any
    updater: learner.RLUpdater
    writer: MetricWriter
    ckpt: Checkpointer
    evals: EvalLog
    eval_cache: EvalCache | None = None  # Results shared between runs (`eval.cache_dir`).

    def evaluate(
        self, name: str, label: str, seed: int, state: RunState, *, current: bool = False
    ) -> None:
        """Runs and records evaluation `name` (every split; see `bpo_jax.evaluation`) unless
        this run has recorded it already (a resumed run does not repeat it). With `current`,
        a record made at other parameters is redone (the final evaluation of a run whose
        `train.iterations` was raised after it finished)."""
        step = self.evals.step_of(name)
        if name in self.evals and not (current and step is not None and step != state.step):
            return
        self.policy.params = state.train.params
        rng = jax.random.fold_in(state.rng, seed)
        cache = self.eval_cache
        greedy = []
        for i, (split, tasks) in enumerate(self.eval_tasks.items()):
            result = evaluate(
                self.pool, self.policy, tasks, self.cfg, rng, f"{label}, {split}", cache=cache
            )
            self.evals.record(f"{name}/{split}", result, state.step)
            greedy.append(result)
            if self.cfg.eval.sampled:
                key = jax.random.fold_in(rng, 1 + i)
                result = evaluate(
                    self.pool,
                    self.policy,
                    tasks,
                    self.cfg,
                    key,
                    f"{label}, {split}",
                    greedy=False,
                    cache=cache,
                )
                self.evals.record(f"{name}/{split}/sampled", result, state.step)
        self.evals.record(name, pooled(greedy), state.step)


@contextlib.contextmanager
def open_run(cfg: ExperimentConfig, workdir: epath.Path, raw_config=None):
    """Builds the run's fixed parts; closes the pool, the writer and the checkpointer on exit."""
    workdir = files.as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lead = distributed.is_lead()  # Process 0 writes the run's files (Orbax: checkpoints, all).
    if raw_config is not None and lead:
        files.write_text(workdir / "config.json", json.dumps(raw_config, indent=2, default=str))
    mesh = sharding.make_mesh(cfg.mesh.axes, dcn_data=cfg.mesh.dcn_data)
    train_tasks, eval_tasks = select_tasks(cfg)
    log.info(
        "%d training tasks; evaluation tasks: %s",
        len(train_tasks),
        ", ".join(f"{len(t)} of {s}" for s, t in eval_tasks.items()),
    )
    writer = MetricWriter(workdir, enabled=lead)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=cfg.checkpoint.max_to_keep)
    try:
        with make_pool(cfg) as pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
            demos = None
            if lead:
                if cfg.init_from:
                    _adopt_tokenizer(files.as_path(cfg.init_from), workdir)
                has_tokenizer = (
                    bool(cfg.model.tokenizer or cfg.model.hf_checkpoint or cfg.model.gguf)
                    or (workdir / "tokenizer.model").exists()
                )
                needs_demos = (cfg.bc.steps > 0 and not cfg.init_from) or not has_tokenizer
                demos = (
                    load_or_play(
                        demos_path(workdir, cfg.bc.demos),
                        pool,
                        train_tasks,
                        cfg.bc.demos,
                        cfg.env.name,
                    )
                    if needs_demos
                    else []
                )
            # The lead's walkthroughs and tokenizer, so that no other host writes them.
            demos = distributed.allgather_objects(demos)[0]
            tokenizer = _shared_tokenizer(cfg, workdir, demos)
            mcfg, model = build_model(cfg, tokenizer, mesh)
            graphdef, params = nnx.split(model)
            del model
            # Fails the run, naming the parameter, when a mesh that could shard the parameters
            # would replicate more than 1% of their bytes.
            sharding.check_replication(params)
            run = Run(
                cfg=cfg,
                workdir=workdir,
                pool=pool,
                train_tasks=train_tasks,
                eval_tasks=eval_tasks,
                demos=demos,
                tokenizer=tokenizer,
                graphdef=graphdef,
                policy=make_policy(cfg, graphdef, params, tokenizer, mcfg, mesh),
                updater=learner.RLUpdater(
                    graphdef, cfg, tokenizer.pad_id, writer.write, params=params
                ),
                writer=writer,
                ckpt=ckpt,
                evals=EvalLog(
                    workdir / "evals.json",
                    ckpt.latest_step() is not None,
                    writer,
                    splits=list(eval_tasks),
                ),
                eval_cache=_eval_cache(cfg, workdir),
            )
            yield run, mcfg, params
            ckpt.wait()
    finally:
        writer.close()
        ckpt.close()


def _eval_cache(cfg: ExperimentConfig, workdir: epath.Path) -> EvalCache | None:
    """The shared evaluation results (`eval.cache_dir`), salted with this run's tokenizer."""
    if not cfg.eval.cache_dir:
        return None
    trained = workdir / "tokenizer.model"
    salt = trained.read_bytes() if trained.exists() else cfg.model.tokenizer.encode()
    salt += cfg.model.hf_checkpoint.encode() + cfg.model.gguf.encode()
    return EvalCache(cfg.eval.cache_dir, salt=salt)


def _shared_tokenizer(cfg: ExperimentConfig, workdir: epath.Path, demos):
    """The run's tokenizer: the configured one, or the one process 0 trained (or found) in the
    workdir, sent to the other processes rather than written by them."""
    if (
        distributed.process_count() == 1
        or cfg.model.tokenizer
        or cfg.model.hf_checkpoint
        or cfg.model.gguf
    ):
        return build_tokenizer(cfg, workdir, demos)
    tokenizer = build_tokenizer(cfg, workdir, demos) if distributed.is_lead() else None
    data = (workdir / "tokenizer.model").read_bytes() if distributed.is_lead() else None
    data = distributed.allgather_objects(data)[0]
    if distributed.is_lead():
        return tokenizer
    path = Path(tempfile.mkdtemp(prefix="bpo_jax_tokenizer_")) / "tokenizer.model"
    path.write_bytes(data)
    return load_tokenizer(path)


def _adopt_tokenizer(source: epath.Path, workdir: epath.Path) -> None:
    """Copies the source run's trained tokenizer (`init_from`): its policy's ids mean its tokens."""
    for name in ("tokenizer.model", "tokenizer.vocab"):
        if (source / name).exists() and not (workdir / name).exists():
            files.copy(source / name, workdir / name)


def _init_from(run: Run, state: RunState, mcfg) -> RunState:
    """The state RL starts from when `init_from` names another run: that run's policy.

    The source's own config says what its checkpoint holds besides the policy (a KL reference,
    a critic), so its whole state is restored into a template of that layout, and only the
    policy is kept: the optimizer, the critic, the reference and the PRNG key are this run's.
    Only those two facts are read from the source's config, so a run made by an older version
    (with fewer config fields) still works.
    """
    source = files.as_path(run.cfg.init_from)
    src_train = json.loads((source / "config.json").read_text()).get("train", {})
    src_algo = get_algorithm(src_train.get("algo", "grpo"))
    critic = None
    if src_algo.needs_critic:
        critic = make_critic(run.cfg, run.graphdef, mcfg.hidden_size, run.tokenizer.pad_id)
        if critic is None:  # This run's algorithm has none: build one of the source's shape.
            from bpo_jax.learner.critic import Critic

            critic = Critic(run.graphdef, mcfg.hidden_size, 1.0, 1, 0, run.tokenizer.pad_id)
    params = state.train.params
    template = initial_state(run.cfg, params, run.updater.optimizer, critic).replace(
        ref_params=learner.reference_params(params)
        if float(src_train.get("kl_coef", 0.0)) > 0
        else None
    )
    optimizer = run.updater.optimizer
    with Checkpointer(source / "checkpoints") as src:
        loaded = template.restore(src, step=src.latest_step())  # Leaves the source as it is.
    params = loaded.train.params
    ref = learner.reference_params(params) if state.ref_params is not None else None
    print(
        f"Initialised from {source} (update step {loaded.step}, its phase {loaded.phase}, "
        f"iteration {loaded.iteration}).",
        flush=True,
    )
    state = state.replace(
        train=learner.TrainState(params, optimizer.init(params), loaded.train.step),
        ref_params=ref,
        meta={
            **state.meta,
            "phase": "rl",
            "bc_step": loaded.meta.get("bc_step", 0),
            "init_from": str(source.absolute()),
            "init_step": loaded.step,
        },
    )
    state.save(run.ckpt)
    return state


def setup(run: Run, mcfg, params) -> RunState:
    """The run's state: restored from the latest checkpoint, else from `init_from`, else fresh."""
    critic = make_critic(run.cfg, run.graphdef, mcfg.hidden_size, run.tokenizer.pad_id)
    state = initial_state(run.cfg, params, run.updater.optimizer, critic)
    if run.ckpt.latest_step() is None:
        return _init_from(run, state, mcfg) if run.cfg.init_from else state
    state = state.restore(run.ckpt)
    print(
        f"Resumed from checkpoint at update step {state.step} (phase {state.phase}, "
        f"RL iteration {state.iteration}).",
        flush=True,
    )
    return state


def behaviour_cloning(run: Run, state: RunState) -> RunState:
    """Evaluates the initial policy, clones the walkthroughs, and moves the state to RL."""
    if state.phase != "bc":
        return state
    cfg = run.cfg
    if state.meta["bc_step"] == 0 and cfg.eval.initial:
        run.evaluate("initial", "initial", EVAL_SEEDS["initial"], state)
    if cfg.bc.steps:
        examples = bc_examples(
            run.demos,
            run.tokenizer,
            cfg.agent.history_turns,
            cfg.agent.max_prompt_tokens,
            recovery=cfg.bc.recovery,
            wrong_turn=inadmissible_turn_fn(cfg.env.name) if cfg.bc.recovery else None,
            seed=cfg.seed,
            notes=agent_notes(cfg),
        )
        if not examples:
            raise RuntimeError(
                f"No winning {cfg.bc.demos} demo to clone among the {cfg.env.name} training "
                "tasks: check the environment's data root, task selection and env.max_steps."
            )
        state = _clone(run, state, examples)
    # Fresh optimizer moments for RL; the KL reference is the policy RL starts from.
    params = state.train.params
    ref = learner.reference_params(params) if state.ref_params is not None else None
    state = state.replace(
        train=learner.TrainState(
            params=params, opt_state=run.updater.optimizer.init(params), step=state.train.step
        ),
        ref_params=ref,
        meta={**state.meta, "phase": "rl"},
    )
    state.save(run.ckpt)
    return state


def _clone(run: Run, state: RunState, examples) -> RunState:
    """BC steps from `meta['bc_step']` to `bc.steps`, checkpointed four times on the way."""
    cfg = run.cfg
    optimizer = learner.make_optimizer(cfg.bc.lr, 0.0, 0.9, 0.999, 1.0)
    step_fn = learner.make_train_step(
        run.graphdef,
        optimizer,
        learner.bc_loss,
        remat=cfg.model.remat,
        logits_chunk=cfg.train.logits_chunk,
        scan_layers=cfg.model.scan_layers,
    )
    bc_step = state.meta["bc_step"]
    rng = np.random.default_rng([cfg.seed, bc_step])
    bar = progress(cfg.bc.steps, desc="behaviour cloning", unit="step", initial=bc_step)
    batches = iter(())
    train = state.train
    while bc_step < cfg.bc.steps:
        chunk = next(batches, None)
        if chunk is None:
            batches = learner.minibatches(examples, cfg.bc.batch_size, rng)
            continue
        batch = learner.pad_batch(
            [s for s, _ in chunk],
            [a for _, a in chunk],
            batch_size=cfg.bc.batch_size,
            length=learner.round_up(max(len(s) for s, _ in chunk), cfg.sampler.length_bucket),
            pad_id=run.tokenizer.pad_id,
        )
        mesh = distributed.mesh_of(train.params)
        train, metrics = step_fn(
            train, batch if mesh is None else distributed.global_batch(batch, mesh)
        )
        bc_step += 1
        bar.update(1)
        if bc_step % cfg.log_every == 0 or bc_step == cfg.bc.steps:
            run.writer.write(int(train.step), {f"bc/{k}": v for k, v in metrics.items()})
        if bc_step % max(cfg.bc.steps // 4, 1) == 0 and bc_step < cfg.bc.steps:
            state.replace(train=train, meta={**state.meta, "bc_step": bc_step}).save(run.ckpt)
    bar.close()
    return state.replace(train=train, meta={**state.meta, "bc_step": bc_step})


def iteration_tasks(run: Run, it: int) -> list:
    """The tasks of RL iteration `it`: a seeded draw from the training tasks."""
    t = run.cfg.train
    rng = np.random.default_rng([run.cfg.seed, it])
    n = len(run.train_tasks)
    picked = rng.choice(n, size=t.tasks_per_iter, replace=n < t.tasks_per_iter)
    return [run.train_tasks[i] for i in picked]


def reinforcement_learning(run: Run, state: RunState) -> RunState:
    """Evaluates before RL, then runs the remaining RL iterations with their checkpoints."""
    cfg, t = run.cfg, run.cfg.train
    run.evaluate("before_rl", "before RL", EVAL_SEEDS["before_rl"], state)
    bar = progress(t.iterations, desc="RL", unit="iter", initial=state.iteration)
    while state.iteration < t.iterations:
        it = state.iteration
        train, metrics = rl_iteration(
            run.pool,
            run.policy,
            run.updater,
            state.train,
            iteration_tasks(run, it),
            it,
            jax.random.fold_in(state.rng, it),
            ref_params=state.ref_params,
            rollout_state=state.rollout,
            critic=state.critic,
        )
        state = state.replace(train=train, meta={**state.meta, "iteration": it + 1})
        run.writer.write(state.step, metrics)
        if state.rollout.explained is not None:  # Tree algorithms: f's parts per (task, depth).
            parts = {"iteration": it + 1, "step": state.step, **state.rollout.explained.record()}
            run.writer.append(BRANCH_PARTS_FILE, parts)
        log.info(
            "iter %d/%d success %.3f return %.3f grad_norm %.3f (%.0fs)",
            it + 1,
            t.iterations,
            metrics["train/success"],
            metrics["train/return"],
            metrics.get("train/grad_norm_mean", float("nan")),
            metrics["train/iteration_seconds"],
        )
        bar.update(1)
        bar.set_postfix_str(rl_postfix(metrics), refresh=True)
        bar.write(
            f"iteration {it + 1}/{t.iterations}: rollout success "
            f"{metrics['train/success']:.3f}, mean return {metrics['train/return']:.3f}",
            file=sys.stdout,
        )
        sys.stdout.flush()  # A log file sees each iteration as it ends.
        if (it + 1) % cfg.checkpoint.every == 0 or it + 1 == t.iterations:
            state.save(run.ckpt)
        if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < t.iterations:
            run.evaluate(f"iter_{it + 1}", f"iter {it + 1}", EVAL_SEEDS["iter"] + it, state)
    bar.close()
    return state


def rl_postfix(metrics: dict) -> str:
    """The RL bar's postfix from an iteration's metrics: rollout success, spend / budget and
    branch points (tree algorithms), and where the iteration's time went."""
    parts = [f"success {metrics['train/success']:.2f}"]
    if "compute/spend_ratio" in metrics:
        parts.append(f"spend/budget {metrics['compute/spend_ratio']:.2f}")
    if metrics.get("train/branch_points"):
        parts.append(f"branch points {metrics['train/branch_points']}")
    parts.append(
        f"rollout {metrics['train/rollout_seconds']:.0f}s, "
        f"update {metrics['train/update_seconds']:.0f}s"
    )
    return " | ".join(parts)


def final_evaluation(run: Run, state: RunState) -> dict:
    """Evaluates after RL; returns the run's summary."""
    if "before_rl" in run.evals and run.evals.step_of("before_rl") == state.step:
        # No update since "before RL" (train.iterations=0, a behaviour-cloning run): the same
        # policy, so its records stand for "after RL" rather than playing every game again.
        for name, result in list(run.evals.results.items()):
            if name == "before_rl" or name.startswith("before_rl/"):
                run.evals.record("after_rl" + name[len("before_rl") :], result, state.step)
    else:
        run.evaluate("after_rl", "after RL", EVAL_SEEDS["after_rl"], state, current=True)
    return {
        "eval_split": run.cfg.env.eval_split,
        "eval_tasks": sum(len(t) for t in run.eval_tasks.values()),
        "eval_tasks_per_split": {s: len(t) for s, t in run.eval_tasks.items()},
        "success_initial": run.evals.success("initial"),
        "success_before_rl": run.evals.success("before_rl"),
        "success_after_rl": run.evals.success("after_rl"),
        "updates": state.step,  # Behaviour cloning's included.
        "rl_updates": state.step - int(state.meta.get("bc_step", 0)),
        "iterations": state.iteration,
        "sandbox": run.pool.stats(),
        # Tree algorithms: f pooled over the run, per depth, and its sums (`rollout.explained`).
        **(state.rollout.explained.summary() if state.rollout.explained is not None else {}),
    }


def train_and_evaluate(config, workdir: str | os.PathLike) -> dict:
    """Runs (or resumes) an experiment in `workdir` (a local folder or a `gs://` URL); returns the
    summary dict."""
    cfg = validate(config)
    workdir = files.as_path(workdir)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    with open_run(cfg, workdir, raw) as (run, mcfg, params):
        state = setup(run, mcfg, params)
        del params
        state = behaviour_cloning(run, state)
        state = reinforcement_learning(run, state)
        summary = final_evaluation(run, state)
    if distributed.is_lead():
        # RL's effect with its interval, its compute, and curves.png (`bpo_jax.report`).
        summary.update(report.summarise(cfg, workdir, run.evals.results))
        files.write_text(workdir / "summary.json", json.dumps(summary, indent=2, default=str))
    return summary
