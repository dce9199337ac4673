"""Slice-wide sampling (`mesh.sampler="slice"`): the hosts' policy calls as global programs.

The executor of `bpo_jax.multihost.lockstep`'s rounds: every host runs `SliceSampler.run` for each
group
of a round, with every host's requests in hand, so each program is one SPMD program over the
global mesh with the parameters as the train state holds them (no host copy). Host p's rows are
block p of the global batch (`lockstep.blocks`), filler rows where it has fewer (or none).

  * prefill: a fresh cache of `hosts x R` rows, the prompts right-padded to the longest
    prompt's bucket over all hosts; the context is registered under the round's id.
  * entropy: the next-token entropy of each referenced context, one program per context.
  * sample: each host's rows gathered from its own contexts into a fresh batch
    (`contexts.regroup`, one program over every referenced context), or a context consumed as
    it is when its hosts all sample all of its prompts in order; row j of host p's block draws
    with `fold_in(key_p, j)` (`host_row_keys`), as row j of a one-process batch does.

Inputs are numpy arrays every host builds alike from the gathered requests (host-local values
that are equal on every host, which a multi-process `jit` takes as replicated). Outputs are read
back by each host from its addressable shards, its own block only (`own_rows`); where a
sharding puts a host's block on other hosts' devices, every host fetches the whole output
instead (a collective, decided alike on every host from the sharding alone).

Float results: a row's values do not depend on the other rows' values, but a batch's shapes
(rows, the prompts' length bucket) are those of the whole slice's batch, so results can differ
from a host-local batch's by float rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bpo_jax.models.kv_cache import init_cache
from bpo_jax.models.sharding import named_sharding
from bpo_jax.multihost import lockstep
from bpo_jax.parallel import distributed
from bpo_jax.sampler.contexts import PrefillState, regroup
from bpo_jax.sampler.policy import next_token_entropies
from bpo_jax.sampler.replicas import row_mesh
from bpo_jax.sampler.tokens import row_keys


def play_slice_wide(policy, play: Callable[[lockstep.LockstepPolicy], object]):
    """`play(policy)` on this host, its sampling joined with the other hosts' (a collective)."""
    return lockstep.run_in_lockstep(play, SliceSampler(policy), policy)


@functools.partial(jax.jit, static_argnames=("impl", "rows"))
def host_row_keys(data_pk, *, impl: str, rows: int):
    """[P * rows] keys: row j of host p's block gets `fold_in(key_p, j)` (`tokens.row_keys`).

    Args:
      data_pk: [P, K] uint32, each host's raw key data (any key for a host without rows).
      impl: the keys' implementation name (`jax.random.key_impl`).
    """
    keys_p = jax.random.wrap_key_data(data_pk, impl=impl)
    return jax.vmap(lambda key: row_keys(key, rows))(keys_p).reshape(-1)


@dataclasses.dataclass
class _Context:
    """A registered context: the global state and what every host knows of its rows."""

    state: PrefillState
    block: int  # Rows per host: host p's are [p * block, (p + 1) * block).
    owners: frozenset[int]  # Hosts with prompts in it.
    released: set[int] = dataclasses.field(default_factory=set)


