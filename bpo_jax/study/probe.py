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
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bpo_jax import learner
from bpo_jax.algorithms import ALGORITHMS
from bpo_jax.builders import make_agent, make_critic
from bpo_jax.config import ExperimentConfig
from bpo_jax.io import files
from bpo_jax.learner import round_up
from bpo_jax.rl import RolloutState, forest_advantages, tree_spec
from bpo_jax.rollout.engine import play_forest
from bpo_jax.study import stats


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
    """The gradient of the loss over all `examples` as one token-weighted mean; None where it
    is exactly zero (no examples, or every advantage 0).

    Chunks of `train.minibatch_size` are combined with weights (their share of the total token
    weight), which equals a single batch's token-mean gradient. At ratio 1 a chunk whose
    advantages are all 0 has a zero gradient: only its token weight is counted, on the host
    (most of a sparse-reward batch's tasks won nothing; their gradients cost nothing).
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
        if all(e.advantage == 0.0 for e in chunk):
            # `grad_fn`'s denominator, without the model.
            total += float(np.sum(batch.loss_mask * np.asarray(batch.weights)[:, None]))
            continue
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


SPEND_TOLERANCE = (0.95, 1.05)


def _hash(idx, salt: int):
    """A 32-bit mixing hash of uint32 indices (murmur3's finaliser)."""
    x = idx ^ jnp.uint32(salt)
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("dim",))
def _sketch_leaf(g, offset, dim: int, seed: int):
    idx = jnp.arange(g.size, dtype=jnp.uint32) + offset.astype(jnp.uint32)
    bucket = (_hash(idx, seed) % jnp.uint32(dim)).astype(jnp.int32)
    sign = 1.0 - 2.0 * (_hash(idx, seed + 0x5BD1E995) & jnp.uint32(1)).astype(jnp.float32)
    return jax.ops.segment_sum(g.reshape(-1).astype(jnp.float32) * sign, bucket, dim)


def count_sketch(tree, dim: int, seed: int = 0) -> np.ndarray:
    """A count sketch of a pytree's flattened values: float32 [dim], `E<S x, S y> = <x, y>`."""
    out, offset = jnp.zeros((dim,), jnp.float32), 0
    for leaf in jax.tree.leaves(tree):
        out = out + _sketch_leaf(leaf, jnp.asarray(offset % 2**32, jnp.uint32), dim, seed)
        offset += leaf.size
    return np.asarray(out, np.float64)


class ModelGradients:
    """Per-task gradients of the policy-gradient loss of a language-model policy (sketched).

    `__call__(forest, adv, weights, cfg) -> [num_tasks, sketch_dim]` plus `exact_batch`, the
    exact batch gradient (the mean over tasks) of the last call, for the streamed trace.
    """

    def __init__(self, graphdef, params, pad_id: int, cfg: ExperimentConfig, sketch_dim=2**15):
        self.grad_fn = make_grad_fn(graphdef, cfg.sampler.temperature, cfg.train.loss_agg)
        self.logprob_fn = learner.make_logprob_fn(graphdef, cfg.sampler.temperature)
        self.params, self.pad_id, self.dim = params, pad_id, sketch_dim
        self.exact_batch = None

    def __call__(self, forest, adv, weights, cfg) -> np.ndarray:
        task_of = [seg.task for seg in forest.segments for _ in seg.steps]
        by_task = [[] for _ in forest.task_ids]
        for step, task, a, w in zip(forest.steps(), task_of, adv, weights):
            if step.action_ids:
                by_task[task].append(
                    learner.Example(
                        step.prompt_ids + step.action_ids, len(step.prompt_ids), float(a), float(w)
                    )
                )
        rows, total = [], None
        for examples in by_task:
            g = batch_gradient(
                self.grad_fn, self.logprob_fn, self.params, examples, cfg, self.pad_id
            )
            if g is None:  # Nothing generated, or no advantage: an exactly zero gradient.
                rows.append(np.zeros(self.dim))
                continue
            rows.append(count_sketch(g, self.dim))
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        n = len(by_task)
        self.exact_batch = None if total is None else jax.tree.map(lambda x: x / n, total)
        return np.stack(rows)


