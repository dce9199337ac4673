"""The probe's sampling: an algorithm's rollout batches played at fixed parameters, each task's
policy gradient (a count sketch of it for a language model), and `ProbeStore`, which keeps the
recorded batches so that an interrupted probe resumes after them.

`bpo_jax.study.probe` says what is measured and why; `bpo_jax.study.probe_stats` reads the
batches.
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

from bpo_jax import learner
from bpo_jax.config import ExperimentConfig
from bpo_jax.io import files
from bpo_jax.learner import round_up
from bpo_jax.rl import SHRINK_ESTIMATOR, RolloutState, forest_advantages, tree_spec
from bpo_jax.rollout.engine import play_forest
from bpo_jax.rollout.explained import COLUMNS, ExplainedShare, measure_parts
from bpo_jax.study.probe_stats import Recorded, StreamedTrace


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


class BatchSampler:
    """Plays and records each algorithm's batches in turn (`record`), at the same parameters.

    The rollout statistics (episode lengths, costs) carry over from one algorithm to the next, and
    the reference's first-step entropies (the first algorithm's) warm every other's branch rule.
    The arguments are `bpo_jax.study.probe.run_probe`'s.
    """

    def __init__(
        self,
        pool,
        policy,
        encode,
        tasks,
        cfg: ExperimentConfig,
        rng,
        gradients,
        *,
        critic_for=None,
        params=None,
        warmup_batches: int = 2,
        store: ProbeStore | None = None,
        progress=None,
    ):
        self.pool, self.policy, self.encode, self.tasks = pool, policy, encode, tasks
        self.rng, self.gradients, self.critic_for, self.params = rng, gradients, critic_for, params
        self.warmup_batches, self.store, self.progress = warmup_batches, store, progress
        # The exact batch-level trace, where the gradient function gives exact batch gradients.
        self.exact = hasattr(gradients, "exact_batch")
        self.shared = RolloutState.create(cfg)
        self.entropies: list[float] = []

    def record(
        self,
        index: int,
        algo: str,
        acfg: ExperimentConfig,
        num_batches: int,
        budget: float | None,
        variants: tuple[str, ...] = (),
    ) -> Recorded:
        """Plays `num_batches` recorded batches of `algo` (`acfg` its config), after the store's.

        Args:
          index: the algorithm's place in the probe's list (0: the reference).
          algo: its name.
          acfg: the experiment config with `train.algo` (and the budget) set to the algorithm's.
          num_batches: M, the batches recorded in all (the store's included).
          budget: the explicit budget of a tree algorithm at matched spend; it first plays
            `warmup_batches` unrecorded batches. None: the reference, or no tree.
          variants: tree algorithms whose gradients are also taken on `algo`'s forests (other
            estimators on the same trees and spend: a paired comparison); each gets a record in
            the returned one's `variants`.
        """
        shared, entropies = self.shared, self.entropies
        # A tree algorithm measures f on every batch, and `bpo_shrink`'s lam for a batch comes
        # from the batches before it only (`rollout.explained`), as in a run.
        measured = ExplainedShare() if acfg.algorithm.branches else None
        state = dataclasses.replace(
            shared, selector=RolloutState.create(acfg).selector, explained=measured
        )
        if entropies:
            state.selector.observe(np.asarray(entropies))
        needs_critic = self.critic_for and acfg.algorithm.needs_critic
        critic = self.critic_for(acfg) if needs_critic else None
        store = self.store
        done, dump, trace = store.load(algo) if store else ([], None, StreamedTrace())
        if dump is not None:  # Resumed: the rollout statistics as they were after the last batch.
            state = RolloutState.create(acfg).loaded(dump)
            self.shared = dataclasses.replace(shared, lengths=state.lengths, costs=state.costs)
        rows = [b["rows"] for b in done]
        costs = [b["costs"] for b in done]
        leaves = [int(b["leaves"]) for b in done]
        tokens = [int(b["tokens"]) for b in done]
        parts = [_parts_of(b) for b in done]
        lams = [float(b["shrink"]) for b in done if "shrink" in b]
        variant_rows = {v: [b[f"rows@{v}"] for b in done] for v in variants}
        if index == 0:
            entropies += [float(x) for b in done for x in b["entropies"]]
        first = len(done) if done else -(self.warmup_batches if budget is not None else 0)
        for m in range(first, num_batches):
            start = time.perf_counter()
            key = jax.random.fold_in(self.rng, 100_000 * index + m + 1000)
            # `bpo_shrink`'s lam for this batch, from the batches before it only.
            lam = state.explained.shrink_lambda() if state.explained is not None else None
            forest = _play(self.pool, self.policy, self.encode, self.tasks, acfg, state, key)
            batch_parts = measure_parts(forest) if state.explained is not None else None
            if batch_parts is not None:
                state.explained.add(batch_parts)
            if m < 0:
                continue
            adv, _ = forest_advantages(forest, acfg, critic, self.params, _lam_of(acfg, lam))
            weights = forest.step_weights(acfg.train.step_weighting)
            g = self.gradients(forest, adv, weights, acfg)
            exact_batch = getattr(self.gradients, "exact_batch", None)
            for v in variants:  # The same forest under another estimator.
                vcfg = dataclasses.replace(acfg, train=dataclasses.replace(acfg.train, algo=v))
                v_adv, _ = forest_advantages(forest, vcfg, None, self.params, _lam_of(vcfg, lam))
                variant_rows[v].append(np.asarray(self.gradients(forest, v_adv, weights, vcfg)))
            batch = {
                "rows": np.asarray(g, np.float64),
                "costs": np.asarray(forest.task_cost, np.float64),
                "leaves": np.asarray(len(forest.leaves)),
                "tokens": np.asarray(forest.stats.generated_tokens),
                "entropies": np.asarray(
                    [float(s.entropies[0]) for s in forest.steps() if s.entropies.size]
                    if index == 0
                    else [],
                    np.float64,
                ),
            }
            batch.update({f"rows@{v}": variant_rows[v][-1] for v in variants})
            if batch_parts is not None:
                batch.update({f"parts_{k}": np.asarray(v) for k, v in batch_parts.items()})
                parts.append(batch_parts)
                batch["shrink"] = np.asarray(lam, np.float64)
                lams.append(float(lam))
            if self.exact:
                trace.add(exact_batch)  # None: this batch's gradient is exactly 0.
            if store is not None:
                store.save(algo, m, batch, state.dump(), trace)
            rows.append(batch["rows"])
            costs.append(batch["costs"])
            leaves.append(int(batch["leaves"]))
            tokens.append(int(batch["tokens"]))
            if index == 0:
                entropies += batch["entropies"].tolist()
            if self.progress is not None:
                target = f" of a budget of {budget:.0f}" if budget is not None else ""
                self.progress(
                    f"probe {algo} batch {m + 1}/{num_batches}: "
                    f"{time.perf_counter() - start:.0f} s, cost per task "
                    f"{batch['costs'].mean():.0f}{target}, {len(forest.leaves)} leaves, "
                    f"{int(np.count_nonzero(np.asarray(adv)))} steps with an advantage"
                )
        shrinks = lams if _lam_of(acfg, 0.0) is not None else []
        out = Recorded(rows, costs, leaves, tokens, trace if self.exact else None, parts, shrinks)
        for v in variants:
            vcfg = dataclasses.replace(acfg, train=dataclasses.replace(acfg.train, algo=v))
            v_shrinks = lams if _lam_of(vcfg, 0.0) is not None else []
            out.variants[v] = Recorded(
                variant_rows[v], costs, leaves, tokens, None, parts, v_shrinks
            )
        return out


def _lam_of(cfg: ExperimentConfig, lam: float | None) -> float | None:
    """`lam` where `cfg`'s estimator takes one (`bpo_shrink`), else None."""
    return lam if cfg.algorithm.estimator == SHRINK_ESTIMATOR else None


def _parts_of(batch: dict) -> dict | None:
    """A stored batch's f parts (`rollout.explained.COLUMNS`); None: not a tree's batch."""
    if f"parts_{COLUMNS[0]}" not in batch:
        return None
    return {k: np.asarray(batch[f"parts_{k}"]) for k in COLUMNS}
