"""The acting policy: tokenizer + jitted sampler + current parameters, for batches of prompts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from bpo_jax.models.llama import init_cache
from bpo_jax.parallel import distributed
from bpo_jax.sampler import PrefillState, PrefixCache, Sampler


@dataclasses.dataclass
class ActionSample:
    token_ids: list[int]  # Generated tokens, the stop token included when one was produced.
    text: str  # Decoded text (without the stop token).
    logprobs: np.ndarray
    entropies: np.ndarray


@functools.partial(jax.jit, static_argnums=1)
def next_token_entropies(logits_bv, temperature: float):
    """[B] entropy of softmax(logits / temperature) per row (the branch rule's h_t score)."""
    logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@dataclasses.dataclass
class PolicyContext:
    """Prompts run through the model (their KV cache), ready to be sampled from."""

    state: PrefillState
    prompts: list[list[int]]

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def prefilled_tokens(self) -> int:
        """Tokens the model ran for these prompts (less than their lengths where reused)."""
        return int(self.state.prefilled_b[: self.size].sum())


def action_samples(
    tokenizer, tokens_bn, logprobs_bn, entropies_bn, lengths_b, n: int
) -> list[ActionSample]:
    """The first `n` rows of a sampler's output (host arrays) as actions, decoded."""
    samples = []
    stop = set(tokenizer.stop_ids)
    for b in range(n):
        length = int(lengths_b[b])
        ids = [int(t) for t in tokens_bn[b, :length]]
        text_ids = ids[:-1] if ids and ids[-1] in stop else ids
        samples.append(
            ActionSample(
                token_ids=ids,
                text=tokenizer.decode(text_ids),
                logprobs=np.asarray(logprobs_bn[b, :length]),
                entropies=np.asarray(entropies_bn[b, :length]),
            )
        )
    return samples


def batch_bucket(n: int, minimum: int = 8) -> int:
    """Rounds a batch up to a power of two so the number of compiled shapes stays small."""
    b = minimum
    while b < n:
        b *= 2
    return b


def check_prompts_fit(prompts, max_new_tokens: int, cache_len: int) -> None:
    """Raises ValueError naming the first prompt that leaves no room for an action."""
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > cache_len:
            raise ValueError(
                f"Prompt {i} has {len(p)} tokens; with {max_new_tokens} action "
                f"tokens it exceeds the cache length {cache_len}."
            )


def check_rows(rows, size: int) -> None:
    """Raises ValueError unless every entry of `rows` (non-empty) indexes one of `size` prompts."""
    if min(rows) < 0 or max(rows) >= size:
        raise ValueError(f"rows must index the {size} prompts, got {rows}.")


class Policy:
    """Samples actions for a batch of prompts with the current parameters.

    Attributes:
      params: the model's parameter state; the trainer swaps it after each update. Global
        parameters (sharded over other hosts' devices too) are copied onto `mesh` when set
        (`distributed.to_local`, a collective), so the policy only holds addressable arrays.
      mesh: optional device mesh: contexts are allocated with their rows split over its batch
        axes, so that with `data` > 1 each data-parallel replica samples its rows on its own
        (see `Sampler`). In a multi-host run it is this host's own devices
        (`distributed.local_mesh`): each host samples for its own tasks, and every call runs
        under it; with `slice_wide` it is the global mesh.
      slice_wide: `mesh.sampler="slice"`: in a multi-host run the parameters stay as set (the
        train state's global arrays, no host copy), and the rollouts sample through
        `bpo_jax.multihost.slice_sampler`, every host's calls joined into programs over the whole
        mesh;
        this object's own prefill / sample then refuse to run (they would be one host's
        programs). With one process it is the plain policy.
      prefixes: with `prefix_reuse` (the default), the `PrefixCache` that continues each
        turn's prompts from the previous turn's contexts, so a task's shared prefix is prefilled
        once for all its group members, branch children and turns; None without.
    """

    def __init__(
        self,
        graphdef,
        params,
        tokenizer,
        model_cfg,
        *,
        max_new_tokens: int,
        cache_len: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        length_bucket: int = 64,
        prefill_chunk: int = 0,
        mesh: Mesh | None = None,
        prefix_reuse: bool = True,
        slice_wide: bool = False,
    ):
        self.graphdef = graphdef
        self.mesh = mesh
        self.slice_wide = slice_wide
        self.params = params
        self.tokenizer = tokenizer
        self.cache_len = -(-cache_len // length_bucket) * length_bucket
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.sampler = Sampler(
            graphdef,
            eos_ids=tokenizer.stop_ids,
            pad_id=tokenizer.pad_id,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            length_bucket=length_bucket,
            prefill_chunk=prefill_chunk,
        )
        self.model_cfg = model_cfg
        self.prefixes = None
        if prefix_reuse:
            self.prefixes = PrefixCache(
                self.sampler, self._new_cache, batch_rows=lambda n: batch_bucket(n, 1)
            )

    def _new_cache(self, batch: int):
        return init_cache(self.model_cfg, batch, self.cache_len, mesh=self.mesh)

    def forget_prefixes(self) -> None:
        """Frees the contexts kept for prefix reuse (call when a rollout batch ends)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params):
        if self.mesh is None or self.slice_wide:
            self._params = params
        else:
            self._params = distributed.to_local(params, self.mesh)

    def _on_mesh(self):
        """A host's own devices as the current mesh in a multi-host run (the run's mesh is the
        global one); with one process the caller's mesh stays current."""
        if self.mesh is None or jax.process_count() == 1:
            return contextlib.nullcontext()
        if self.slice_wide:
            raise RuntimeError(
                "A slice-wide policy (mesh.sampler='slice') samples through "
                "bpo_jax.multihost.slice_sampler.play_slice_wide in a multi-process run (as "
                "shares.play_in_shares does), not by its own prefill/sample."
            )
        return jax.set_mesh(self.mesh)

    def prefill(self, prompts: list[list[int]]) -> PolicyContext:
        """Runs the prompts through the model once; the context can then be sampled many times.

        With prefix reuse, each prompt continues the longest prefix it shares with the previous
        call's prompts (or with another prompt of this call), and only the rest is run.
        """
        with self._on_mesh():
            return self._prefill(prompts)

    def _prefill(self, prompts: list[list[int]]) -> PolicyContext:
        n = len(prompts)
        check_prompts_fit(prompts, self.max_new_tokens, self.cache_len)
        batch = batch_bucket(n)
        rows = list(prompts) + [[self.tokenizer.pad_id]] * (batch - n)
        if self.prefixes is not None:
            state = self.prefixes.prefill(self.params, rows)
        else:
            state = self.sampler.prefill(self.params, self._new_cache(batch), rows)
        return PolicyContext(state, [list(p) for p in prompts])

    def next_token_entropy(self, ctx: PolicyContext) -> np.ndarray:
        """[n] entropy of each prompt's first action token under the sampling distribution.

        A function of the prompt alone (no token is sampled), which is what an unbiased online
        branch rule may look at.
        """
        with self._on_mesh():
            entropy_b = next_token_entropies(ctx.state.last_logits, self.temperature)
            return np.asarray(entropy_b)[: ctx.size]

    def sample(
        self,
        ctx: PolicyContext,
        rng,
        rows: list[int] | None = None,
        *,
        greedy: bool = False,
        keep_context: bool = False,
    ) -> list[ActionSample]:
        """Samples one action per prompt of `ctx`, or one per entry of `rows` (prompt indices).

        With `rows`, the prompts' KV-cache rows are gathered (duplicated as often as they are
        listed), so several actions are drawn from one context without re-running its prefix:
        this is how BPO samples the children of a branch point. Sampling all prompts (`rows`
        None) consumes the context's cache (its buffers are donated) unless `keep_context`.
        """
        with self._on_mesh():
            return self._sample(ctx, rng, rows, greedy=greedy, keep_context=keep_context)

    def _sample(self, ctx, rng, rows, *, greedy: bool, keep_context: bool) -> list[ActionSample]:
        if rows is None and keep_context:
            rows = list(range(ctx.size))
        elif rows is not None and not keep_context and list(rows) == list(range(ctx.size)):
            rows = None  # Every prompt once, in order: sample in place, no copy of the cache.
        if rows is None:
            state, n = ctx.state, ctx.size
        else:
            n = len(rows)
            if n == 0:
                return []
            check_rows(rows, ctx.size)
            batch = batch_bucket(n)
            state = self.sampler.fork(ctx.state, list(rows) + [rows[0]] * (batch - n))
        out = self.sampler.generate(
            self.params, state, rng, temperature=0.0 if greedy else self.temperature
        )
        return action_samples(
            self.tokenizer, out.tokens, out.logprobs, out.entropies, out.lengths, n
        )
