"""The host side of the update: examples, minibatches and `RLUpdater`, which scores behaviour
log-probs and runs the clipped policy-gradient epochs.

Rows whose advantage is zero add nothing to the clipped surrogate's gradient (`-min(r A,
clip(r) A)` is 0 for every ratio when A = 0), only to its denominator. Without a KL term the
update leaves them out (`train.skip_zero_advantage`): each minibatch is drawn as before, its
rows with a nonzero advantage are padded to a row bucket and trained with their loss scaled by
their share of the whole minibatch's denominator, and a minibatch without such rows is an
optimizer step on a zero gradient. The parameters follow the same path up to float rounding;
with sparse rewards most rows of a batch have A = 0 (five in six in the CPU tables' runs).
Diagnostics (`entropy`, `clip_frac`, `approx_kl_old`) are then over the trained rows only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from bpo_jax.learner.batch import pad_batch
from bpo_jax.learner.losses import pg_loss
from bpo_jax.learner.step import (
    TrainState,
    full_reference,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    make_zero_step,
    state_shardings,
)
from bpo_jax.parallel import distributed

log = logging.getLogger(__name__)


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class Example:
    """One training sequence: a step's prompt followed by the tokens the policy generated."""

    tokens: list[int]
    action_start: int
    advantage: float
    weight: float = 1.0  # Loss weight (see `RolloutForest.step_weights`).


def minibatches(items: Sequence, size: int, rng: np.random.Generator):
    order = rng.permutation(len(items))
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i : i + size]]


def loss_denominator_of(examples: Sequence[Example], loss_agg: str) -> float:
    """`losses.loss_denominator` of the batch `pad_batch` makes from `examples`, on the host."""
    weights = np.array([e.weight for e in examples], np.float64)
    tokens = np.array([len(e.tokens) - e.action_start for e in examples], np.float64)
    live = weights > 0
    if loss_agg == "token_mean":
        return float(np.sum(weights * tokens * live))
    if loss_agg == "seq_mean":
        return float(np.sum(weights * (live & (tokens > 0))))
    raise ValueError(f"Unknown loss_agg {loss_agg!r}.")


