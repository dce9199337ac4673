"""A jitted KV-cache sampler for multi-turn language agents, with forking for BPO.

The life of a batch of agent contexts:

    sampler = Sampler(model, eos_ids=[eos], pad_id=pad, max_new_tokens=64)
    graphdef, params = nnx.split(model)
    state = sampler.prefill(params, init_cache(cfg, batch, capacity), prompts)   # turn 1
    out = sampler.generate(params, state, rng)            # out.tokens, out.logprobs, ...
    state = sampler.prefill(params, out.state, observations)   # append; the prefix is not re-run
    state = sampler.fork(state, [0, 0, 0, 0])              # BPO: one context, four futures
    out = sampler.generate(params, state, rng)

Shapes are static so that XLA compiles a bounded number of programs: a prefill's tokens are
right-padded to a length bucket (a multiple of `length_bucket`, or the next power of two), and
decoding runs a `lax.while_loop` over a fixed `[B, max_new_tokens]` buffer that exits as soon as
every row is done. Everything is pure over `(graphdef, params)`; the jitted functions close over
the graphdef and take the parameter state as an argument.

Sampling semantics, per row and step:
  * `logprobs` and `entropies` describe softmax(logits / temperature), the tempered distribution
    *before* nucleus (top-p) truncation; the token itself is drawn from that distribution
    restricted to the nucleus and renormalised. With temperature 0 (greedy) the token is the
    argmax and `logprobs` / `entropies` describe the untempered softmax(logits).
  * Randomness is per row: row b draws its token at cache position p with
    `fold_in(row_key[b], p)`. A forked row given its original's key therefore continues exactly
    like the original, and rows given different keys diverge. Pass a fresh key per call.

Shape suffixes: B batch, T prompt tokens (bucketed), N new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bpo_jax.models.llama import KVCache

# The mesh axis of data-parallel replicas: the parameters are replicated over it (no sharding
# rule maps a parameter axis to it), so each replica can decode its rows on its own.
ROW_AXIS = "data"

# ----------------------------------------------------------------------------- results


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
    """

    cache: KVCache
    last_logits: jax.Array
    prefilled_b: np.ndarray
    prefill_len: int = 0

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
    return PrefillState(
        cache=KVCache.concatenate([s.cache for s in states]),
        last_logits=jnp.concatenate([s.last_logits for s in states]),
        prefilled_b=np.concatenate([s.prefilled_b for s in states]),
        prefill_len=max(s.prefill_len for s in states),
    )


# ----------------------------------------------------------------------------- pure kernels