def _play(pool, policy, encode, tasks, cfg: ExperimentConfig, state: RolloutState, rng):
    """`rl.play_batch` with a given prompt encoder (tabular policies read state ids)."""
    forest = play_forest(
        pool,
        policy,
        encode,
        tasks,
        tree_spec(cfg, state),
        rng=rng,
        selector=state.selector,
        lengths=state.lengths,
        costs=state.costs,
    )
    state.adapt(cfg, forest)
    return forest


class StreamedTrace:
    """`E||g - mean g||^2` (unbiased over M) of gradients seen one at a time, kept as a running
    sum (one parameter-sized buffer) and each gradient's squared norm. `add(None)` counts an
    exactly zero gradient (a batch that won nothing): it is one of the M draws."""

    def __init__(self, total=None, sq=()):
        self.total, self.sq = total, list(sq)

    def add(self, tree) -> None:
        if tree is None:
            self.sq.append(0.0)
            return
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
        self.total = leaves if self.total is None else [a + b for a, b in zip(self.total, leaves)]
        self.sq.append(float(optax.tree.norm(leaves)) ** 2)

    def value(self) -> float:
        m = len(self.sq)
        total = 0.0 if self.total is None else float(optax.tree.norm(self.total)) ** 2
        return float((np.mean(self.sq) - total / m**2) * m / max(m - 1, 1))


def _npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class ProbeStore:
    """A probe's recorded batches on disk (`ROOT/<algo>/`), so an interrupted probe resumes.

    A recorded batch is written as `batch_<m>.npz` (its per-task gradient rows, task costs,
    leaves, tokens and first-step entropies), then committed by `resume.npz`: the number of
    batches done, the rollout state after the batch (`RolloutState.dump`) and the exact trace's
    running sum. A batch file past the committed count was cut short and is played again. A
    resumed probe plays the remaining batches with the same keys from the saved rollout
    statistics; the branch rule's own random stream is not saved, so those batches are fresh
    draws of the same procedure rather than bit-for-bit an uninterrupted run's.

    `identity` (JSON data: the config, algorithms, tasks, batches, parameters' step) is written
    once; a store holding another probe's batches is refused, naming what differs.
    """

    def __init__(self, root, identity: dict):
        self.root = files.as_path(root)
        identity = json.loads(json.dumps(identity, default=str))  # As it reads back.
        path = self.root / "identity.json"
        if path.exists():
            held = json.loads(path.read_text())
            if held != identity:
                keys = sorted(
                    k for k in held.keys() | identity.keys() if held.get(k) != identity.get(k)
                )
                raise ValueError(
                    f"{self.root} holds the batches of a different probe (it differs in "
                    f"{keys}); remove that folder to start this probe over."
                )
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            files.write_text(path, json.dumps(identity, indent=2, sort_keys=True))

    def load(self, algo: str) -> tuple[list[dict], dict | None, StreamedTrace]:
        """The committed batches of `algo` (in order), the rollout state after the last one
        (None when there are none) and the exact trace so far."""
        path = self.root / algo / "resume.npz"
        if not path.exists():
            return [], None, StreamedTrace()
        with np.load(io.BytesIO(path.read_bytes())) as z:
            count = int(z["count"])
            state = json.loads(str(z["state"]))
            sq = z["sq"].tolist()
            total = [z[f"total_{i}"] for i in range(int(z["num_leaves"]))] or None
        batches = []
        for m in range(count):
            batch_path = self.root / algo / f"batch_{m:04d}.npz"
            if not batch_path.exists():
                raise FileNotFoundError(
                    f"{batch_path} is missing but {path} commits {count} batches: the store is "
                    "damaged; remove its folder to start the probe over."
                )
            with np.load(io.BytesIO(batch_path.read_bytes())) as z:
                batches.append({k: z[k] for k in z.files})
        total = None if total is None else [jnp.asarray(x) for x in total]
        return batches, state, StreamedTrace(total, sq)

    def save(self, algo: str, m: int, batch: dict, state: dict, trace: StreamedTrace) -> None:
        """Writes batch `m` of `algo`, then commits it (`m + 1` batches done)."""
        folder = self.root / algo
        folder.mkdir(parents=True, exist_ok=True)
        files.write_bytes(folder / f"batch_{m:04d}.npz", _npz_bytes(**batch))
        total = {f"total_{i}": np.asarray(x) for i, x in enumerate(trace.total or [])}
        files.write_bytes(
            folder / "resume.npz",
            _npz_bytes(
                count=np.asarray(m + 1),
                state=np.asarray(json.dumps(state)),
                sq=np.asarray(trace.sq, np.float64),
                num_leaves=np.asarray(len(total)),
                **total,
            ),
        )


