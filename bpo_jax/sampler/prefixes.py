"""Shared prompt prefixes computed once: new prompts continue the contexts of earlier ones.

An agent's prompts repeat themselves. Every group member and branch child of a task starts
from the same task, goal and first observation, and every turn's prompt starts with them again
(and, while the history only grows, with the whole previous prompt). `PrefixCache.prefill` runs
only what is new. Each prompt is matched token by token against the rows kept from the previous
call; the best row's cache is copied with its length cut to the common prefix, and only the rest
of the prompt is prefilled, at its offset. Prompts of one batch that share a longer prefix with
each other than with any kept row (a task's group members on their first turn) first have that
prefix prefilled once, as a row of its own. The batch's contexts are then kept for the next
call, replacing the previous ones.

Causal attention makes the copied keys and values those a full prefill computes for the same
positions (up to the float rounding of differently shaped products), and sampling keys depend
on a row's key and a token's position only, so generated tokens do not depend on what was
reused.

Trade-offs:
  * The kept rows are a copy of the batch's cache (the caller's `generate` consumes its own),
    made by the prefill program itself (`Sampler.prefill_and_copy`), so device memory holds two
    caches of the batch's size between turns. `clear()` frees them (the policy clears at the
    end of each rollout batch, before the learner needs the memory). The next call takes the
    kept buffers over: rows that continue themselves in order are prefilled in place, others
    are gathered by one program (`contexts.regroup`). A turn then runs two programs, the
    prefill and the caller's `generate`; replacing the two eager per-layer copies
    (`fork_rows`) around it cut a tiny() turn's prefill by 14% (371 -> 323 ms median, the two
    ways interleaved in one run on 2 CPU devices at load 10-12).
  * Only the previous call's rows are kept: a prompt continues its own previous prompt or a
    sibling's. With a history window that slides (`history_turns` turns), the prompt's turns
    shift position once the window is full, so only the task's fixed head (and the turns still
    in place) is reused; a history that only grows reuses the whole previous prompt.
  * A kept row is valid only for the parameters it was computed with: a call with other
    parameters (the trainer's update swaps them) starts from nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from bpo_jax.models.kv_cache import KVCache
from bpo_jax.sampler.contexts import PrefillState, regroup


def longest_common_prefix(tokens_rl: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """[R] leading tokens each row of `tokens_rl` (padded with -1) shares with `prompt`."""
    m = min(tokens_rl.shape[1], prompt.shape[0])
    if tokens_rl.shape[0] == 0 or m == 0:
        return np.zeros((tokens_rl.shape[0],), np.int64)
    eq_rm = tokens_rl[:, :m] == prompt[None, :m]
    return np.where(eq_rm.all(axis=1), m, np.argmin(eq_rm, axis=1))


def shared_in_batch(prompts: Sequence[np.ndarray]) -> np.ndarray:
    """[B] per prompt, the longest prefix it shares with another prompt of the batch."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].tolist())
    shared = np.zeros((len(prompts),), np.int64)
    for a, b in zip(order, order[1:]):  # The best partner is a neighbour in sorted order.
        n = int(longest_common_prefix(prompts[a][None], prompts[b])[0])
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    return shared


def _as_matrix(prompts: Sequence[np.ndarray]) -> np.ndarray:
    width = max((len(p) for p in prompts), default=0)
    out = np.full((len(prompts), width), -1, np.int64)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out


