"""A jitted KV-cache sampler for language agents, with forking for BPO's branch points.

May import: models, parallel.

What the rollouts use (through `bpo_jax.sampler.policy.Policy`), once per agent turn:

    sampler = Sampler(graphdef, eos_ids=[eos], pad_id=pad, max_new_tokens=64)
    state = sampler.prefill(params, init_cache(cfg, batch, capacity), prompts)
    out = sampler.generate(params, sampler.fork(state, rows), rng)   # a branch point's K
    out.tokens, out.logprobs, out.entropies, out.lengths             # children: rows repeated

`prefill` runs each row's prompt once; `fork` gathers (and duplicates) the prompt's cache rows,
so the children of a branch point are sampled from one context without re-running its prefix;
`generate` samples up to `max_new_tokens` per row and reports each token's log-probability and
entropy (what the learner scores and the branch rule looks at). With the cache's rows split over
a mesh's `data` axis, each data-parallel replica samples its rows as its own program.

The modules, one role each:
  * `core`: `Sampler` (host-side checks, padding to length buckets, the compiled programs).
  * `programs`: the traced prefill and decode-loop bodies and their jitted programs.
  * `tokens`: token sampling (temperature, top-p, inverse-CDF draws, per-row keys).
  * `contexts`: `PrefillState` / `SampleOutput` and row operations (`fork_rows`,
    `concat_states`, and `regroup`: both and a cut, as one program).
  * `replicas`: the per-replica `shard_map` path (`row_mesh`, `per_replica`).
  * `prefixes`: `PrefixCache`, shared prompt prefixes computed once: each prompt continues the
    longest prefix it shares with the previous call's prompts (a task's head, for every group
    member, branch child and turn), and only the rest is prefilled.

Contexts also extend over turns: `generate` leaves every generated token in the cache, so
`sampler.prefill(params, out.state, observation)` appends the next observation without
re-running the prefix, and `concat_states` stacks the rows of several states into one batch.

Sampling semantics (see `tokens`): logprobs and entropies describe softmax(logits /
temperature) before top-p truncation; row b draws its token at cache position p with
`fold_in(row_key[b], p)`, so a forked row given its original's key continues exactly like the
original, and rows given different keys diverge. Pass a fresh key per call.
"""

from bpo_jax.sampler.contexts import PrefillState, SampleOutput, concat_states, fork_rows
from bpo_jax.sampler.core import Sampler, bucket_length
from bpo_jax.sampler.prefixes import PrefixCache
from bpo_jax.sampler.replicas import ROW_AXIS, row_mesh
from bpo_jax.sampler.tokens import inverse_cdf, nucleus_mask, row_keys, sample_logits

__all__ = [
    "ROW_AXIS",
    "PrefillState",
    "PrefixCache",
    "SampleOutput",
    "Sampler",
    "bucket_length",
    "concat_states",
    "fork_rows",
    "inverse_cdf",
    "nucleus_mask",
    "row_keys",
    "row_mesh",
    "sample_logits",
]