def row_bucket(rows: int, minibatch: int, unit: int = 1) -> int:
    """The padded row count of a part of a minibatch: the next power of two, at least an
    eighth of the minibatch (so at most four shapes compile per sequence length), a multiple
    of `unit` (the devices the rows split over, or the microbatch), at most the minibatch."""
    size = max(1 << max(rows - 1, 0).bit_length(), minibatch // 8, 1)
    return min(round_up(size, unit), round_up(minibatch, unit))


class RLUpdater:
    """Holds the jitted update and scoring functions for the clipped policy gradient."""

    def __init__(
        self, graphdef, cfg, pad_id: int, write: Callable[[int, dict], None], *, params=None
    ):
        """Builds the update for `cfg`'s train section.

        Args:
          graphdef: the policy's graphdef.
          cfg: the `config.ExperimentConfig`.
          pad_id: the padding token of update batches.
          write: `write(step, metrics)` of the run's metric writer.
          params: the policy's parameters (arrays or `ShapeDtypeStruct`s with `NamedSharding`s):
            when given, the update's state shardings are explicit (`state_shardings`), the
            optimizer state laid out like the parameters.
        """
        t = cfg.train
        self.cfg = cfg
        self.pad_id = pad_id
        self.write = write
        self.optimizer = make_optimizer(t.lr, t.weight_decay, t.b1, t.b2, t.grad_clip)
        # The policy optimised is the tempered one the rollouts sample from.
        temp = cfg.sampler.temperature

        def loss(fn, params, batch, ref_logprobs=None):
            return pg_loss(
                fn,
                params,
                batch,
                clip_eps=t.clip_eps,
                loss_agg=t.loss_agg,
                temperature=temp,
                kl_coef=t.kl_coef,
                ref_logprobs=ref_logprobs,
            )

        shardings = None
        # Update batches become global arrays over the parameters' mesh, their rows split over
        # its batch axes (each host contributes the rows its devices hold).
        self.mesh = distributed.mesh_of(params) if params is not None else None
        if self.mesh is not None:
            warn_if_rows_replicated(t.microbatch_size or t.minibatch_size, self.mesh, cfg)
        if params is not None:
            shardings = state_shardings(
                self.optimizer, params, jax.tree.map(lambda x: x.sharding, params)
            )
        self.step_fn = make_train_step(
            graphdef,
            self.optimizer,
            loss,
            microbatch_size=t.microbatch_size,
            loss_agg=t.loss_agg,
            remat=cfg.model.remat,
            logits_chunk=t.logits_chunk,
            scan_layers=cfg.model.scan_layers,
            shardings=shardings,
        )
        self.zero_step_fn = make_zero_step(self.optimizer, shardings)
        self.logprob_fn = make_logprob_fn(graphdef, temp, logits_chunk=t.logits_chunk)
        # Rows with A = 0 are left out only where they have no loss at all (no KL term).
        self.skip_zero_rows = bool(t.skip_zero_advantage) and t.kl_coef == 0
        self.row_unit = math.lcm(t.microbatch_size or 1, batch_devices(self.mesh, cfg))

    def update(
        self,
        state: TrainState,
        examples: list[Example],
        seed: Sequence[int],
        ref_params=None,
    ):
        """Runs `train.epochs` passes of minibatch updates; returns (state, per-update metrics).

        `ref_params` (the frozen reference policy) is needed when `train.kl_coef > 0`.
        """
        if self.cfg.train.kl_coef > 0 and ref_params is None:
            raise ValueError("config.train.kl_coef > 0 needs the reference policy's parameters.")
        t = self.cfg.train
        rng = np.random.default_rng(list(seed))
        # Behaviour log-probs for every example, from the parameters the rollouts used, before
        # any update: with several minibatches or epochs the ratios are then true PPO ratios.
        batches = []
        for chunk in minibatches(examples, t.minibatch_size, rng):
            rows, rows_padded, scale = chunk, t.minibatch_size, None
            if self.skip_zero_rows:
                rows = [e for e in chunk if e.advantage != 0 and e.weight > 0]
                if not rows:  # Every loss term is zero: an optimizer step on a zero gradient.
                    batches.append(None)
                    continue
                total = loss_denominator_of(chunk, t.loss_agg)
                scale = np.float32(loss_denominator_of(rows, t.loss_agg) / total)
                rows_padded = row_bucket(len(rows), t.minibatch_size, self.row_unit)
            length = round_up(max(len(e.tokens) for e in rows), self.cfg.sampler.length_bucket)
            batch = pad_batch(
                [e.tokens for e in rows],
                [e.action_start for e in rows],
                batch_size=rows_padded,
                length=length,
                pad_id=self.pad_id,
                advantages=[e.advantage for e in rows],
                weights=[e.weight for e in rows],
            )
            tokens = self._global(batch.tokens)
            old_lp, _ = self.logprob_fn(state.params, tokens)
            extra = ()
            if t.kl_coef > 0:
                ref = full_reference(state.params, ref_params)  # LoRA: the base, adapters off.
                extra = (self.logprob_fn(ref, tokens)[0],)
            old_lp = distributed.fetch(old_lp) * batch.loss_mask
            batch = self._global(dataclasses.replace(batch, old_logprobs=old_lp))
            kwargs = {} if scale is None else {"scale": self._global(scale)}
            batches.append((batch, extra, kwargs))
        history = []
        for epoch in range(t.epochs):
            order = rng.permutation(len(batches)) if epoch else range(len(batches))
            for i in order:
                if batches[i] is None:
                    state, metrics = self.zero_step_fn(state)
                else:
                    batch, extra, kwargs = batches[i]
                    state, metrics = self.step_fn(state, batch, *extra, **kwargs)
                metrics = {k: float(v) for k, v in metrics.items()}
                if self.skip_zero_rows:
                    metrics["pg_loss"] = metrics["loss"]  # The minibatch's, as `loss` (no KL).
                history.append(metrics)
                self.write(
                    int(state.step),
                    {"update/grad_norm": metrics["grad_norm"], "update/loss": metrics["loss"]},
                )
        return state, history

    def _global(self, tree):
        """Host arrays (the same on every host) as global arrays over the update's mesh."""
        return tree if self.mesh is None else distributed.global_batch(tree, self.mesh)


def batch_axes(cfg) -> tuple[str, ...]:
    """The mesh axes an update's rows split over (the `batch` sharding rule)."""
    entry = dict(cfg.mesh.rules).get("batch")
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def batch_devices(mesh, cfg) -> int:
    """The devices an update's rows split over: the product of the batch's mesh axes."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in batch_axes(cfg) if a in mesh.shape)


def warn_if_rows_replicated(rows: int, mesh, cfg) -> bool:
    """Warns when an update's rows cannot be split over every device of the batch's axes.

    A mesh axis that does not divide the rows is dropped from their sharding
    (`sharding.logical_to_spec`): each device then holds, and computes on, the rows of all
    devices along it. On 2 x v5litepod-64 (data 2 x fsdp 64) a microbatch of 64 rows asked for
    28.72 GiB of temporaries per chip, against 7.50 GiB at 128. Returns whether it warned.
    """
    axes = batch_axes(cfg)
    devices = batch_devices(mesh, cfg)
    if rows % devices == 0:
        return False
    log.warning(
        "An update's %d rows (train.microbatch_size, or minibatch_size without accumulation) "
        "do not split over the %d devices of the batch's mesh axes %s: the axes that do not "
        "divide them are replicated, and each device holds their rows. Use a multiple of %d.",
        rows,
        devices,
        axes,
        devices,
    )
    return True