def _trace_summary(k: np.ndarray, norms: np.ndarray) -> dict:
    m = k.shape[0]
    trace = stats.trace_covariance_from_gram(k)
    mean_sq = float(k.sum()) / m**2
    signal = max(mean_sq - trace / m, 0.0)  # ||E g||^2 without the trace / M of the mean.
    return {
        "batches": m,
        "trace_var": trace,
        "signal_sq": signal,
        # Comparable across estimators that scale advantages differently (GRPO).
        "noise_to_signal": trace / signal if signal > 0 else float("inf"),
        "norm_var": float(np.var(norms, ddof=1)),
        "norm_mean": float(norms.mean()),
        "mean_grad_norm": float(np.sqrt(mean_sq)),
    }


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

    Returns:
      {algo: statistics}; `spend_warning` is set where the spend is not matched.
    """
    if len(algos) < 1 or any(a not in ALGORITHMS for a in algos):
        raise ValueError(f"algos must name algorithms in {sorted(ALGORITHMS)}, got {algos}.")
    if num_batches < 2:
        raise ValueError(f"num_batches must be >= 2 for a variance, got {num_batches}.")
    if encode is None:  # The run's own turn format (tiny or chat).
        encode = make_agent(cfg, policy.tokenizer)
    boot = np.random.default_rng(seed)
    # The exact batch-level trace, where the gradient function gives exact batch gradients.
    exact = hasattr(gradients, "exact_batch")
    shared = RolloutState.create(cfg)
    results, grams, per_task_grams = {}, {}, {}
    budget = ref_cost = None
    entropies: list[float] = []
    for ai, algo in enumerate(algos):
        acfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, algo=algo))
        tree = ALGORITHMS[algo].branches
        if budget is not None and tree:
            acfg = dataclasses.replace(
                acfg, rollout=dataclasses.replace(cfg.rollout, budget=budget)
            )
        state = dataclasses.replace(shared, selector=RolloutState.create(acfg).selector)
        if entropies:
            state.selector.observe(np.asarray(entropies))
        critic = critic_for(acfg) if (critic_for and acfg.algorithm.needs_critic) else None
        done, dump, trace = store.load(algo) if store else ([], None, StreamedTrace())
        if dump is not None:  # Resumed: the rollout statistics as they were after the last batch.
            state = RolloutState.create(acfg).loaded(dump)
            shared = dataclasses.replace(shared, lengths=state.lengths, costs=state.costs)
        rows = [b["rows"] for b in done]
        costs = [b["costs"] for b in done]
        leaves = [int(b["leaves"]) for b in done]
        tokens = [int(b["tokens"]) for b in done]
        if ai == 0:
            entropies += [float(x) for b in done for x in b["entropies"]]
        first = len(done) if done else -(warmup_batches if (tree and ai) else 0)
        for m in range(first, num_batches):
            start = time.perf_counter()
            key = jax.random.fold_in(rng, 100_000 * ai + m + 1000)
            forest = _play(pool, policy, encode, tasks, acfg, state, key)
            if m < 0:
                continue
            adv, _ = forest_advantages(forest, acfg, critic, params)
            g = gradients(forest, adv, forest.step_weights(acfg.train.step_weighting), acfg)
            batch = {
                "rows": np.asarray(g, np.float64),
                "costs": np.asarray(forest.task_cost, np.float64),
                "leaves": np.asarray(len(forest.leaves)),
                "tokens": np.asarray(forest.stats.generated_tokens),
                "entropies": np.asarray(
                    [float(s.entropies[0]) for s in forest.steps() if s.entropies.size]
                    if ai == 0
                    else [],
                    np.float64,
                ),
            }
            if exact:
                trace.add(gradients.exact_batch)  # None: this batch's gradient is exactly 0.
            if store is not None:
                store.save(algo, m, batch, state.dump(), trace)
            rows.append(batch["rows"])
            costs.append(batch["costs"])
            leaves.append(int(batch["leaves"]))
            tokens.append(int(batch["tokens"]))
            if ai == 0:
                entropies += batch["entropies"].tolist()
            if progress is not None:
                target = f" of a budget of {budget:.0f}" if (tree and ai) else ""
                progress(
                    f"probe {algo} batch {m + 1}/{num_batches}: "
                    f"{time.perf_counter() - start:.0f} s, cost per task "
                    f"{batch['costs'].mean():.0f}{target}, {len(forest.leaves)} leaves, "
                    f"{int(np.count_nonzero(np.asarray(adv)))} steps with an advantage"
                )
        g_mtd = np.stack(rows)  # [M, tasks, D]
        costs = np.stack(costs)  # [M, tasks]
        batch = g_mtd.mean(axis=1)
        grams[algo] = stats.gram(batch)
        per_task_grams[algo] = [stats.gram(g_mtd[:, t]) for t in range(g_mtd.shape[1])]
        r = _trace_summary(grams[algo], np.linalg.norm(batch, axis=1))
        r["per_task_trace_var"] = [
            stats.trace_covariance_from_gram(k) for k in per_task_grams[algo]
        ]
        if exact:
            r["exact_trace_var"] = trace.value()
        r["leaves"], r["generated_tokens"] = leaves, tokens
        r["task_cost_mean"] = float(costs.mean())
        r["task_cost_per_task"] = costs.mean(axis=0).tolist()
        if ai == 0:
            budget = ref_cost = float(costs.mean())
        r["budget"] = budget if (tree and ai) else None
        r["spend_ratio"] = float(costs.mean() / ref_cost)
        r["spend_ratio_per_task"] = (costs.mean(axis=0) / ref_cost).tolist()
        lo, hi = SPEND_TOLERANCE
        r["spend_matched"] = bool(lo <= r["spend_ratio"] <= hi)
        r["spend_warning"] = None
        if not r["spend_matched"]:
            r["spend_warning"] = (
                f"{algo} spent {r['spend_ratio']:.3f} of {algos[0]}'s measured cost per task "
                f"(outside [{lo}, {hi}]): its variance ratio is not at matched spend."
            )
        results[algo] = r
    base = algos[0]
    for algo in algos:
        r, b = results[algo], results[base]
        ratio, ci = stats.trace_ratio_ci(grams[algo], grams[base], boot, num_resamples)
        r["trace_var_ratio"], r["trace_var_ratio_ci95"] = ratio, list(ci)
        r["per_task"] = []
        for k_a, k_b in zip(per_task_grams[algo], per_task_grams[base]):
            if stats.trace_covariance_from_gram(k_b) <= 0:
                r["per_task"].append({"trace_var_ratio": None, "ci95": None})
                continue
            t_ratio, t_ci = stats.trace_ratio_ci(k_a, k_b, boot, num_resamples)
            r["per_task"].append({"trace_var_ratio": t_ratio, "ci95": list(t_ci)})
        r["norm_var_ratio"] = r["norm_var"] / max(b["norm_var"], 1e-30)
        r["noise_to_signal_ratio"] = r["noise_to_signal"] / max(b["noise_to_signal"], 1e-30)
    return results


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
    from bpo_jax.config import validate
    from bpo_jax.io.checkpoint import Checkpointer
    from bpo_jax.io.metrics import MetricWriter
    from bpo_jax.models import sharding
    from bpo_jax.run_state import initial_state

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every checkpoint operation.
    f = flags.FLAGS
    cfg = validate(f.config)
    workdir = files.as_path(f.workdir)
    algos = [a.strip() for a in f.algos.split(",") if a.strip()]
    train_tasks, _ = builders.select_tasks(cfg)
    tasks = train_tasks[: cfg.train.tasks_per_iter]
    mesh = sharding.make_mesh(cfg.mesh.axes, dcn_data=cfg.mesh.dcn_data)
    # The policy probed: the workdir's own run, else (a sweep's probe of its start, in a folder
    # of its own) the run `init_from` names.
    source = workdir
    if not (workdir / "checkpoints").is_dir() and cfg.init_from:
        source = files.as_path(cfg.init_from)
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "config.json").exists():
        files.write_text(
            workdir / "config.json", json.dumps(f.config.to_dict(), indent=2, default=str)
        )
    with builders.make_pool(cfg) as pool, jax.set_mesh(mesh), sharding.axis_rules(cfg.mesh.rules):
        if not (cfg.model.tokenizer or cfg.model.hf_checkpoint):
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
        step, params = state.step, state.train.params
        policy = builders.make_policy(cfg, graphdef, params, tokenizer, mcfg, mesh)
        # Recorded batches are kept as they finish: a re-run of this command resumes after them.
        identity = {
            "config": f.config.to_dict(),
            "algos": algos,
            "batches": f.batches,
            "warmup_batches": f.warmup_batches,
            "sketch_dim": f.sketch_dim,
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
        )
    warnings = [r["spend_warning"] for r in results.values() if r["spend_warning"]]
    out = {
        "update_step": step,
        "tasks": [t.task_id for t in tasks],
        "results": results,
        "warnings": warnings,
    }
    files.write_text(workdir / "probe.json", json.dumps(out, indent=2))
    writer = MetricWriter(workdir)
    for algo in algos[1:]:
        lo, hi = results[algo]["trace_var_ratio_ci95"]
        writer.write(
            step,
            {
                f"probe/{algo}_over_{algos[0]}_trace_var": results[algo]["trace_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_trace_var_lo": lo,
                f"probe/{algo}_over_{algos[0]}_trace_var_hi": hi,
                f"probe/{algo}_spend_ratio": results[algo]["spend_ratio"],
                f"probe/{algo}_over_{algos[0]}_norm_var": results[algo]["norm_var_ratio"],
                f"probe/{algo}_over_{algos[0]}_noise_to_signal": results[algo][
                    "noise_to_signal_ratio"
                ],
            },
        )
    writer.close()
    print(
        f"{'algo':8} {'E|g-mean g|^2':>14} {'ratio':>7} {'95% CI':>15} {'Var|g|':>10} "
        f"{'ratio':>7} {'spend':>6} {'cost/task':>10}"
    )
    for algo in algos:
        r = results[algo]
        lo, hi = r["trace_var_ratio_ci95"]
        print(
            f"{algo:8} {r['trace_var']:14.4g} {r['trace_var_ratio']:7.3f} [{lo:5.3f}, {hi:5.3f}] "
            f"{r['norm_var']:10.4g} {r['norm_var_ratio']:7.3f} {r['spend_ratio']:6.3f} "
            f"{r['task_cost_mean']:10.1f}"
        )
    for w in warnings:
        print("WARNING:", w)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
    flags.DEFINE_string("workdir", None, "A trained run's directory (its checkpoint is read).")
    flags.DEFINE_string(
        "algos", "rloo,bpo", "Comma-separated algorithms; the first is the reference."
    )
    flags.DEFINE_integer("batches", 64, "Recorded rollout batches per algorithm.")
    flags.DEFINE_integer("warmup_batches", 2, "Unrecorded batches of a tree algorithm first.")
    flags.DEFINE_integer("sketch_dim", 2**15, "Coordinates of each gradient's count sketch.")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