def bucket_length(n: int, length_bucket: int | str) -> int:
    """Rounds a token count up to its bucket: a multiple of an int, or "pow2" (power of two)."""
    if n <= 0:
        return 0
    if length_bucket == "pow2":
        return 1 << (n - 1).bit_length()
    if isinstance(length_bucket, int) and length_bucket > 0:
        return -(-n // length_bucket) * length_bucket
    raise ValueError(f"length_bucket must be a positive int or 'pow2', got {length_bucket!r}.")


def nucleus_mask(probs_bv: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """The smallest set of tokens per row whose probability mass reaches `top_p`.

    Tokens are ranked by probability; a token is kept when the mass of the tokens ranked above it
    is still below `top_p`. So the top token is always kept, and the kept set is the shortest
    prefix of the ranking with mass >= top_p. Ties are broken by token id (stable sort), so
    exactly that many tokens are kept.

    Args:
      probs_bv: [B, V] probabilities (each row sums to 1).
      top_p: scalar in (0, 1].

    Returns:
      [B, V] bool mask of kept tokens.
    """
    order_bv = jnp.argsort(-probs_bv, axis=-1, stable=True)
    sorted_bv = jnp.take_along_axis(probs_bv, order_bv, axis=-1)
    mass_above_bv = jnp.cumsum(sorted_bv, axis=-1) - sorted_bv
    keep_sorted_bv = mass_above_bv < top_p
    keep_sorted_bv = keep_sorted_bv.at[:, 0].set(True)
    rows_b1 = jnp.arange(probs_bv.shape[0])[:, None]
    return jnp.zeros_like(keep_sorted_bv).at[rows_b1, order_bv].set(keep_sorted_bv)


def sample_logits(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    temperature: jax.Array | float,
    top_p: jax.Array | float,
    *,
    greedy: bool,
    nucleus: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, logprobs [B], entropies [B]).

    The draw inverts the row's cumulative distribution at one uniform number per row (instead
    of adding Gumbel noise to all V logits, which costs V random numbers per row and step: 6x
    slower at V = 152k on CPU); see `inverse_cdf`. Float32 rounding of the cumulative sums can
    shift the odds of a token by about 1e-7 absolute; a token of zero probability (outside the
    nucleus) is never drawn.

    Args:
      logits_bv: [B, V] float32 logits.
      keys_b: [B] typed PRNG keys, one per row.
      temperature: scalar > 0 (ignored when greedy).
      top_p: scalar in (0, 1] (ignored unless `nucleus`).
      greedy: take the argmax; logprobs/entropies then describe softmax(logits).
      nucleus: restrict sampling to the top-p nucleus.
    """
    u_b = None if greedy else jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_b)
    return _sample_at(logits_bv, u_b, temperature, top_p, greedy=greedy, nucleus=nucleus)


def _sample_at(logits_bv, u_b, temperature, top_p, *, greedy: bool, nucleus: bool):
    """`sample_logits` with each row's uniform number u_b [B] in [0, 1) given (None if greedy).

    One pass of exp over the [B, V] logits serves everything: with z = logits - max and
    w = exp(z), Z = sum(w), the log-probabilities are z - log Z, the entropy is
    log Z - sum(w z) / Z, and the draw inverts the cumulative sum of the unnormalised w.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    scaled_bv = logits_bv if greedy else logits_bv / temperature
    shifted_bv = scaled_bv - jnp.max(scaled_bv, axis=-1, keepdims=True)
    weights_bv = jnp.exp(shifted_bv)
    total_b = jnp.sum(weights_bv, axis=-1)
    log_total_b = jnp.log(total_b)
    # exp(z) = 0 only where z is so negative (or -inf) that w * z is 0 or NaN: counted as 0.
    mean_shift_b = jnp.sum(jnp.where(weights_bv > 0, weights_bv * shifted_bv, 0.0), -1) / total_b
    entropy_b = log_total_b - mean_shift_b
    if greedy:
        tokens_b = jnp.argmax(scaled_bv, axis=-1).astype(jnp.int32)
    else:
        draw_bv = weights_bv
        if nucleus:
            keep_bv = nucleus_mask(weights_bv / total_b[:, None], top_p)
            draw_bv = jnp.where(keep_bv, weights_bv, 0.0)
        tokens_b = inverse_cdf(draw_bv, u_b)
    logprob_b = jnp.take_along_axis(shifted_bv, tokens_b[:, None], axis=-1)[:, 0] - log_total_b
    return tokens_b, logprob_b, entropy_b


def inverse_cdf(weights_bv: jax.Array, u_b: jax.Array) -> jax.Array:
    """Per row, the first token whose cumulative weight exceeds u * (total weight).

    A two-level search instead of a cumulative sum over all V tokens (which XLA's CPU backend
    runs as several slow reduce-window passes): the vocabulary is cut into blocks of about
    sqrt(V) tokens, the block holding the target is found from the blocks' cumulative sums, and
    the token within it from that block's cumulative sum. Both cumulative sums are small
    products with a triangular matrix of ones. Float32 rounding can make cumulative sums
    non-monotone by an ulp, so tokens and blocks of zero weight are excluded explicitly (they
    are never drawn), and a target that rounding puts at or past the total takes the last token
    of positive weight.

    Args:
      weights_bv: [B, V] non-negative float32 weights (unnormalised probabilities), each row
        with some positive weight.
      u_b: [B] uniform numbers in [0, 1).

    Returns:
      [B] int32 token ids.
    """
    b, v = weights_bv.shape
    block = 1 << max(0, math.ceil(math.log2(math.sqrt(v))))
    num_blocks = -(-v // block)
    w_bnk = jnp.pad(weights_bv, ((0, 0), (0, num_blocks * block - v)))
    w_bnk = w_bnk.reshape(b, num_blocks, block)
    block_w_bn = jnp.sum(w_bnk, axis=-1)
    cum_bn = _cumsum_by_matmul(block_w_bn)
    target_b = u_b * cum_bn[:, -1]
    j_b = _first_above(cum_bn, target_b, block_w_bn > 0)
    row_bk = jnp.take_along_axis(w_bnk, j_b[:, None, None], axis=1)[:, 0]
    before_b = jnp.where(
        j_b > 0, jnp.take_along_axis(cum_bn, jnp.maximum(j_b - 1, 0)[:, None], axis=1)[:, 0], 0.0
    )
    i_b = _first_above(_cumsum_by_matmul(row_bk), target_b - before_b, row_bk > 0)
    return (j_b * block + i_b).astype(jnp.int32)


def _cumsum_by_matmul(x_bn: jax.Array) -> jax.Array:
    """Inclusive cumulative sums along the last axis, as one product with triangular ones."""
    idx_n = jnp.arange(x_bn.shape[-1])
    upper_nn = (idx_n[:, None] <= idx_n[None, :]).astype(x_bn.dtype)
    return jnp.dot(x_bn, upper_nn, precision=jax.lax.Precision.HIGHEST)


def _first_above(cum_bn: jax.Array, target_b: jax.Array, allowed_bn: jax.Array) -> jax.Array:
    """First allowed index whose cumulative sum exceeds the target, else the last allowed one."""
    hit_bn = (cum_bn > target_b[:, None]) & allowed_bn
    n = cum_bn.shape[-1]
    last_allowed_b = n - 1 - jnp.argmax(allowed_bn[:, ::-1], axis=-1)
    return jnp.where(jnp.any(hit_bn, axis=-1), jnp.argmax(hit_bn, axis=-1), last_allowed_b)


def row_keys(rng: jax.Array, batch_size: int) -> jax.Array:
    """Per-row typed keys from one key (row b gets fold_in(rng, b)) or from [B] keys as given.

    Accepts typed keys (`jax.random.key`) or raw uint32 keys (`jax.random.PRNGKey`). Traceable.
    """
    rng = _typed_key(rng)
    if rng.shape == ():
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(batch_size))
    if rng.shape == (batch_size,):
        return rng
    raise ValueError(
        f"rng must be one key or {batch_size} keys (one per row), got key shape {rng.shape}."
    )


def _uniform_at(key: jax.Array, position: jax.Array) -> jax.Array:
    """The uniform number in [0, 1) that a row with `key` draws its token at `position` with."""
    return jax.random.uniform(jax.random.fold_in(key, position), (), jnp.float32)


def _typed_key(rng) -> jax.Array:
    rng = rng if isinstance(rng, jax.Array) else jnp.asarray(rng)
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    return rng


# ----------------------------------------------------------------------------- sampler


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
    its own program (`row_mesh`, `_per_replica`), with no communication inside the decode loop.
    On a CPU with one device per core this is what uses the cores: XLA's intra-op threads barely
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
        self._donate_args = ("cache",) if donate else ()
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
        if isinstance(state, KVCache):
            cache, last_logits = state, None
        else:
            cache, last_logits = state.cache, state.last_logits
        batch = cache.batch_size
        tokens_bt, num_new_b = self._pad_tokens(tokens, lengths, batch)
        if last_logits is None:
            vocab = self._vocab(params)
            last_logits = jnp.zeros((batch, vocab), jnp.float32)
        vocab = last_logits.shape[-1]
        if tokens_bt.size and (tokens_bt.min() < 0 or tokens_bt.max() >= vocab):
            raise ValueError(
                f"Token ids must lie in [0, {vocab}); got min {tokens_bt.min()}, "
                f"max {tokens_bt.max()}."
            )
        cache_len_b = np.asarray(cache.lengths)
        over = np.nonzero(cache_len_b + num_new_b > cache.capacity)[0]
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"Row {b} would hold {cache_len_b[b] + num_new_b[b]} tokens "
                f"({cache_len_b[b]} cached + {num_new_b[b]} new), more than the cache capacity "
                f"{cache.capacity}; allocate a larger cache (init_cache(..., capacity=...))."
            )
        if tokens_bt.shape[1] == 0:  # nothing to run
            return PrefillState(cache, last_logits, num_new_b, 0)
        cache, last_logits = self._prefill_fn(row_mesh(cache))(
            params, cache, last_logits, jnp.asarray(tokens_bt), jnp.asarray(num_new_b)
        )
        return PrefillState(cache, last_logits, num_new_b, tokens_bt.shape[1])

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
        rng = _typed_key(rng)
        if rng.shape not in ((), (state.batch_size,)):
            raise ValueError(
                f"rng must be one key or {state.batch_size} keys (one per row), got key shape "
                f"{rng.shape}."
            )
        out = self._generate_fn(row_mesh(state.cache))(
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
            state=PrefillState(cache, last_logits, np.zeros((batch,), np.int32), 0),
        )

    def fork(self, state: PrefillState, rows: Sequence[int] | np.ndarray) -> PrefillState:
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
            cache = jax.tree.map(_rows_like, cache, state.cache)
            last_logits = _rows_like(last_logits, state.last_logits)
        return PrefillState(
            cache=cache,
            last_logits=last_logits,
            prefilled_b=np.zeros((rows.size,), np.int32),
            prefill_len=0,
        )

    # ------------------------------------------------------------------ jitted bodies

    def _prefill_fn(self, mesh: Mesh | None):
        if mesh not in self._prefill_fns:
            impl = self._prefill_impl
            if mesh is not None:
                rows = P(ROW_AXIS)
                impl = _per_replica(impl, mesh, (P(), rows, rows, rows, rows), (rows, rows))
            self._prefill_fns[mesh] = jax.jit(impl, donate_argnames=self._donate_args)
        return self._prefill_fns[mesh]

    def _generate_fn(self, mesh: Mesh | None):
        if mesh not in self._generate_fns:
            self._generate_fns[mesh] = jax.jit(
                functools.partial(self._generate_entry, mesh=mesh),
                static_argnames=("num_new", "greedy", "nucleus"),
                donate_argnames=self._donate_args,
            )
        return self._generate_fns[mesh]

    def _generate_entry(
        self, params, cache, last_logits_bv, rng, temperature, top_p, *, mesh, **static
    ):
        keys_b = row_keys(rng, last_logits_bv.shape[0])
        impl = functools.partial(self._generate_impl, **static)
        if mesh is not None:
            rows = P(ROW_AXIS)
            per_row = ("cache", "last_logits", "tokens", "logprobs", "entropies", "lengths")
            out_specs = dict.fromkeys((*per_row, "stopped"), rows) | {"num_steps": P()}
            impl = _per_replica(
                functools.partial(impl, row_axis=ROW_AXIS),
                mesh,
                (P(), rows, rows, rows, P(), P()),
                out_specs,
            )
        return impl(params, cache, last_logits_bv, keys_b, temperature, top_p)

    def _prefill_impl(self, params, cache, last_logits_bv, tokens_bt, num_new_b):
        model = nnx.merge(self.graphdef, params)
        # Only each row's last hidden state goes through the LM head: the [B, T, V] logits the
        # model would also return are dead code that XLA removes (at a 150k vocabulary they
        # would be the largest buffer of the prefill).
        _, cache, hidden_btd = model(
            tokens_bt, cache=cache, num_new_b=num_new_b, return_hidden=True
        )
        last_idx_b = jnp.maximum(num_new_b - 1, 0)
        hidden_bd = jnp.take_along_axis(hidden_btd, last_idx_b[:, None, None], axis=1)[:, 0]
        new_last_bv = model.logits(hidden_bd[:, None])[:, 0]
        last_logits_bv = jnp.where((num_new_b > 0)[:, None], new_last_bv, last_logits_bv)
        return cache, last_logits_bv

    def _generate_impl(
        self,
        params,
        cache,
        last_logits_bv,
        keys_b,
        temperature,
        top_p,
        *,
        num_new,
        greedy,
        nucleus,
        row_axis=None,
    ):
        model = nnx.merge(self.graphdef, params)
        batch = last_logits_bv.shape[0]
        capacity = cache.capacity
        eos_e = jnp.asarray(self.eos_ids, jnp.int32)

        def cond(carry):
            return (carry["step"] < num_new) & ~jnp.all(carry["done_b"])

        u_bn = None
        if not greedy:
            # The key depends on the position the token will occupy, so a row's draws do not
            # depend on its batch slot or on which call of a multi-turn episode this is. A row
            # that is still sampling at step n occupies position lengths[b] + n, so every draw
            # is made here in one batched call (per step, the two small threefry loops took
            # ~4% of a tiny-model decode step); the draws of stopped rows go unused.
            pos_bn = cache.lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None]
            u_bn = jax.vmap(jax.vmap(_uniform_at, in_axes=(None, 0)))(keys_b, pos_bn)

        def body(carry):
            step, logits_bv = carry["step"], carry["logits_bv"]
            u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bn, step, 1, keepdims=False)
            tok_b, logp_b, ent_b = _sample_at(
                logits_bv, u_b, temperature, top_p, greedy=greedy, nucleus=nucleus
            )
            active_b = ~carry["done_b"]
            tok_b = jnp.where(active_b, tok_b, self.pad_id)
            is_eos_b = active_b & jnp.any(tok_b[:, None] == eos_e[None, :], axis=-1)
            # Feed the token (the stop token too) so the cache holds it and the logits after it
            # are ready. Finished rows also run (static shapes) but do not advance: what they
            # write lies beyond their length and is overwritten by their next append.
            new_logits_b1v, new_cache = model(
                tok_b[:, None], cache=carry["cache"], num_new_b=active_b.astype(jnp.int32)
            )
            lengths_b = new_cache.lengths
            return {
                "step": step + 1,
                "cache": new_cache,
                "logits_bv": jnp.where(active_b[:, None], new_logits_b1v[:, 0], logits_bv),
                "done_b": carry["done_b"] | is_eos_b | (lengths_b >= capacity),
                "tokens_bn": carry["tokens_bn"].at[:, step].set(tok_b),
                "logprobs_bn": carry["logprobs_bn"].at[:, step].set(jnp.where(active_b, logp_b, 0)),
                "entropies_bn": carry["entropies_bn"]
                .at[:, step]
                .set(jnp.where(active_b, ent_b, 0)),
                "stopped_b": carry["stopped_b"] | is_eos_b,
            }

        init = {
            "step": jnp.int32(0),
            # The cache's per-layer buffers are loop state, updated in place every step.
            "cache": cache,
            "logits_bv": last_logits_bv.astype(jnp.float32),
            "done_b": cache.lengths >= capacity,
            "tokens_bn": jnp.full((batch, num_new), self.pad_id, jnp.int32),
            "logprobs_bn": jnp.zeros((batch, num_new), jnp.float32),
            "entropies_bn": jnp.zeros((batch, num_new), jnp.float32),
            "stopped_b": jnp.zeros((batch,), bool),
        }
        final = jax.lax.while_loop(cond, body, init)
        num_steps = final["step"]
        if row_axis is not None:  # under `_per_replica`: each replica stopped on its own rows
            num_steps = jax.lax.pmax(num_steps, row_axis)
        return {
            "cache": final["cache"],
            "last_logits": final["logits_bv"],
            "tokens": final["tokens_bn"],
            "logprobs": final["logprobs_bn"],
            "entropies": final["entropies_bn"],
            "lengths": final["cache"].lengths - cache.lengths,
            "stopped": final["stopped_b"],
            "num_steps": num_steps,
        }

    # ------------------------------------------------------------------ helpers

    def _pad_tokens(self, tokens, lengths, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Right-pads tokens to the bucket: (tokens [B, T_bucket] int32, num_new [B] int32)."""
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


def row_mesh(cache: KVCache) -> Mesh | None:
    """The mesh whose `ROW_AXIS` (of size > 1) splits the rows of `cache`, if there is one.

    The sampler then runs one program per replica on its own rows (`_per_replica`).
    """
    sharding = getattr(cache.lengths, "sharding", None)
    if ROW_AXIS not in _row_axes(sharding) or sharding.mesh.shape[ROW_AXIS] == 1:
        return None
    return sharding.mesh


def _row_axes(sharding) -> tuple[str, ...]:
    """The mesh axes a NamedSharding splits dimension 0 (the rows) over; () for any other."""
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return ()
    first = sharding.spec[0]
    return (first,) if isinstance(first, str) else tuple(first or ())


def _rows_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` laid out like `like` (a NamedSharding over its rows), if its row count allows."""
    axes = _row_axes(like.sharding)
    if not axes or x.shape[0] % math.prod(like.sharding.mesh.shape[a] for a in axes):
        return x
    return jax.device_put(x, like.sharding)


def _per_replica(fn, mesh: Mesh, in_specs, out_specs):
    """`fn` run by each replica of `mesh`'s ROW_AXIS on its own rows, with no communication.

    Rows are independent in a prefill and in a decode loop, so each replica runs them without
    a collective; the decode loop's exit test and the cache writes, partitioned by XLA over the
    whole batch instead, cost an all-reduce per step and an all-gather per layer and step. The
    mesh's other axes stay automatic, so a replica's parameters and rows may still be sharded
    over `fsdp` and `tensor`.
    """
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset({ROW_AXIS}),
        # The decode loop's carry starts from replicated constants (step 0, empty buffers) that
        # become per-replica values; the outputs' specs above say which are which.
        check_vma=False,
    )


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