class PrefixCache:
    """Prefills prompts as continuations of the contexts kept from the previous call.

    Example (what `bpo_jax.sampler.policy.Policy` does each turn):

        prefixes = PrefixCache(sampler, lambda b: init_cache(cfg, b, capacity))
        state = prefixes.prefill(params, prompts)   # state.prefilled_b: tokens run per row
        out = sampler.generate(params, state, rng)  # consumes `state`; the kept copy stays

    Attributes:
      sampler: the `Sampler` whose prefill runs the new tokens.
      new_cache: makes an empty cache of a given number of rows (its capacity and layout are
        those of every context this object hands out).
      min_shared: a prefix shared within a batch is prefilled once on its own only when it is at
        least this many tokens longer than the prompts' best kept match (the extra prefill call
        costs more than it saves for a few tokens).
      batch_rows: rounds the number of shared-prefix rows up (bounds the compiled shapes).
    """

    def __init__(
        self,
        sampler,
        new_cache: Callable[[int], KVCache],
        *,
        min_shared: int = 16,
        batch_rows: Callable[[int], int] = lambda n: n,
    ):
        self.sampler = sampler
        self.new_cache = new_cache
        self.min_shared = int(min_shared)
        self.batch_rows = batch_rows
        self._kept: PrefillState | None = None
        self._kept_tokens = np.zeros((0, 0), np.int64)
        self._params_leaves: list | None = None
        self._layouts: dict[int, KVCache] = {}
        # Real tokens run by the last call's shared-prefix prefill (counted into its total).
        self.last_shared_tokens = 0

    @property
    def kept_rows(self) -> int:
        return self._kept_tokens.shape[0]

    def clear(self) -> None:
        """Drops the kept contexts (and their device memory)."""
        self._kept, self._kept_tokens, self._params_leaves = None, np.zeros((0, 0), np.int64), None

    def prefill(self, params: nnx.State, prompts: Sequence[Sequence[int]]) -> PrefillState:
        """Contexts of `prompts`, each continued from its best match; the batch is then kept.

        Returns:
          A `PrefillState` of len(prompts) rows whose `prefilled_b[i]` counts the tokens run for
          prompt i (its own suffix; a shared prefix prefilled once is counted once, on the first
          prompt that uses it), so `prefilled_tokens` is the call's whole model work in tokens.
        """
        leaves = jax.tree.leaves(params)
        if (
            self._params_leaves is None
            or len(leaves) != len(self._params_leaves)
            or any(a is not b for a, b in zip(leaves, self._params_leaves))
        ):
            self.clear()
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if any(len(p) == 0 for p in rows):
            raise ValueError("Every prompt needs at least one token (its next-token logits).")
        sources = [] if self._kept is None else [self._kept]
        source_tokens = self._kept_tokens
        kept_match = self._best_matches(source_tokens, rows)[1]
        shared = self._shared_prefixes(rows, kept_match)
        self.last_shared_tokens = 0
        if shared:
            state = self._continue(params, sources, source_tokens, shared, self.batch_rows)
            self.last_shared_tokens = state.prefilled_tokens
            source_tokens = _as_matrix([*list(self._kept_rows_tokens()), *shared])
            sources = [*sources, state]
            source_tokens = _pad_rows(source_tokens, sum(s.batch_size for s in sources))
        # The kept rows are replaced by this batch's: the last use of their buffers, which the
        # prefill may then take over (a row that continues itself is not copied).
        self.clear()
        state, kept = self._continue(
            params, sources, source_tokens, rows, lambda n: n, keep=True, consume=True
        )
        if self.last_shared_tokens:
            # Charge the shared prefixes' work to the batch (on its first row).
            prefilled = state.prefilled_b.copy()
            prefilled[0] += self.last_shared_tokens
            state = dataclasses.replace(state, prefilled_b=prefilled)
        self._kept = kept
        self._kept_tokens = _as_matrix(rows)
        self._params_leaves = leaves
        return state

    # ------------------------------------------------------------------ helpers

    def _kept_rows_tokens(self) -> list[np.ndarray]:
        out = []
        for r in self._kept_tokens:
            out.append(r[r >= 0])
        if self._kept is not None:
            out += [np.zeros((0,), np.int64)] * (self._kept.batch_size - len(out))
        return out

    def _layout(self, batch: int) -> KVCache:
        """Shapes and shardings of a fresh cache of `batch` rows (allocated once per size)."""
        if batch not in self._layouts:
            self._layouts[batch] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self.new_cache(batch),
            )
        return self._layouts[batch]

    @staticmethod
    def _best_matches(tokens_rl: np.ndarray, prompts: Sequence[np.ndarray]):
        """(best row [B], its common prefix length [B]) of each prompt among `tokens_rl`.

        Of several rows that match equally far, prompt i takes row i where it is one of them
        (a group member continuing its own context after the group's shared head): when every
        prompt does, the kept batch is prefilled into in place rather than gathered.
        """
        best, length = np.zeros((len(prompts),), np.int64), np.zeros((len(prompts),), np.int64)
        for i, p in enumerate(prompts):
            lcp_r = longest_common_prefix(tokens_rl, p)
            if lcp_r.size:
                best[i] = int(np.argmax(lcp_r))
                if i < lcp_r.size and lcp_r[i] == lcp_r[best[i]]:
                    best[i] = i
                length[i] = lcp_r[best[i]]
        return best, length

    def _shared_prefixes(self, rows, kept_match) -> list[np.ndarray]:
        """The distinct within-batch prefixes worth prefilling once, none a prefix of another."""
        if len(rows) < 2:
            return []
        shared = shared_in_batch(rows)
        picked = {
            tuple(p[:n].tolist())
            for p, n, k in zip(rows, shared, kept_match)
            if n >= k + self.min_shared
        }
        ordered = sorted(picked)
        # In sorted order every extension of a prefix follows it directly.
        return [
            np.asarray(c, np.int64)
            for c, nxt in zip(ordered, [*ordered[1:], None])
            if nxt is None or nxt[: len(c)] != c
        ]

    def _continue(
        self, params, sources, source_tokens, prompts, batch_rows, *, keep=False, consume=False
    ):
        """Prefills each prompt after the longest prefix it shares with a row of `sources`.

        Args:
          sources: the states whose rows (stacked, in order; `source_tokens` [R, L] holds their
            tokens, -1 after a row's end) the prompts may continue.
          keep: also return a copy of the result (`Sampler.prefill_and_copy`).
          consume: the sources are not used again: a single source whose rows all continue
            themselves, in order, is prefilled into in place (no copy of its cache).

        Returns:
          The prompts' state (its first len(prompts) rows counted), and with `keep` its copy.
        """
        n = len(prompts)
        batch = batch_rows(n)
        prompts = list(prompts) + [prompts[0]] * (batch - n)  # Filler rows: not counted.
        run = self.sampler.prefill_and_copy if keep else self.sampler.prefill
        if not sources:
            out = run(params, self.new_cache(batch), prompts)
        else:
            start, match = self._starts(sources, source_tokens, prompts, consume)
            out = run(params, start, [p[m:] for p, m in zip(prompts, match)])
        if keep:
            return _count_rows(out[0], n), out[1]
        return _count_rows(out, n)

    def _starts(self, sources, source_tokens, prompts, consume):
        """(each prompt's best row of `sources` cut to their common prefix, that length [B])."""
        batch = len(prompts)
        best, match = self._best_matches(source_tokens, prompts)
        source_len = np.count_nonzero(source_tokens >= 0, axis=1)
        # A prompt needs its last token's logits: reuse them only from a row that ends exactly
        # where the prompt does; otherwise run at least its last token.
        lengths = np.asarray([len(p) for p in prompts])
        whole = (match == lengths) & (source_len[best] == lengths)
        match = np.where(whole, match, np.minimum(match, lengths - 1))
        # Rows laid out as a fresh cache of this batch would be (split over the mesh's `data`
        # axis where it divides), whatever the layout of the rows they were copied from.
        layout = self._layout(batch)
        if (
            consume
            and len(sources) == 1
            and sources[0].batch_size == batch
            and np.array_equal(best, np.arange(batch))
        ):
            src = sources[0]
            lengths_b = jax.device_put(match.astype(np.int32), layout.lengths.sharding)
            start = PrefillState(
                src.cache.replace(lengths=lengths_b),
                src.last_logits,
                src.prefilled_b,
                host_lengths=match.astype(np.int32),
            )
            return start, match
        return regroup(sources, best, match, layout), match


def _count_rows(state: PrefillState, n: int) -> PrefillState:
    """The state with the tokens of its filler rows (past the first n) not counted."""
    prefilled = state.prefilled_b.copy()
    prefilled[n:] = 0
    return dataclasses.replace(state, prefilled_b=prefilled)


def _pad_rows(tokens_rl: np.ndarray, rows: int) -> np.ndarray:
    if tokens_rl.shape[0] >= rows:
        return tokens_rl
    pad = np.full((rows - tokens_rl.shape[0], tokens_rl.shape[1]), -1, np.int64)
    return np.concatenate([tokens_rl, pad])
