"""The training run: behaviour cloning, then RL, with evaluation, metrics and checkpoints.

`bpo_jax.main` calls `train_and_evaluate`; so do the tests. Phases, each resumable from the
latest checkpoint in `<workdir>/checkpoints`:
  1. expert demos (cached JSON) -> tokenizer (trained for the tiny policy) -> model;
  2. greedy evaluation of the initial policy;
  3. behaviour cloning from the walkthroughs (`bc.steps`, may be 0);
  4. greedy evaluation "before RL";
  5. `train.iterations` RL iterations (see `bpo_jax.rl`);
  6. greedy evaluation "after RL", and `summary.json`.
Evaluations are stored in `<workdir>/evals.json` so that a resumed run does not repeat them.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bpo_jax import learner
from bpo_jax.agent import SPECIAL_SYMBOLS
from bpo_jax.checkpoint import Checkpointer, abstract_like
from bpo_jax.config import ALGOS, DTYPES, ExperimentConfig, validate
from bpo_jax.critic import Critic
from bpo_jax.demos import bc_examples, corpus, load_or_play
from bpo_jax.metrics import MetricWriter, progress
from bpo_jax.models import config as model_config
from bpo_jax.models import sharding
from bpo_jax.models.factory import create_model
from bpo_jax.policy import Policy
from bpo_jax.rl import RLUpdater, RolloutState, minibatches, rl_iteration, round_up
from bpo_jax.rollout import play, success_rate
from bpo_jax.tokenizer import load_tokenizer, train_sentencepiece

log = logging.getLogger(__name__)


def select_tasks(cfg: ExperimentConfig):
    """Training and evaluation tasks, chosen deterministically from the seed."""
    from envs.base import load_tasks

    e = cfg.env
    root = e.data_root or None
    opts = dict(e.task_options)
    train = load_tasks(e.name, root, e.train_split, tuple(e.task_types) or None, **opts)
    random.Random(cfg.seed).shuffle(train)
    if e.num_train_tasks:
        train = train[: e.num_train_tasks]
    if e.eval_split == e.train_split:
        evals = train[: cfg.eval.num_tasks]  # In-distribution: the training games themselves.
    else:
        evals = load_tasks(e.name, root, e.eval_split, tuple(e.task_types) or None, **opts)
        random.Random(cfg.seed + 1).shuffle(evals)
        evals = evals[: cfg.eval.num_tasks]
    return train, evals


def build_tokenizer(cfg: ExperimentConfig, workdir: Path, demos):
    if cfg.model.tokenizer:
        return load_tokenizer(cfg.model.tokenizer)
    if cfg.model.hf_checkpoint:
        return load_tokenizer(cfg.model.hf_checkpoint)
    path = workdir / "tokenizer.model"
    if path.exists():
        return load_tokenizer(path)
    texts = corpus(demos, cfg.agent.history_turns)
    return train_sentencepiece(
        texts,
        workdir / "tokenizer",
        cfg.model.tokenizer_vocab_size,
        user_defined_symbols=SPECIAL_SYMBOLS,
    )


def build_model(cfg: ExperimentConfig, tokenizer, mesh):
    m = cfg.model
    dtype, param_dtype = DTYPES[m.dtype], DTYPES[m.param_dtype]
    if m.hf_checkpoint:
        from bpo_jax.models.hf_import import load_hf_checkpoint

        return load_hf_checkpoint(
            m.hf_checkpoint,
            mesh=mesh,
            rules=cfg.mesh.rules,
            dtype=dtype,
            param_dtype=param_dtype,
            max_seq_len=m.max_seq_len,
        )
    mcfg = model_config.get_preset(
        m.preset,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=m.max_seq_len,
        dtype=dtype,
        param_dtype=param_dtype,
    )
    return mcfg, create_model(mcfg, mesh=mesh, rules=cfg.mesh.rules, seed=cfg.seed)


def make_policy(cfg: ExperimentConfig, graphdef, params, tokenizer, mcfg, mesh=None) -> Policy:
    """The acting policy with the experiment's sampling settings and prompt budget."""
    return Policy(
        graphdef,
        params,
        tokenizer,
        mcfg,
        max_new_tokens=cfg.agent.max_action_tokens,
        cache_len=cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens,
        temperature=cfg.sampler.temperature,
        top_p=cfg.sampler.top_p,
        length_bucket=cfg.sampler.length_bucket,
        mesh=mesh,
    )


