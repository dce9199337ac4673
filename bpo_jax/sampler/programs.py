"""The traced bodies of the sampler's two programs, and the jitted programs built from them.

`prefill` runs new tokens through the model and keeps each row's next-token logits; `decode`
samples up to N tokens per row in a `lax.while_loop` over a fixed [B, N] buffer that exits as
soon as every row is done. Both are pure over `(graphdef, params)`: the programs close over the
graphdef and take the parameter state as an argument. With a row mesh (`replicas.row_mesh`),
each program runs per data-parallel replica (`replicas.per_replica`).

Shape suffixes: B batch, T prompt tokens (bucketed), N new tokens, V vocabulary, D model width,
E stop tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bpo_jax.sampler.replicas import ROW_AXIS, per_replica
from bpo_jax.sampler.tokens import row_keys, sample_at, uniform_at


def prefill(graphdef, params, cache, last_logits_bv, tokens_bt, num_new_b, *, offset_bound=None):
    """Appends `num_new_b[b]` tokens of `tokens_bt` to row b; returns (cache, last logits [B, V]).

    A row with no new tokens keeps its `last_logits_bv`. `offset_bound` (static, optional) bounds
    every row's cached length before the call, so attention skips the slots after it.
    """
    model = nnx.merge(graphdef, params)
    # Only each row's last hidden state goes through the LM head: the [B, T, V] logits the
    # model would also return are dead code that XLA removes (at a 150k vocabulary they
    # would be the largest buffer of the prefill).
    _, cache, hidden_btd = model(
        tokens_bt,
        cache=cache,
        num_new_b=num_new_b,
        return_hidden=True,
        offset_bound=offset_bound,
    )
    last_idx_b = jnp.maximum(num_new_b - 1, 0)
    hidden_bd = jnp.take_along_axis(hidden_btd, last_idx_b[:, None, None], axis=1)[:, 0]
    new_last_bv = model.logits(hidden_bd[:, None])[:, 0]
    last_logits_bv = jnp.where((num_new_b > 0)[:, None], new_last_bv, last_logits_bv)
    return cache, last_logits_bv


def decode(
    graphdef,
    params,
    cache,
    last_logits_bv,
    keys_b,
    temperature,
    top_p,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    num_new: int,
    greedy: bool,
    nucleus: bool,
    row_axis: str | None = None,
):
    """Samples up to `num_new` tokens per row, stopping a row at a stop token or a full cache.

    Args:
      graphdef, params: the model.
      cache, last_logits_bv: the contexts and their next-token logits [B, V].
      keys_b: [B] typed keys; row b draws at cache position p with `uniform_at(keys_b[b], p)`.
      temperature, top_p: traced scalars (see `tokens.sample_logits`).
      eos_ids: stop tokens; pad_id: written after a row has stopped.
      num_new, greedy, nucleus: static: the budget N, argmax sampling, top-p truncation.
      row_axis: the mesh axis when run per replica: the step count is then the max over them.

    Returns:
      A dict of the new cache and last logits, tokens/logprobs/entropies [B, N], lengths [B]
      (tokens generated), stopped [B] (a stop token was sampled) and num_steps (loop trips).
    """
    model = nnx.merge(graphdef, params)
    batch = last_logits_bv.shape[0]
    capacity = cache.capacity
    eos_e = jnp.asarray(eos_ids, jnp.int32)

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
        u_bn = jax.vmap(jax.vmap(uniform_at, in_axes=(None, 0)))(keys_b, pos_bn)

    def body(carry):
        step, logits_bv = carry["step"], carry["logits_bv"]
        u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bn, step, 1, keepdims=False)
        tok_b, logp_b, ent_b = sample_at(
            logits_bv, u_b, temperature, top_p, greedy=greedy, nucleus=nucleus
        )
        active_b = ~carry["done_b"]
        tok_b = jnp.where(active_b, tok_b, pad_id)
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
            "entropies_bn": carry["entropies_bn"].at[:, step].set(jnp.where(active_b, ent_b, 0)),
            "stopped_b": carry["stopped_b"] | is_eos_b,
        }

    init = {
        "step": jnp.int32(0),
        # The cache's per-layer buffers are loop state, updated in place every step.
        "cache": cache,
        "logits_bv": last_logits_bv.astype(jnp.float32),
        "done_b": cache.lengths >= capacity,
        "tokens_bn": jnp.full((batch, num_new), pad_id, jnp.int32),
        "logprobs_bn": jnp.zeros((batch, num_new), jnp.float32),
        "entropies_bn": jnp.zeros((batch, num_new), jnp.float32),
        "stopped_b": jnp.zeros((batch,), bool),
    }
    final = jax.lax.while_loop(cond, body, init)
    num_steps = final["step"]
    if row_axis is not None:  # under `per_replica`: each replica stopped on its own rows
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


def prefill_program(graphdef, mesh: Mesh | None, *, donate: bool):
    """`prefill` jitted over (params, cache, last_logits, tokens, num_new), per row replica.

    Static keyword arguments: `offset_bound` (default None: attend over the whole cache), and
    `keep` (default False): also return a copy of the new (cache, last logits), made in the same
    program, for a caller that hands the first to a donating `generate` and keeps the second.
    Eagerly (`fork_rows`: some 20 dispatches of sharded ops) a tiny() batch of 16 rows took
    16-34 ms to copy on 2 loaded CPU devices, against 2-3 ms for one jitted copy.
    """

    def entry(params, cache, last_logits, tokens, num_new, *, offset_bound=None, keep=False):
        impl = functools.partial(prefill, graphdef, offset_bound=offset_bound)
        if mesh is not None:
            rows = P(ROW_AXIS)
            impl = per_replica(impl, mesh, (P(), rows, rows, rows, rows), (rows, rows))
        out = impl(params, cache, last_logits, tokens, num_new)
        if keep:
            return out, jax.tree.map(jnp.copy, out)
        return out

    return jax.jit(
        entry,
        static_argnames=("offset_bound", "keep"),
        donate_argnames=("cache",) if donate else (),
    )


def generate_program(
    graphdef, mesh: Mesh | None, *, eos_ids: Sequence[int], pad_id: int, donate: bool
):
    """`decode` jitted over (params, cache, last_logits, rng, temperature, top_p).

    `rng` is one key (row b uses fold_in(rng, b)) or [B] keys; `num_new`, `greedy` and `nucleus`
    are static keyword arguments.
    """
    return jax.jit(
        functools.partial(
            _generate_entry, graphdef=graphdef, eos_ids=tuple(eos_ids), pad_id=pad_id, mesh=mesh
        ),
        static_argnames=("num_new", "greedy", "nucleus"),
        donate_argnames=("cache",) if donate else (),
    )


def _generate_entry(
    params, cache, last_logits_bv, rng, temperature, top_p, *, graphdef, mesh, **static
):
    keys_b = row_keys(rng, last_logits_bv.shape[0])
    impl = functools.partial(decode, graphdef, **static)
    if mesh is not None:
        rows = P(ROW_AXIS)
        per_row = ("cache", "last_logits", "tokens", "logprobs", "entropies", "lengths")
        out_specs = dict.fromkeys((*per_row, "stopped"), rows) | {"num_steps": P()}
        impl = per_replica(
            functools.partial(impl, row_axis=ROW_AXIS),
            mesh,
            (P(), rows, rows, rows, P(), P()),
            out_specs,
        )
    return impl(params, cache, last_logits_bv, keys_b, temperature, top_p)
