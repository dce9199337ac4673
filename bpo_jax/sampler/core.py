"""The `Sampler`: jitted prefill / generate / fork over a model's graphdef.

What a rollout does with it (through `bpo_jax.sampler.policy.Policy`):

    sampler = Sampler(graphdef, eos_ids=[eos], pad_id=pad, max_new_tokens=64)
    state = sampler.prefill(params, init_cache(cfg, batch, capacity), prompts)
    children = sampler.fork(state, [0, 0, 0, 1])     # BPO: rows continued several ways
    out = sampler.generate(params, children, rng)    # out.tokens, out.logprobs, .entropies

Shapes are static so that XLA compiles a bounded number of programs: a prefill's tokens are
right-padded to a length bucket (a multiple of `length_bucket`, or the next power of two), and
decoding runs over a fixed `[B, max_new_tokens]` buffer (`programs.decode`). `generate` leaves
every generated token in the cache, so a later observation can be appended to a context by
another `prefill` without re-running its prefix (multi-turn contexts).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from bpo_jax.models.llama import KVCache
from bpo_jax.sampler import programs
from bpo_jax.sampler.contexts import PrefillState, SampleOutput, fork_rows
from bpo_jax.sampler.replicas import row_mesh
from bpo_jax.sampler.tokens import typed_key


def bucket_length(n: int, length_bucket: int | str) -> int:
    """Rounds a token count up to its bucket: a multiple of an int, or "pow2" (power of two)."""
    if n <= 0:
        return 0
    if length_bucket == "pow2":
        return 1 << (n - 1).bit_length()
    if isinstance(length_bucket, int) and length_bucket > 0:
        return -(-n // length_bucket) * length_bucket
    raise ValueError(f"length_bucket must be a positive int or 'pow2', got {length_bucket!r}.")


def offset_bucket(n: int, capacity: int, align: int = 64) -> int:
    """Rounds a prefill's longest cached context up, for its static attention bound.

    Multiples of `align`, at most four per doubling (so a bound wastes under a quarter of the
    context and a rollout compiles a few programs per prefill width), never past `capacity`.
    """
    if n <= 0:
        return 0
    step = max(align, (1 << (n - 1).bit_length()) // 8)
    return min(-(-n // step) * step, capacity)


class Sampler:
    """Jitted prefill / generate / fork over a `Transformer`'s graphdef.

    Programs are compiled once per static shape: (batch, cache capacity, prefill bucket) for
    prefill and (batch, capacity, max_new_tokens, greedy?, top-p?) for generate. Temperature
    and top-p values are traced, so changing them does not recompile.

    With `donate=True` (the default) `prefill` and `generate` donate the cache they are given:
    its buffers are reused in place and the state passed in must not be used again. To continue
    one context several ways, `fork` it first (fork copies), then generate.

    Data-parallel replicas: when the cache's rows are split over a mesh's `data` axis (allocate
    it with `init_cache(..., mesh=mesh)`), `prefill` and `generate` run each replica's rows as
    its own program (`replicas.per_replica`), with no communication inside the decode loop. On
    a CPU with one device per core this is what uses the cores: XLA's intra-op threads barely
    help a decode step's small matmuls, and the 2-core `bench/bench_sampler.py` decodes 1.44-1.51x
    faster as 2 replicas than as one program. Results are the same either way.
    """

    def __init__(
        self,
        model_or_graphdef: nnx.Module | nnx.GraphDef,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        length_bucket: int | str = 64,
        prefill_chunk: int = 0,
        donate: bool = True,
    ):
        """Builds the sampler.

        Args:
          model_or_graphdef: a `Transformer` (only its graphdef is kept; parameters are passed to
            every call) or the graphdef of one.
          eos_ids: token ids that end a row's turn (may be empty: rows then run to the budget).
          pad_id: id written after a row has stopped.
          max_new_tokens: default decode budget N per `generate` call.
          temperature: default sampling temperature; 0 means greedy.
          top_p: default nucleus mass in (0, 1]; 1 disables truncation.
          length_bucket: prefill lengths are padded to a multiple of this int, or to the next
            power of two with "pow2".
          prefill_chunk: run a prefill's tokens this many columns at a time (0: all at once),
            a multiple of an int `length_bucket`; bounds the prefill's activations on a large
            batch of long prompts (`run_prefill`).
          donate: let prefill/generate reuse the given cache's buffers in place.
        """
        if isinstance(model_or_graphdef, nnx.Module):
            self._vocab_size = getattr(getattr(model_or_graphdef, "cfg", None), "vocab_size", None)
            model_or_graphdef, _ = nnx.split(model_or_graphdef)
        else:
            self._vocab_size = None
        self.graphdef = model_or_graphdef
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.pad_id = int(pad_id)
        self.max_new_tokens = _check_budget(max_new_tokens)
        self.temperature = _check_temperature(temperature)
        self.top_p = _check_top_p(top_p)
        bucket_length(1, length_bucket)  # validates
        self.length_bucket = length_bucket
        if prefill_chunk < 0 or (
            prefill_chunk and (not isinstance(length_bucket, int) or prefill_chunk % length_bucket)
        ):
            raise ValueError(
                f"prefill_chunk must be 0 or a multiple of an int length_bucket "
                f"({length_bucket!r}), got {prefill_chunk}."
            )
        self.prefill_chunk = int(prefill_chunk)
        self._donate = donate
        # Jitted programs per row mesh (None: one program over the whole batch).
        self._prefill_fns: dict[Mesh | None, object] = {}
        self._generate_fns: dict[Mesh | None, object] = {}

    # ------------------------------------------------------------------ public API

    def prefill(
        self,
        params: nnx.State,
        state: PrefillState | KVCache,
        tokens: Sequence[Sequence[int]] | np.ndarray,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> PrefillState:
        """Appends each row's tokens to its cached context and computes its next-token logits.

        Works for a first prompt (pass a fresh `init_cache(...)`) and for a later observation
        appended after earlier turns (pass the previous state); only the new tokens are run.

        Args:
          params: the model's parameter state (`nnx.split(model)[1]`).
          state: the contexts to extend, as a `PrefillState` or a bare `KVCache`.
          tokens: per-row token lists, or an int array [B, T] whose row b holds `lengths[b]`
            real tokens followed by anything. A row may have no new tokens; it then keeps its
            previous last logits (zeros if `state` is a bare cache).
          lengths: real tokens per row when `tokens` is an array (default: all T).

        Returns:
          The extended contexts, with `prefilled_b` counting the real tokens run per row.
        """
        return self._prefill(params, state, tokens, lengths, keep=False)

    def prefill_and_copy(
        self,
        params: nnx.State,
        state: PrefillState | KVCache,
        tokens: Sequence[Sequence[int]] | np.ndarray,
        lengths: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[PrefillState, PrefillState]:
        """`prefill`, and an independent copy of its result made by the same program.

        For a caller that keeps the contexts while handing them to `generate`, which consumes
        (donates) its input: one copy inside the prefill program instead of a `fork` after it.
        The copy's `prefilled_b` is zeros (it ran nothing of its own).
        """
        return self._prefill(params, state, tokens, lengths, keep=True)

    def _prefill(self, params, state, tokens, lengths, *, keep: bool):
        if isinstance(state, KVCache):
            cache, last_logits, known_lengths = state, None, None
        else:
            cache, last_logits, known_lengths = state.cache, state.last_logits, state.host_lengths
        batch = cache.batch_size
        tokens_bt, num_new_b = self.pad_tokens(tokens, lengths, batch)
        if last_logits is None:
            vocab = self._vocab(params)
            last_logits = jnp.zeros((batch, vocab), jnp.float32)
        vocab = last_logits.shape[-1]
        if tokens_bt.size and (tokens_bt.min() < 0 or tokens_bt.max() >= vocab):
            raise ValueError(
                f"Token ids must lie in [0, {vocab}); got min {tokens_bt.min()}, "
                f"max {tokens_bt.max()}."
            )
        cache_len_b = np.asarray(cache.lengths if known_lengths is None else known_lengths)
        over = np.nonzero(cache_len_b + num_new_b > cache.capacity)[0]
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"Row {b} would hold {cache_len_b[b] + num_new_b[b]} tokens "
                f"({cache_len_b[b]} cached + {num_new_b[b]} new), more than the cache capacity "
                f"{cache.capacity}; allocate a larger cache (init_cache(..., capacity=...))."
            )
        new_len_b = (cache_len_b + num_new_b).astype(np.int32)
        if tokens_bt.shape[1] == 0:  # nothing to run
            out = PrefillState(cache, last_logits, num_new_b, 0, new_len_b)
            return (out, fork_rows(out, np.arange(batch))) if keep else out
        result = self.run_prefill(
            params, cache, last_logits, tokens_bt, num_new_b, cache_len_b, keep=keep
        )
        (cache, last_logits), copy = result if keep else (result, None)
        out = PrefillState(cache, last_logits, num_new_b, tokens_bt.shape[1], new_len_b)
        if not keep:
            return out
        return out, PrefillState(*copy, np.zeros((batch,), np.int32), 0, new_len_b)

    def generate(
        self,
        params: nnx.State,
        state: PrefillState,
        rng: jax.Array,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> SampleOutput:
        """Samples up to `max_new_tokens` tokens per row, stopping rows at an eos token.

        A row also stops (with `stopped=False`) when its cache is full.

        Args:
          params: the model's parameter state.
          state: contexts from `prefill`, `fork` or a previous `generate`.
          rng: one key (row b uses fold_in(rng, b)) or [B] keys, one per row.
          max_new_tokens, temperature, top_p: override the sampler's defaults for this call.

        Returns:
          A `SampleOutput` (host arrays) whose `state` holds every generated token in the cache.
        """
        num_new = _check_budget(self.max_new_tokens if max_new_tokens is None else max_new_tokens)
        temperature = _check_temperature(self.temperature if temperature is None else temperature)
        top_p = _check_top_p(self.top_p if top_p is None else top_p)
        rng = typed_key(rng)
        if rng.shape not in ((), (state.batch_size,)):
            raise ValueError(
                f"rng must be one key or {state.batch_size} keys (one per row), got key shape "
                f"{rng.shape}."
            )
        out = self.generate_fn(row_mesh(state.cache))(
            params,
            state.cache,
            state.last_logits,
            rng,
            jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p),
            num_new=num_new,
            greedy=temperature == 0.0,
            nucleus=top_p < 1.0,
        )
        cache, last_logits = out.pop("cache"), out.pop("last_logits")
        host = jax.device_get(out)
        batch = state.batch_size
        return SampleOutput(
            tokens=host["tokens"],
            logprobs=host["logprobs"],
            entropies=host["entropies"],
            lengths=host["lengths"],
            stopped=host["stopped"],
            num_steps=int(host["num_steps"]),
            state=PrefillState(
                cache,
                last_logits,
                np.zeros((batch,), np.int32),
                0,
                None if state.host_lengths is None else state.host_lengths + host["lengths"],
            ),
        )

    def fork(self, state: PrefillState, rows: Sequence[int] | np.ndarray) -> PrefillState:
        """Gathers (and duplicates) contexts: row i of the result continues row `rows[i]`.

        Copies the cache rows and their last logits (`contexts.fork_rows`), so a context can be
        continued several ways without re-running its prefix; the original state stays valid.
        """
        return fork_rows(state, rows)

    def run_prefill(self, params, cache, last_logits, tokens_bt, num_new_b, cache_len_b, *, keep):
        """The prefill program on checked host arrays (`prefill`'s last step; public for the
        slice-wide sampler): row b appends `num_new_b[b]` of `tokens_bt[b]` after its
        `cache_len_b[b]` cached tokens.

        With `prefill_chunk` the columns run `prefill_chunk` at a time, each chunk after the
        ones before it (the cache's contexts grow as in a multi-turn prefill), so the program's
        activations scale with the chunk, not the prompt; a row whose tokens ended in an earlier
        chunk runs none and keeps its last logits. Returns what the program returns: (cache,
        last logits), and with `keep` a copy of them made by the last chunk's program.
        """
        width = tokens_bt.shape[1]
        chunk = self.prefill_chunk or width
        starts = list(range(0, int(num_new_b.max(initial=0)) or 1, chunk))
        fn = self.prefill_fn(row_mesh(cache))
        for i, start in enumerate(starts):
            part = tokens_bt[:, start : start + chunk]
            n_b = np.clip(num_new_b - start, 0, part.shape[1]).astype(np.int32)
            cached_b = cache_len_b + np.minimum(num_new_b, start)
            result = fn(
                params,
                cache,
                last_logits,
                jnp.asarray(part),
                jnp.asarray(n_b),
                offset_bound=offset_bucket(int(cached_b.max(initial=0)), cache.capacity),
                keep=keep and i == len(starts) - 1,
            )
            if i < len(starts) - 1:
                cache, last_logits = result
        return result

    # ------------------------------------------------------------------ jitted programs

    def prefill_fn(self, mesh: Mesh | None):
        """The jitted prefill (`programs.prefill_program`) for caches whose rows `mesh` splits.

        Public for callers that run it on arrays the host cannot read whole, such as a slice's
        global batch (`bpo_jax.multihost.slice_sampler`); `prefill` is the checked way in.
        """
        if mesh not in self._prefill_fns:
            self._prefill_fns[mesh] = programs.prefill_program(
                self.graphdef, mesh, donate=self._donate
            )
        return self._prefill_fns[mesh]

    def generate_fn(self, mesh: Mesh | None):
        """The jitted decode (`programs.generate_program`) for caches whose rows `mesh` splits;
        like `prefill_fn`, for global batches (`generate` reads its outputs whole)."""
        if mesh not in self._generate_fns:
            self._generate_fns[mesh] = programs.generate_program(
                self.graphdef, mesh, eos_ids=self.eos_ids, pad_id=self.pad_id, donate=self._donate
            )
        return self._generate_fns[mesh]

    # ------------------------------------------------------------------ helpers

    def pad_tokens(self, tokens, lengths, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads tokens to the bucket: (tokens [B, T_bucket] int32, num_new [B] int32).

        Pure numpy: every host of a slice-wide prefill pads the same global rows the same way.
        """
        if isinstance(tokens, np.ndarray | jax.Array):
            arr = np.asarray(tokens)
            if arr.ndim != 2:
                raise ValueError(f"tokens must be [B, T], got shape {arr.shape}.")
            if lengths is None:
                num_new_b = np.full((arr.shape[0],), arr.shape[1], np.int32)
            else:
                num_new_b = np.asarray(lengths, np.int32).reshape(-1)
            if (
                num_new_b.shape[0] != arr.shape[0]
                or np.any(num_new_b < 0)
                or np.any(num_new_b > arr.shape[1])
            ):
                raise ValueError(
                    f"lengths must give 0..{arr.shape[1]} tokens for each of {arr.shape[0]} "
                    f"rows, got {num_new_b.tolist()}."
                )
            rows = [arr[b, : num_new_b[b]] for b in range(arr.shape[0])]
        else:
            if lengths is not None:
                raise ValueError("lengths is only for array tokens; lists carry their lengths.")
            rows = [np.asarray(r, np.int64).reshape(-1) for r in tokens]
            num_new_b = np.asarray([len(r) for r in rows], np.int32)
        if len(rows) != batch:
            raise ValueError(f"Got tokens for {len(rows)} rows but the cache has {batch} rows.")
        width = bucket_length(int(num_new_b.max(initial=0)), self.length_bucket)
        tokens_bt = np.full((batch, width), self.pad_id, np.int32)
        for b, row in enumerate(rows):
            tokens_bt[b, : len(row)] = row
        return tokens_bt, num_new_b

    def _vocab(self, params) -> int:
        if self._vocab_size is None:
            self._vocab_size = int(params["embed_tokens"].shape[0])
        return self._vocab_size


def _check_budget(n: int) -> int:
    if int(n) != n or n < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {n!r}.")
    return int(n)


def _check_temperature(t: float) -> float:
    if not t >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t!r}.")
    return float(t)


def _check_top_p(p: float) -> float:
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {p!r}.")
    return float(p)
