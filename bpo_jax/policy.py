"""The acting policy: tokenizer + jitted sampler + current parameters, for batches of prompts."""

from __future__ import annotations

import dataclasses

import numpy as np

from bpo_jax.models.llama import init_cache
from bpo_jax.sampler import Sampler


@dataclasses.dataclass
class ActionSample:
    token_ids: list[int]  # Generated tokens, the stop token included when one was produced.
    text: str  # Decoded text (without the stop token).
    logprobs: np.ndarray
    entropies: np.ndarray


def _batch_bucket(n: int, minimum: int = 8) -> int:
    """Rounds a batch up to a power of two so the number of compiled shapes stays small."""
    b = minimum
    while b < n:
        b *= 2
    return b


class Policy:
    """Samples actions for a batch of prompts with the current parameters.

    Attributes:
      params: the model's parameter state; the trainer swaps it after each update.
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
    ):
        self.graphdef = graphdef
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
        )
        self.model_cfg = model_cfg

    def act(self, prompts: list[list[int]], rng, *, greedy: bool = False):
        """Generates one action per prompt.

        Returns:
          (list of ActionSample, cost dict with generated_tokens and prefilled_tokens).
        """
        n = len(prompts)
        batch = _batch_bucket(n)
        for i, p in enumerate(prompts):
            if len(p) + self.max_new_tokens > self.cache_len:
                raise ValueError(
                    f"Prompt {i} has {len(p)} tokens; with {self.max_new_tokens} action "
                    f"tokens it exceeds the cache length {self.cache_len}."
                )
        filler = [self.tokenizer.pad_id]
        rows = list(prompts) + [filler] * (batch - n)
        cache = init_cache(self.model_cfg, batch, self.cache_len)
        state = self.sampler.prefill(self.params, cache, rows)
        out = self.sampler.generate(
            self.params, state, rng, temperature=0.0 if greedy else self.temperature
        )
        samples = []
        stop = set(self.tokenizer.stop_ids)
        for b in range(n):
            length = int(out.lengths[b])
            ids = [int(t) for t in out.tokens[b, :length]]
            text_ids = ids[:-1] if ids and ids[-1] in stop else ids
            samples.append(
                ActionSample(
                    token_ids=ids,
                    text=self.tokenizer.decode(text_ids),
                    logprobs=np.asarray(out.logprobs[b, :length]),
                    entropies=np.asarray(out.entropies[b, :length]),
                )
            )
        cost = {
            "generated_tokens": int(np.sum(out.lengths[:n])),
            "prefilled_tokens": int(sum(len(p) for p in prompts)),
        }
        return samples, cost
