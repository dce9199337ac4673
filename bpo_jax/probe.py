r"""Gradient-variance probe: how noisy is each estimator's policy gradient at matched compute?

At fixed parameters, for every algorithm, M independent rollout batches of the same tasks are
played and each gives one policy gradient g_m (the training loss's gradient at ratio 1, all of
the batch's sequences in one weighted mean, exactly what one update would see). Reported per
algorithm: `E||g - mean g||^2` (the trace of the gradient's covariance, unbiased over M) and
the variance of `||g||`, and their ratios to the first algorithm (`grpo` by default).

Matched compute: the first algorithm's batches are played first; its mean per-task cost (in
`rollout.budget_unit`) becomes the explicit budget of the tree algorithms, and its episodes warm
the length model and the entropy threshold. Every algorithm's measured cost is reported.

  python -m bpo_jax.probe --config=experiments/alfworld.py:cpu --workdir=runs/alfworld_cpu \
      --algos=grpo,bpo --batches=8

reads the run's latest checkpoint (the policy after BC/RL), writes `probe.json` in the workdir
and the `probe/*` ratios into its metrics.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bpo_jax import learner
from bpo_jax.algorithms import ALGORITHMS
from bpo_jax.builders import make_critic
from bpo_jax.config import ExperimentConfig
from bpo_jax.learner import round_up
from bpo_jax.rl import RolloutState, forest_advantages, forest_examples, play_batch


def make_grad_fn(graphdef, temperature: float, loss_agg: str):
    """Jitted `(params, batch) -> (grads, weight_sum)` of the clipped PG loss at ratio 1."""
    model_fn = learner.make_model_fn(graphdef)

    @jax.jit
    def grad_fn(params, batch):
        def objective(p):
            loss, _ = learner.pg_loss(
                model_fn, p, batch, clip_eps=0.2, loss_agg=loss_agg, temperature=temperature
            )
            return loss

        den = jnp.sum(batch.loss_mask * batch.weights[:, None])
        return jax.grad(objective)(params), den

    return grad_fn


def batch_gradient(grad_fn, logprob_fn, params, examples, cfg: ExperimentConfig, pad_id: int):
    """The gradient of the loss over all `examples` as one token-weighted mean.

    Chunks of `train.minibatch_size` are combined with weights (their share of the total token
    weight), which equals a single batch's token-mean gradient.
    """
    size = cfg.train.minibatch_size
    total, acc = 0.0, None
    for i in range(0, len(examples), size):
        chunk = examples[i : i + size]
        length = round_up(max(len(e.tokens) for e in chunk), cfg.sampler.length_bucket)
        batch = learner.pad_batch(
            [e.tokens for e in chunk],
            [e.action_start for e in chunk],
            batch_size=size,
            length=length,
            pad_id=pad_id,
            advantages=[e.advantage for e in chunk],
            weights=[e.weight for e in chunk],
        )
        old, _ = logprob_fn(params, batch.tokens)  # Ratio 1: the behaviour policy is params.
        batch = dataclasses.replace(batch, old_logprobs=np.asarray(old) * batch.loss_mask)
        grads, den = grad_fn(params, batch)
        den = float(den)
        scaled = jax.tree.map(lambda g, d=den: g * d, grads)
        acc = scaled if acc is None else jax.tree.map(jnp.add, acc, scaled)
        total += den
    if acc is None:
        return None
    return jax.tree.map(lambda g: g / max(total, 1e-12), acc)


@dataclasses.dataclass
class _Moments:
    """Streaming first and second moments of gradients (one parameter-sized buffer)."""

    count: int = 0
    total: object = None
    sq_norms: list = dataclasses.field(default_factory=list)

    def add(self, g) -> None:
        self.count += 1
        self.total = g if self.total is None else jax.tree.map(jnp.add, self.total, g)
        self.sq_norms.append(float(optax.tree.norm(g)) ** 2)

    def summary(self) -> dict:
        m = self.count
        mean_sq = float(optax.tree.norm(self.total)) ** 2 / m**2
        norms = np.sqrt(self.sq_norms)
        # E||g - mean||^2 with the unbiased M / (M - 1) correction.
        trace = (np.mean(self.sq_norms) - mean_sq) * m / max(m - 1, 1)
        # ||E g||^2 without the trace / M that the mean of M noisy gradients adds to it.
        signal = max(mean_sq - trace / m, 0.0)
        return {
            "batches": m,
            "trace_var": float(trace),
            "signal_sq": float(signal),
            # Noise relative to signal: comparable across estimators that scale advantages
            # differently (GRPO divides by the group std, BPO and RLOO do not).
            "noise_to_signal": float(trace / signal) if signal > 0 else float("inf"),
            "norm_var": float(np.var(norms, ddof=1)) if m > 1 else 0.0,
            "norm_mean": float(norms.mean()),
            "mean_grad_norm": float(np.sqrt(mean_sq)),
        }


def run_probe(pool, policy, graphdef, params, tasks, cfg, algos, num_batches, rng, pad_id):
    """Plays `num_batches` batches per algorithm at matched compute; returns the statistics."""
    if len(algos) < 1 or any(a not in ALGORITHMS for a in algos):
        raise ValueError(f"algos must name algorithms in {sorted(ALGORITHMS)}, got {algos}.")
    grad_fn = make_grad_fn(graphdef, cfg.sampler.temperature, cfg.train.loss_agg)
    logprob_fn = learner.make_logprob_fn(graphdef, cfg.sampler.temperature)
    policy.params = params
    shared = RolloutState.create(cfg)
    results, budget = {}, None
    for ai, algo in enumerate(algos):
        acfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, algo=algo))
        if budget is not None and ALGORITHMS[algo].branches:
            matched = dataclasses.replace(cfg.rollout, budget=budget)
            acfg = dataclasses.replace(acfg, rollout=matched)
        state = dataclasses.replace(shared, selector=RolloutState.create(acfg).selector)
        if hasattr(state.selector, "observe") and shared_entropies(results):
            state.selector.observe(shared_entropies(results))
        critic = make_critic(acfg, graphdef, _width(params), pad_id)
        moments, costs, first_entropies = _Moments(), [], []
        for m in range(num_batches):
            forest, _ = play_batch(
                pool, policy, tasks, acfg, state, jax.random.fold_in(rng, 1000 * ai + m)
            )
            adv, _ = forest_advantages(forest, acfg, critic, params)
            examples = forest_examples(forest, adv, forest.step_weights(cfg.train.step_weighting))
            g = batch_gradient(grad_fn, logprob_fn, params, examples, acfg, pad_id)
            if g is not None:
                moments.add(g)
            costs.append(float(np.mean(forest.task_cost)))
            first_entropies += [float(s.entropies[0]) for s in forest.steps() if s.entropies.size]
            results.setdefault(algo, {}).setdefault("leaves", []).append(len(forest.leaves))
            results[algo].setdefault("generated_tokens", []).append(forest.stats.generated_tokens)
        results[algo].update(moments.summary())
        results[algo]["task_cost_mean"] = float(np.mean(costs))
        results[algo]["first_entropies"] = first_entropies
        if ai == 0:
            budget = float(np.mean(costs))
    base = algos[0]
    for algo in algos:
        r = results[algo]
        r.pop("first_entropies", None)
        r["trace_var_ratio"] = r["trace_var"] / max(results[base]["trace_var"], 1e-30)
        r["norm_var_ratio"] = r["norm_var"] / max(results[base]["norm_var"], 1e-30)
        r["noise_to_signal_ratio"] = r["noise_to_signal"] / max(
            results[base]["noise_to_signal"], 1e-30
        )
    return results


def shared_entropies(results: dict) -> list[float]:
    return [e for r in results.values() for e in r.get("first_entropies", [])]


def _width(params) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, leaf in leaves:
        if "embed_tokens" in jax.tree_util.keystr(path):
            return int(leaf.shape[-1])
    raise ValueError("Cannot find the embedding to size the value head.")


def main(argv):
    from absl import flags
    from absl import logging as absl_logging
    from flax import nnx

    from bpo_jax import builders
    from bpo_jax.checkpoint import Checkpointer
    from bpo_jax.config import validate
    from bpo_jax.metrics import MetricWriter
    from bpo_jax.models import sharding
    from bpo_jax.run_state import initial_state

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint operation.
    f = flags.FLAGS
    cfg = validate(f.config)
    workdir = Path(f.workdir).absolute()
    algos = [a.strip() for a in f.algos.split(",") if a.strip()]
    train_tasks, _ = builders.select_tasks(cfg)
    tasks = train_tasks[: cfg.train.tasks_per_iter]
    mesh = sharding.make_mesh(cfg.mesh.axes)
    with builders.make_pool(cfg) as pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        tokenizer = builders.build_tokenizer(cfg, workdir, demos=[])
        mcfg, model = builders.build_model(cfg, tokenizer, mesh)
        graphdef, params = nnx.split(model)
        ckpt = Checkpointer(workdir / "checkpoints")
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"No checkpoint in {workdir / 'checkpoints'}: train first.")
        # The run's own state layout (critic and KL reference included), restored as it was saved.
        critic = builders.make_critic(cfg, graphdef, mcfg.hidden_size, tokenizer.pad_id)
        optimizer = learner.make_optimizer(1.0, 0.0, 0.9, 0.999, cfg.train.grad_clip)
        state = initial_state(cfg, params, optimizer, critic).restore(ckpt)
        ckpt.close()
        step, params = state.step, state.train.params
        policy = builders.make_policy(cfg, graphdef, params, tokenizer, mcfg, mesh)
        results = run_probe(
            pool,
            policy,
            graphdef,
            params,
            tasks,
            cfg,
            algos,
            f.batches,
            jax.random.key(cfg.seed + 7),
            tokenizer.pad_id,
        )
    out = {"update_step": step, "tasks": [t.task_id for t in tasks], "results": results}
    (workdir / "probe.json").write_text(json.dumps(out, indent=2))
    writer = MetricWriter(workdir)
    for algo in algos[1:]:
        writer.write(
            step,
            {
                f"probe/{algo}_over_{algos[0]}_trace_var": results[algo]["trace_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_norm_var": results[algo]["norm_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_noise_to_signal": results[algo][
                    "noise_to_signal_ratio"
                ],
            },
        )
    writer.close()
    print(
        f"{'algo':8} {'E|g-mean g|^2':>14} {'ratio':>7} {'Var|g|':>10} {'ratio':>7} "
        f"{'noise/signal':>12} {'ratio':>7} {'cost/task':>10}"
    )
    for algo in algos:
        r = results[algo]
        print(
            f"{algo:8} {r['trace_var']:14.4g} {r['trace_var_ratio']:7.3f} {r['norm_var']:10.4g} "
            f"{r['norm_var_ratio']:7.3f} {r['noise_to_signal']:12.4g} "
            f"{r['noise_to_signal_ratio']:7.3f} {r['task_cost_mean']:10.1f}"
        )


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
    flags.DEFINE_string("workdir", None, "A trained run's directory (its checkpoint is read).")
    flags.DEFINE_string("algos", "grpo,bpo", "Comma-separated algorithms; the first is the base.")
    flags.DEFINE_integer("batches", 8, "Rollout batches per algorithm.")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