class SliceSampler:
    """Runs `lockstep` groups as programs over the policy's (global) mesh; see the module
    docstring. Every host holds one, with the same registry of contexts."""

    def __init__(self, policy, hosts: int | None = None, me: int | None = None):
        if policy.mesh is None:
            raise ValueError("Slice-wide sampling needs the policy's mesh (the global one).")
        self.policy = policy
        self.sampler = policy.sampler
        self.mesh = policy.mesh
        self.hosts = distributed.process_count() if hosts is None else hosts
        self.me = distributed.process_index() if me is None else me
        self.contexts: dict[int, _Context] = {}
        self._next_id = 0
        self._layouts: dict[int, object] = {}

    def release(self, host: int, ids: Sequence[int]) -> None:
        """Host `host` dropped these contexts; each is freed once all its owners have."""
        for i in ids:
            ctx = self.contexts.get(i)
            if ctx is None:  # Consumed by a sample in place.
                continue
            ctx.released.add(host)
            if ctx.owners <= ctx.released:
                del self.contexts[i]

    def run(self, group: lockstep.Group, requests: Sequence[lockstep.Request]):
        """Runs one group; returns this host's answer (None where it has no request in it)."""
        return {"prefill": self._prefill, "entropy": self._entropy, "sample": self._sample}[
            group.kind
        ](group, requests)

    # ------------------------------------------------------------------ the three kinds

    def _prefill(self, group, requests):
        r = group.rows
        pad = self.policy.tokenizer.pad_id
        prompts = {h: [list(p) for p in requests[h].prompts] for h in group.hosts}
        rows = lockstep.blocks(prompts, self.hosts, r, lambda p, own: [pad])
        batch = len(rows)
        tokens_bt, num_new_b = self.sampler.pad_tokens(rows, None, batch)
        cache = init_cache(self.policy.model_cfg, batch, self.policy.cache_len, mesh=self.mesh)
        vocab = self.policy.model_cfg.vocab_size
        last_bv = jnp.zeros(
            (batch, vocab),
            jnp.float32,
            device=named_sharding(self.mesh, ("batch", None), (batch, vocab)),
        )
        # A fresh cache: every row starts at 0, the bound `Sampler.prefill` passes for it.
        cache, last_bv = self.sampler.run_prefill(
            self.policy.params,
            cache,
            last_bv,
            tokens_bt,
            num_new_b,
            np.zeros_like(num_new_b),
            keep=False,
        )
        # Every row's cached length is known on every host: the prompts' lengths.
        state = PrefillState(cache, last_bv, num_new_b, tokens_bt.shape[1], num_new_b.copy())
        context = self._next_id
        self._next_id += 1
        self.contexts[context] = _Context(state, r, frozenset(group.hosts))
        return (context, self.me * r) if self.me in group.hosts else None

    def _entropy(self, group, requests):
        mine = None
        for context in sorted({requests[h].context for h in group.hosts}):
            ctx = self._context(context)
            spans = {
                h: (h * ctx.block, h * ctx.block + requests[h].size)
                for h in group.hosts
                if requests[h].context == context
            }
            entropy_b = next_token_entropies(ctx.state.last_logits, self.policy.temperature)
            out = own_rows(entropy_b, spans, self.me)
            mine = out if out is not None else mine
        return mine

    def _sample(self, group, requests):
        r, hosts = group.rows, group.hosts
        state = self._consume(group, requests)
        if state is None:
            state = self._gather(group, requests)
        kinds = {(len(requests[h].key[0]), requests[h].key[1]) for h in hosts}
        if len(kinds) != 1:
            raise ValueError(f"The hosts' sampling keys are of different kinds: {sorted(kinds)}.")
        width, impl = kinds.pop()
        key_data = np.zeros((self.hosts, width), np.uint32)  # Zeros: hosts without rows.
        for h in hosts:
            key_data[h] = requests[h].key[0]
        temperature = 0.0 if group.greedy else self.policy.temperature
        top_p = self.sampler.top_p
        out = self.sampler.generate_fn(row_mesh(state.cache))(
            self.policy.params,
            state.cache,
            state.last_logits,
            host_row_keys(key_data, impl=impl, rows=r),
            jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p),
            num_new=self.sampler.max_new_tokens,
            greedy=group.greedy,
            nucleus=top_p < 1.0,
        )
        spans = {h: (h * r, h * r + len(requests[h].rows)) for h in hosts}
        fields = ("tokens", "logprobs", "entropies", "lengths")
        mine = {f: own_rows(out[f], spans, self.me) for f in fields}
        return mine if self.me in hosts else None

    # ------------------------------------------------------------------ helpers

    def _context(self, context: int) -> _Context:
        if context not in self.contexts:
            raise ValueError(
                f"Context {context} is gone: a sample of all its prompts without keep_context "
                "consumed it, or every host holding it released it."
            )
        return self.contexts[context]

    def _consume(self, group, requests) -> PrefillState | None:
        """The group's one context as it is, when every host with rows in it samples all its
        prompts in order without keeping it (`Policy.sample(ctx)`'s in-place case)."""
        reqs = [requests[h] for h in group.hosts]
        contexts = {q.context for q in reqs}
        if len(contexts) != 1 or not all(q.in_place for q in reqs):
            return None
        context = contexts.pop()
        ctx = self._context(context)
        if ctx.owners != frozenset(group.hosts) or ctx.block != group.rows:
            return None
        del self.contexts[context]
        return ctx.state

    def _gather(self, group, requests) -> PrefillState:
        """Each host's rows of its own contexts, in its block of a fresh batch (one program)."""
        contexts = sorted({requests[h].context for h in group.hosts})
        sources = [self._context(c) for c in contexts]
        starts = np.cumsum([0] + [self.hosts * s.block for s in sources])
        first = {c: int(starts[i]) for i, c in enumerate(contexts)}
        index = {}
        for h in group.hosts:
            q = requests[h]
            base = first[q.context] + h * self._context(q.context).block
            index[h] = [base + row for row in q.rows]
        # Filler: a host's own first row, or (no rows) the first row of its block of the first
        # source, so no filler row comes from another host's block.
        rows = lockstep.blocks(
            index, self.hosts, group.rows, lambda p, own: own[0] if own else p * sources[0].block
        )
        lengths_b = np.concatenate([s.state.host_lengths for s in sources])[rows]
        return regroup([s.state for s in sources], rows, lengths_b, self._layout(len(rows)))

    def _layout(self, batch: int):
        """Shapes and shardings of a fresh cache of `batch` rows (allocated once per size)."""
        if batch not in self._layouts:
            self._layouts[batch] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                init_cache(self.policy.model_cfg, batch, self.policy.cache_len, mesh=self.mesh),
            )
        return self._layouts[batch]


def rows_held(sharding, shape: Sequence[int], process: int) -> np.ndarray:
    """[shape[0]] bool: the rows that `process`'s devices hold whole (every other dimension)."""
    held = np.zeros((shape[0],), bool)
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        if device.process_index != process:
            continue
        if all(range(n)[s] == range(n) for s, n in zip(index[1:], shape[1:])):
            held[np.arange(shape[0])[index[0]]] = True
    return held


def own_rows(x: jax.Array, spans: Mapping[int, tuple[int, int]], me: int) -> np.ndarray | None:
    """Rows [start, stop) of `spans[me]` of a global array, on host `me` (None: no span).

    Each host reads its span from its own shards when every host's span lies on its own
    devices; otherwise every host fetches the whole array (`distributed.fetch`, a collective),
    which is why every host calls this for every output, span or not: the choice depends on the
    sharding and the spans alone, so it is the same on every host.
    """
    local = all(rows_held(x.sharding, x.shape, p)[a:b].all() for p, (a, b) in spans.items())
    if not local:
        whole = distributed.fetch(x)
        return whole[slice(*spans[me])] if me in spans else None
    if me not in spans:
        return None
    start, stop = spans[me]
    out = np.empty((stop - start, *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
        if not all(range(n)[s] == range(n) for s, n in zip(shard.index[1:], x.shape[1:])):
            continue
        rows_r = np.arange(x.shape[0])[shard.index[0]]
        keep_r = (rows_r >= start) & (rows_r < stop)
        if keep_r.any():
            out[rows_r[keep_r] - start] = np.asarray(shard.data)[keep_r]
    return out
