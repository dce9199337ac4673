"""Sampling contexts: a KV cache plus each row's next-token logits, and their row operations.

A `PrefillState` is what the sampler prefills into and generates from; `SampleOutput` is what a
`generate` call returns. Rows are independent contexts, so they can be regrouped freely:
`fork_rows` gathers (and duplicates) rows, which is how a BPO branch point continues one
context K ways without re-running its prefix, and `concat_states` stacks the rows of several
states into one batch (e.g. the forks of several branch points, for one `generate` call).
`regroup` does both, and cuts each row's context, in one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.models.llama import KVCache
from bpo_jax.sampler.replicas import row_mesh, rows_like


@dataclasses.dataclass(frozen=True)
class PrefillState:
    """Contexts ready to be sampled from: a KV cache and the logits for each row's next token.

    Attributes:
      cache: KV cache; row b holds `cache.lengths[b]` tokens of context.
      last_logits: [B, V] float32 logits of the next token of each row.
      prefilled_b: [B] int32 (numpy), real (non-padding) tokens this state's producing call ran
        through the model per row; zeros for states made by `generate` or `fork`.
      prefill_len: bucketed length T of the prefill that produced this state (0 if none); the
        model's actual work was `B * prefill_len` token positions.
      host_lengths: [B] int32 (numpy), `cache.lengths` as the producing call knew them on the
        host, or None. A prefill needs every row's cached length on the host (its capacity
        check and attention bound); reading it back from the device waits for the device's
        queue, 1-16 ms a turn on 2 busy CPU devices, so producers that know it pass it on.
    """

    cache: KVCache
    last_logits: jax.Array
    prefilled_b: np.ndarray
    prefill_len: int = 0
    host_lengths: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return self.last_logits.shape[0]

    @property
    def prefilled_tokens(self) -> int:
        """Real tokens prefilled by the call that produced this state, summed over rows."""
        return int(self.prefilled_b.sum())


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What `Sampler.generate` returns. Array fields are numpy, on the host.

    Attributes:
      tokens: [B, N] int32 sampled tokens; `pad_id` after a row's stop token or budget.
      logprobs: [B, N] float32 log-probability of each token under softmax(logits / temperature)
        before top-p truncation (untempered softmax when greedy); 0 at padding.
      entropies: [B, N] float32 entropy (nats) of that same distribution; 0 at padding.
      lengths: [B] int32 tokens generated per row, the stop token included.
      stopped: [B] bool, True where the row sampled one of `eos_ids`, False where it ran out of
        `max_new_tokens` (or of cache capacity).
      num_steps: decode steps the loop ran (each step runs the model over all B rows).
      state: the contexts after generation: each row's cache holds its prompt and every token it
        generated (the stop token included), so the next observation can be appended directly.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    num_steps: int
    state: PrefillState

    @property
    def num_generated(self) -> int:
        """Real tokens generated, summed over rows (for matched-compute accounting)."""
        return int(self.lengths.sum())


def concat_states(states: Sequence[PrefillState]) -> PrefillState:
    """Stacks the rows of several states into one batch (their caches' capacities must match).

    With `Sampler.fork` this regroups contexts freely, e.g. the K forks of several branch points
    into one `generate` call. The inputs stay valid; per-row prefill counts are carried along.
    """
    if not states:
        raise ValueError("concat_states needs at least one state.")
    known = all(s.host_lengths is not None for s in states)
    return PrefillState(
        cache=KVCache.concatenate([s.cache for s in states]),
        last_logits=jnp.concatenate([s.last_logits for s in states]),
        prefilled_b=np.concatenate([s.prefilled_b for s in states]),
        prefill_len=max(s.prefill_len for s in states),
        host_lengths=np.concatenate([s.host_lengths for s in states]) if known else None,
    )


def fork_rows(state: PrefillState, rows: Sequence[int] | np.ndarray) -> PrefillState:
    """Gathers (and duplicates) contexts: row i of the result continues row `rows[i]`.

    Copies the cache rows and their last logits, so a context can be continued several ways
    without re-running its prefix; the original state stays valid.
    """
    rows = np.asarray(rows, np.int32).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= state.batch_size):
        raise ValueError(f"fork rows must lie in [0, {state.batch_size}), got {rows.tolist()}.")
    rows_j = jnp.asarray(rows)
    cache = state.cache.take(rows_j)
    last_logits = jnp.take(state.last_logits, rows_j, axis=0)
    if row_mesh(state.cache) is not None:
        # Keep the copies' rows split like the original's (where their number allows), so
        # that the fork also decodes per replica.
        cache = jax.tree.map(rows_like, cache, state.cache)
        last_logits = rows_like(last_logits, state.last_logits)
    return PrefillState(
        cache=cache,
        last_logits=last_logits,
        prefilled_b=np.zeros((rows.size,), np.int32),
        prefill_len=0,
        host_lengths=None if state.host_lengths is None else state.host_lengths[rows],
    )


def regroup(
    states: Sequence[PrefillState],
    rows: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    like: KVCache,
) -> PrefillState:
    """Row i continues row `rows[i]` of the states' rows stacked, cut to `lengths[i]` positions.

    `concat_states`, `fork_rows` and a new `lengths` in one compiled program, whose result is
    laid out like `like` (a cache, or its `jax.ShapeDtypeStruct`s with shardings: e.g. a fresh
    cache's layout, rows split over the mesh's `data` axis; the last logits are laid out like
    its `lengths`). Eagerly, the same work is a few sharded ops per layer and state, each
    dispatched (and resharded) on its own: 16-34 ms for a tiny() batch of 16 rows on 2 loaded
    CPU devices, against 2-3 ms as one program. The inputs stay valid.
    """
    rows = np.asarray(rows, np.int32).reshape(-1)
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    total = sum(s.batch_size for s in states)
    if rows.size and (rows.min() < 0 or rows.max() >= total):
        raise ValueError(f"regroup rows must lie in [0, {total}), got {rows.tolist()}.")
    if lengths.shape != rows.shape or rows.size != like.batch_size:
        raise ValueError(
            f"regroup needs one length per row and {like.batch_size} rows (the layout's), got "
            f"{rows.size} rows and {lengths.size} lengths."
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > like.capacity):
        raise ValueError(f"regroup lengths must lie in [0, {like.capacity}], got {lengths}.")
    shardings, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, like))
    program = _regroup_program(tuple(shardings), treedef)
    cache, last_logits = program(
        tuple(s.cache for s in states),
        tuple(s.last_logits for s in states),
        jnp.asarray(rows),
        jnp.asarray(lengths),
    )
    return PrefillState(cache, last_logits, np.zeros((rows.size,), np.int32), 0, lengths)


@functools.cache
def _regroup_program(shardings: tuple, treedef):
    cache_shardings = jax.tree.unflatten(treedef, shardings)

    def regroup_rows(caches, logits, rows, lengths):
        cache = caches[0] if len(caches) == 1 else KVCache.concatenate(caches)
        cache = cache.take(rows).replace(lengths=lengths)
        return cache, jnp.take(jnp.concatenate(logits), rows, axis=0)

    return jax.jit(regroup_rows, out_shardings=(cache_shardings, cache_shardings.lengths))