def evaluate(pool, policy, tasks, cfg: ExperimentConfig, rng, label: str) -> dict:
    """Greedy episodes, one per task; success rate and friends."""
    if not tasks:
        return {}
    t0 = time.time()
    bar = progress(len(tasks), desc=f"eval ({label})", unit="episode")
    trajs, _ = play(
        pool,
        policy,
        tasks,
        1,
        rng=rng,
        greedy=True,
        history_turns=cfg.agent.history_turns,
        max_prompt_tokens=cfg.agent.max_prompt_tokens,
        progress_bar=bar,
    )
    bar.close()
    steps = [s for t in trajs for s in t.steps]
    invalid = [s.action_text is None or s.observation.strip() == "Nothing happens." for s in steps]
    out = {
        "eval/success": success_rate(trajs),
        "eval/return": float(np.mean([t.total_reward for t in trajs])),
        "eval/episode_len": float(np.mean([len(t.steps) for t in trajs])),
        "eval/invalid_frac": float(np.mean(invalid)) if invalid else 0.0,
        "eval/num_episodes": len(trajs),
        "eval/seconds": time.time() - t0,
    }
    log.info(
        "eval %-10s success %.3f over %d episodes (%.0fs)",
        label,
        out["eval/success"],
        len(trajs),
        out["eval/seconds"],
    )
    return out


class _Evals:
    """Evaluation results of this run, persisted to `evals.json` as they come."""

    def __init__(self, path: Path, resume: bool, writer: MetricWriter):
        self.path = path
        self.writer = writer
        self.results = json.loads(path.read_text()) if resume and path.exists() else {}

    def __contains__(self, name):
        return name in self.results

    def record(self, name: str, result: dict, step: int):
        self.results[name] = result
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2))
        tmp.replace(self.path)
        self.writer.write(step, {k.replace("eval/", f"eval_{name}/"): v for k, v in result.items()})

    def success(self, name):
        return self.results.get(name, {}).get("eval/success")


