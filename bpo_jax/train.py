"""The training run: behaviour cloning, then RL with group rollouts, with evaluation,
metrics and checkpoints. `bpo_jax.main` calls `train_and_evaluate`; so do the tests.

Phases (each resumable from the latest checkpoint):
  1. expert demos (cached JSON) -> tokenizer (tiny policy only) -> model init or HF import;
  2. behaviour cloning from the walkthroughs (`bc.steps`, may be 0);
  3. greedy evaluation "before RL";
  4. `train.iterations` of: rollouts -> advantages -> clipped policy-gradient updates;
  5. greedy evaluation "after RL", and a summary.json.
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
from bpo_jax.config import DTYPES, ExperimentConfig, validate
from bpo_jax.demos import bc_examples, corpus, load_or_play
from bpo_jax.metrics import MetricWriter, progress
from bpo_jax.models import config as model_config
from bpo_jax.models import sharding
from bpo_jax.models.factory import create_model
from bpo_jax.policy import Policy
from bpo_jax.rollout import play, success_rate
from bpo_jax.tokenizer import load_tokenizer, train_sentencepiece

log = logging.getLogger(__name__)


def _round_up(n: int, m: int) -> int:
  return max(m, -(-n // m) * m)


def select_tasks(cfg: ExperimentConfig):
  """Training and evaluation tasks, chosen deterministically from the seed."""
  from envs.alfworld import load_tasks  # Only ALFWorld is wired into the launcher so far.

  e = cfg.env
  root = e.data_root or None
  train = load_tasks(root, e.train_split, task_types=list(e.task_types))
  random.Random(cfg.seed).shuffle(train)
  if e.num_train_tasks:
    train = train[:e.num_train_tasks]
  if e.eval_split == e.train_split:
    evals = train[:cfg.eval.num_tasks]  # In-distribution: the training games themselves.
  else:
    evals = load_tasks(root, e.eval_split, task_types=list(e.task_types))
    random.Random(cfg.seed + 1).shuffle(evals)
    evals = evals[:cfg.eval.num_tasks]
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
  return train_sentencepiece(texts, workdir / "tokenizer", cfg.model.tokenizer_vocab_size,
                             user_defined_symbols=SPECIAL_SYMBOLS)


def build_model(cfg: ExperimentConfig, tokenizer, mesh):
  m = cfg.model
  dtype, param_dtype = DTYPES[m.dtype], DTYPES[m.param_dtype]
  if m.hf_checkpoint:
    from bpo_jax.models.hf_import import load_hf_checkpoint

    return load_hf_checkpoint(m.hf_checkpoint, mesh=mesh, rules=cfg.mesh.rules, dtype=dtype,
                              param_dtype=param_dtype, max_seq_len=m.max_seq_len)
  mcfg = model_config.get_preset(m.preset, vocab_size=tokenizer.vocab_size,
                                 max_seq_len=m.max_seq_len, dtype=dtype,
                                 param_dtype=param_dtype)
  return mcfg, create_model(mcfg, mesh=mesh, rules=cfg.mesh.rules, seed=cfg.seed)


def evaluate(pool, policy, tasks, cfg: ExperimentConfig, rng, label: str) -> dict:
  if not tasks:
    return {}
  t0 = time.time()
  bar = progress(len(tasks), desc=f"eval ({label})", unit="episode")
  trajs, stats = play(pool, policy, tasks, 1, rng=rng, greedy=True,
                      history_turns=cfg.agent.history_turns,
                      max_prompt_tokens=cfg.agent.max_prompt_tokens, progress_bar=bar)
  bar.close()
  out = {"eval/success": success_rate(trajs),
         "eval/return": float(np.mean([t.total_reward for t in trajs])),
         "eval/episode_len": float(np.mean([len(t.steps) for t in trajs])),
         "eval/invalid_frac": float(np.mean([
             s.action_text is None or s.observation.strip() == "Nothing happens."
             for t in trajs for s in t.steps])),
         "eval/num_episodes": len(trajs), "eval/seconds": time.time() - t0}
  log.info("eval %-10s success %.3f over %d episodes (%.0fs)", label, out["eval/success"],
           len(trajs), out["eval/seconds"])
  return out


def group_advantages(returns_ng: np.ndarray, algo: str, eps: float) -> np.ndarray:
  """Per-trajectory advantages of N tasks x G rollouts (depth-1 forests)."""
  from bpo_jax.estimators import tree_advantages

  n, g = returns_ng.shape
  seg_parent = np.repeat(np.arange(n, dtype=np.int32), g)
  seg_child = np.full((n * g,), -1, np.int32)
  _, adv = tree_advantages(seg_parent, seg_child, returns_ng.reshape(-1).astype(np.float32),
                           num_nodes=n, method=algo)
  return np.asarray(adv).reshape(n, g)


def _batches(examples, batch_size: int, rng: np.random.Generator):
  order = rng.permutation(len(examples))
  for i in range(0, len(order), batch_size):
    yield [examples[j] for j in order[i:i + batch_size]]


def train_and_evaluate(config, workdir: str | Path) -> dict:
  """Runs (or resumes) an experiment in `workdir`; returns the summary dict."""
  cfg = validate(config)
  workdir = Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))

  from envs.sandbox import SandboxPool

  mesh = sharding.make_mesh({"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp,
                             "tensor": cfg.mesh.tensor})
  train_tasks, eval_tasks = select_tasks(cfg)
  log.info("%d training tasks, %d evaluation tasks (%s split)", len(train_tasks),
           len(eval_tasks), cfg.env.eval_split)
  env_kwargs = {"max_steps": cfg.env.max_steps,
                "invalid_action_penalty": cfg.env.invalid_action_penalty}
  writer = MetricWriter(workdir)
  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=cfg.checkpoint.max_to_keep)
  summary: dict = {}
  with SandboxPool(cfg.env.name, env_kwargs, backend=cfg.env.sandbox_backend,
                   num_workers=cfg.env.num_workers) as pool, jax.set_mesh(mesh), \
       sharding.axis_rules(cfg.mesh.rules):
    demos = load_or_play(workdir / "expert_demos.json", pool, train_tasks) \
        if cfg.bc.steps or not (cfg.model.tokenizer or cfg.model.hf_checkpoint) else []
    tokenizer = build_tokenizer(cfg, workdir, demos)
    mcfg, model = build_model(cfg, tokenizer, mesh)
    graphdef, params = nnx.split(model)
    del model
    policy = Policy(graphdef, params, tokenizer, mcfg, max_new_tokens=cfg.agent.max_action_tokens,
                    cache_len=cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens,
                    temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p,
                    length_bucket=cfg.sampler.length_bucket)
    seq_len = _round_up(cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens,
                        cfg.sampler.length_bucket)
    key = jax.random.key(cfg.seed)

    # ---------------------------------------------------------------- resume
    meta = {"phase": "bc", "bc_step": 0, "iteration": 0}
    evals_path = workdir / "evals.json"
    evals = json.loads(evals_path.read_text()) if evals_path.exists() else {}
    rl_opt = learner.make_optimizer(cfg.train.lr, cfg.train.weight_decay, cfg.train.b1,
                                    cfg.train.b2, cfg.train.grad_clip)
    bc_opt = learner.make_optimizer(cfg.bc.lr, 0.0, 0.9, 0.999, 1.0)
    state = learner.TrainState(params=params, opt_state=bc_opt.init(params),
                               step=jnp.zeros((), jnp.int32))
    if ckpt.latest_step() is not None:
      # BC and RL optimizers share one state structure (see learner.make_optimizer).
      template = {"train_state": state, "rng": key}
      step, restored, meta = ckpt.restore(abstract_state=abstract_like(template))
      state, key = restored["train_state"], restored["rng"]
      log.info("resumed from checkpoint step %d (phase %s, iteration %d)", step, meta["phase"],
               meta["iteration"])
      print(f"Resumed from checkpoint at update step {step} (phase {meta['phase']}, "
            f"RL iteration {meta['iteration']}).", flush=True)
    else:
      evals = {}  # A fresh run: evaluations of an earlier run in this workdir do not count.

    def save(force=False):
      ckpt.save(int(state.step), {"train_state": state, "rng": key}, meta, force=force)

    def record_eval(name, result, step, prefix):
      evals[name] = result
      tmp = evals_path.with_suffix(".tmp")
      tmp.write_text(json.dumps(evals, indent=2))
      tmp.replace(evals_path)
      writer.write(step, {k.replace("eval/", prefix): v for k, v in result.items()})

    # ---------------------------------------------------------------- evaluation at init
    if "initial" not in evals and meta["phase"] == "bc" and meta["bc_step"] == 0:
      policy.params = state.params
      record_eval("initial", evaluate(pool, policy, eval_tasks, cfg,
                                      jax.random.fold_in(key, 10_000), "initial"), 0,
                  "eval_initial/")

    # ---------------------------------------------------------------- behaviour cloning
    if meta["phase"] == "bc":
      examples = bc_examples(demos, tokenizer, cfg.agent.history_turns,
                             cfg.agent.max_prompt_tokens) if cfg.bc.steps else []
      if cfg.bc.steps and not examples:
        raise RuntimeError("No winning walkthrough to clone; check the ALFWorld data.")
      bc_step_fn = learner.make_train_step(graphdef, bc_opt, learner.bc_loss)
      np_rng = np.random.default_rng(cfg.seed)
      bar = progress(cfg.bc.steps, desc="behaviour cloning", unit="step",
                     initial=meta["bc_step"])
      batches = iter(())
      while meta["bc_step"] < cfg.bc.steps:
        chunk = next(batches, None)
        if chunk is None:
          batches = _batches(examples, cfg.bc.batch_size, np_rng)
          continue
        batch = learner.pad_batch([s for s, _ in chunk], [a for _, a in chunk],
                                  batch_size=cfg.bc.batch_size, length=seq_len,
                                  pad_id=tokenizer.pad_id)
        state, metrics = bc_step_fn(state, batch)
        meta["bc_step"] += 1
        bar.update(1)
        if meta["bc_step"] % cfg.log_every == 0 or meta["bc_step"] == cfg.bc.steps:
          writer.write(int(state.step), {f"bc/{k}": v for k, v in metrics.items()})
      bar.close()
      # Switch to the RL optimizer (fresh moments) and mark the phase done.
      state = learner.TrainState(params=state.params, opt_state=rl_opt.init(state.params),
                                 step=state.step)
      meta["phase"] = "rl"
      save(force=True)

    # ---------------------------------------------------------------- RL
    policy.params = state.params
    if "before_rl" not in evals:
      record_eval("before_rl", evaluate(pool, policy, eval_tasks, cfg,
                                        jax.random.fold_in(key, 20_000), "before RL"),
                  int(state.step), "eval_before_rl/")

    rl_step_fn = learner.make_train_step(
        graphdef, rl_opt,
        lambda fn, p, b: learner.pg_loss(fn, p, b, clip_eps=cfg.train.clip_eps,
                                         loss_agg=cfg.train.loss_agg))
    logprob_fn = learner.make_logprob_fn(graphdef)
    t = cfg.train
    order = list(range(len(train_tasks)))
    while meta["iteration"] < t.iterations:
      it = meta["iteration"]
      t0 = time.time()
      it_rng = np.random.default_rng([cfg.seed, it])
      picked = [train_tasks[i] for i in it_rng.choice(order, size=t.tasks_per_iter,
                                                       replace=len(order) < t.tasks_per_iter)]
      policy.params = state.params
      trajs, stats = play(pool, policy, picked, t.group_size,
                          rng=jax.random.fold_in(key, it), greedy=False,
                          history_turns=cfg.agent.history_turns,
                          max_prompt_tokens=cfg.agent.max_prompt_tokens)
      t_rollout = time.time() - t0
      returns = np.array([tr.total_reward for tr in trajs], np.float32).reshape(
          t.tasks_per_iter, t.group_size)
      adv = group_advantages(returns, t.algo, t.adv_eps).reshape(-1)

      seqs, starts, advs = [], [], []
      for tr, a in zip(trajs, adv):
        for s in tr.steps:
          if not s.action_ids:
            continue
          seqs.append(s.prompt_ids + s.action_ids)
          starts.append(len(s.prompt_ids))
          advs.append(float(a))
      examples = list(zip(seqs, starts, advs))
      np_rng = np.random.default_rng([cfg.seed, it, 1])
      upd_metrics = []
      for _ in range(t.epochs):
        for chunk in _batches(examples, t.minibatch_size, np_rng):
          batch = learner.pad_batch([c[0] for c in chunk], [c[1] for c in chunk],
                                    batch_size=t.minibatch_size, length=seq_len,
                                    pad_id=tokenizer.pad_id, advantages=[c[2] for c in chunk])
          # Old log-probs from the learner's own forward pass at the rollout parameters
          # (exact at temperature 1; the sampler's differ when it samples at another one).
          old_lp, _ = logprob_fn(state.params, batch.tokens)
          batch = learner.Batch(batch.tokens, batch.loss_mask, batch.advantages,
                                np.asarray(old_lp) * batch.loss_mask, batch.weights)
          state, m = rl_step_fn(state, batch)
          m = {k: float(v) for k, v in m.items()}
          upd_metrics.append(m)
          writer.write(int(state.step), {"update/grad_norm": m["grad_norm"],
                                         "update/loss": m["loss"]})
      meta["iteration"] = it + 1
      summary_it = {
          "train/iteration": it + 1,
          "train/success": success_rate(trajs),
          "train/return": float(returns.mean()),
          "train/return_std": float(returns.std()),
          "train/episode_len": float(np.mean([len(tr.steps) for tr in trajs])),
          "train/num_sequences": len(examples),
          "train/rollout_seconds": t_rollout,
          "train/iteration_seconds": time.time() - t0,
          **{f"train/{k}_mean": float(np.mean([m[k] for m in upd_metrics]))
             for k in (upd_metrics[0] if upd_metrics else {})},
          **stats.as_dict("compute/"),
      }
      writer.write(int(state.step), summary_it)
      log.info("iter %d/%d success %.3f return %.3f grad_norm %.3f (%.0fs)", it + 1,
               t.iterations, summary_it["train/success"], summary_it["train/return"],
               summary_it.get("train/grad_norm_mean", float("nan")),
               summary_it["train/iteration_seconds"])
      print(f"iteration {it + 1}/{t.iterations}: train success {summary_it['train/success']:.3f}"
            f", mean return {summary_it['train/return']:.3f}", flush=True)
      if (it + 1) % cfg.checkpoint.every == 0 or it + 1 == t.iterations:
        save(force=True)
      if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < t.iterations:
        policy.params = state.params
        record_eval(f"iter_{it + 1}", evaluate(pool, policy, eval_tasks, cfg,
                                                jax.random.fold_in(key, 30_000 + it),
                                                f"iter {it + 1}"), int(state.step), "eval/")

    policy.params = state.params
    if "after_rl" not in evals:
      record_eval("after_rl", evaluate(pool, policy, eval_tasks, cfg,
                                       jax.random.fold_in(key, 40_000), "after RL"),
                  int(state.step), "eval_after_rl/")
    ckpt.wait()
    summary = {
        "eval_split": cfg.env.eval_split,
        "eval_tasks": len(eval_tasks),
        "success_initial": evals.get("initial", {}).get("eval/success"),
        "success_before_rl": evals.get("before_rl", {}).get("eval/success"),
        "success_after_rl": evals.get("after_rl", {}).get("eval/success"),
        "updates": int(state.step),
        "iterations": meta["iteration"],
        "sandbox": pool.stats(),
    }
  writer.close()
  ckpt.close()
  (workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
  return summary