def behaviour_cloning(cfg, graphdef, state, meta, examples, pad_id, writer, save):
    """Runs BC from `meta['bc_step']` to `cfg.bc.steps`; returns the new state."""
    optimizer = learner.make_optimizer(cfg.bc.lr, 0.0, 0.9, 0.999, 1.0)
    step_fn = learner.make_train_step(graphdef, optimizer, learner.bc_loss)
    rng = np.random.default_rng([cfg.seed, meta["bc_step"]])
    bar = progress(cfg.bc.steps, desc="behaviour cloning", unit="step", initial=meta["bc_step"])
    batches = iter(())
    while meta["bc_step"] < cfg.bc.steps:
        chunk = next(batches, None)
        if chunk is None:
            batches = minibatches(examples, cfg.bc.batch_size, rng)
            continue
        length = round_up(max(len(s) for s, _ in chunk), cfg.sampler.length_bucket)
        batch = learner.pad_batch(
            [s for s, _ in chunk],
            [a for _, a in chunk],
            batch_size=cfg.bc.batch_size,
            length=length,
            pad_id=pad_id,
        )
        state, metrics = step_fn(state, batch)
        meta["bc_step"] += 1
        bar.update(1)
        if meta["bc_step"] % cfg.log_every == 0 or meta["bc_step"] == cfg.bc.steps:
            writer.write(int(state.step), {f"bc/{k}": v for k, v in metrics.items()})
        if meta["bc_step"] % max(cfg.bc.steps // 4, 1) == 0 and meta["bc_step"] < cfg.bc.steps:
            save(state)
    bar.close()
    return state


def train_and_evaluate(config, workdir: str | Path) -> dict:
    """Runs (or resumes) an experiment in `workdir`; returns the summary dict."""
    cfg = validate(config)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    from envs.sandbox import SandboxPool

    mesh = sharding.make_mesh(
        {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    )
    train_tasks, eval_tasks = select_tasks(cfg)
    log.info(
        "%d training tasks, %d evaluation tasks (%s split)",
        len(train_tasks),
        len(eval_tasks),
        cfg.env.eval_split,
    )
    env_kwargs = {
        "max_steps": cfg.env.max_steps,
        "invalid_action_penalty": cfg.env.invalid_action_penalty,
        **dict(cfg.env.env_options),
    }
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=cfg.checkpoint.max_to_keep)
    pool = SandboxPool(
        cfg.env.name, env_kwargs, backend=cfg.env.sandbox_backend, num_workers=cfg.env.num_workers
    )
    with pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        needs_demos = cfg.bc.steps > 0 or not (cfg.model.tokenizer or cfg.model.hf_checkpoint)
        demos = (
            load_or_play(workdir / "expert_demos.json", pool, train_tasks) if needs_demos else []
        )
        tokenizer = build_tokenizer(cfg, workdir, demos)
        mcfg, model = build_model(cfg, tokenizer, mesh)
        graphdef, params = nnx.split(model)
        del model
        policy = make_policy(cfg, graphdef, params, tokenizer, mcfg, mesh)
        updater = RLUpdater(graphdef, cfg, tokenizer.pad_id, writer.write)
        key = jax.random.key(cfg.seed)
        rollout_state = RolloutState.create(cfg)
        critic = None
        if ALGOS[cfg.train.algo][1] == "gae":  # PPO's value head.
            critic = Critic(
                graphdef,
                mcfg.hidden_size,
                cfg.train.value_lr,
                cfg.train.value_epochs,
                cfg.seed,
                tokenizer.pad_id,
            )

        # BC and RL optimizers share one state structure (learner.make_optimizer), so a
        # checkpoint of either phase restores into this template.
        state = learner.TrainState(
            params=params, opt_state=updater.optimizer.init(params), step=jnp.zeros((), jnp.int32)
        )
        meta = {"phase": "bc", "bc_step": 0, "iteration": 0}
        # The KL reference is the policy RL starts from (after BC); it is checkpointed with the
        # run so that a resumed run keeps the same reference.
        use_ref = cfg.train.kl_coef > 0
        ref_params = jax.tree.map(jnp.copy, params) if use_ref else None
        resumed = ckpt.latest_step() is not None
        if resumed:
            template = {"train_state": state, "rng": key}
            if use_ref:
                template["ref_params"] = params
            if critic is not None:
                template["critic"] = critic.state
            step, restored, meta = ckpt.restore(abstract_state=abstract_like(template))
            state, key = restored["train_state"], restored["rng"]
            ref_params = restored.get("ref_params")
            if critic is not None:
                critic.state = restored["critic"]
            rollout_state.load(meta.get("rollout", {}))
            print(
                f"Resumed from checkpoint at update step {step} (phase {meta['phase']}, "
                f"RL iteration {meta['iteration']}).",
                flush=True,
            )
        evals = _Evals(workdir / "evals.json", resumed, writer)

        def save(st, force=True):
            tree = {"train_state": st, "rng": key}
            if use_ref:
                tree["ref_params"] = ref_params
            if critic is not None:
                tree["critic"] = critic.state
            meta["rollout"] = rollout_state.dump()
            ckpt.save(int(st.step), tree, meta, force=force)

        def run_eval(name, label, salt, st):
            if name not in evals:
                policy.params = st.params
                evals.record(
                    name,
                    evaluate(pool, policy, eval_tasks, cfg, jax.random.fold_in(key, salt), label),
                    int(st.step),
                )

        if meta["phase"] == "bc":
            if meta["bc_step"] == 0:
                run_eval("initial", "initial", 10_000, state)
            if cfg.bc.steps:
                examples = bc_examples(
                    demos, tokenizer, cfg.agent.history_turns, cfg.agent.max_prompt_tokens
                )
                if not examples:
                    raise RuntimeError(
                        f"No winning walkthrough to clone among the {cfg.env.name} training "
                        "tasks: check the environment's data root and task selection."
                    )
                state = behaviour_cloning(
                    cfg, graphdef, state, meta, examples, tokenizer.pad_id, writer, save
                )
            # Fresh optimizer moments for RL.
            state = learner.TrainState(
                params=state.params, opt_state=updater.optimizer.init(state.params), step=state.step
            )
            if use_ref:
                ref_params = jax.tree.map(jnp.copy, state.params)  # Not donated with the state.
            meta["phase"] = "rl"
            save(state)

        run_eval("before_rl", "before RL", 20_000, state)
        t = cfg.train
        while meta["iteration"] < t.iterations:
            it = meta["iteration"]
            picked_rng = np.random.default_rng([cfg.seed, it])
            picked = picked_rng.choice(
                len(train_tasks), size=t.tasks_per_iter, replace=len(train_tasks) < t.tasks_per_iter
            )
            state, metrics = rl_iteration(
                pool,
                policy,
                updater,
                state,
                [train_tasks[i] for i in picked],
                it,
                jax.random.fold_in(key, it),
                ref_params=ref_params,
                rollout_state=rollout_state,
                critic=critic,
            )
            meta["iteration"] = it + 1
            writer.write(int(state.step), metrics)
            log.info(
                "iter %d/%d success %.3f return %.3f grad_norm %.3f (%.0fs)",
                it + 1,
                t.iterations,
                metrics["train/success"],
                metrics["train/return"],
                metrics.get("train/grad_norm_mean", float("nan")),
                metrics["train/iteration_seconds"],
            )
            print(
                f"iteration {it + 1}/{t.iterations}: rollout success "
                f"{metrics['train/success']:.3f}, mean return {metrics['train/return']:.3f}",
                flush=True,
            )
            if (it + 1) % cfg.checkpoint.every == 0 or it + 1 == t.iterations:
                save(state)
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < t.iterations:
                run_eval(f"iter_{it + 1}", f"iter {it + 1}", 30_000 + it, state)
        run_eval("after_rl", "after RL", 40_000, state)
        ckpt.wait()
        summary = {
            "eval_split": cfg.env.eval_split,
            "eval_tasks": len(eval_tasks),
            "success_initial": evals.success("initial"),
            "success_before_rl": evals.success("before_rl"),
            "success_after_rl": evals.success("after_rl"),
            "updates": int(state.step),
            "iterations": meta["iteration"],
            "sandbox": pool.stats(),
        }
    writer.close()
    ckpt.close()
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary
