"""Padded batches of sequences (prompt + action), as the loss and the update read them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    """A padded batch of sequences (numpy on the host; device arrays inside jit).

    Attributes:
      tokens: int32 [B, L] prompt + action tokens, right-padded.
      loss_mask: float32 [B, L]; 1 where token l is an action token to train (predicted from
        position l - 1).
      advantages: float32 [B, L] per-token advantage (zero for BC).
      old_logprobs: float32 [B, L] log-probs of the tokens under the behaviour policy.
      weights: float32 [B] per-sequence loss weight (default 1 for every real row; 0 for
        padding rows). E.g. 1 / (steps in the sequence's trajectory), so that every trajectory
        weighs the same in the loss however many steps it took.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    weights: np.ndarray


jax.tree_util.register_dataclass(
    Batch,
    data_fields=["tokens", "loss_mask", "advantages", "old_logprobs", "weights"],
    meta_fields=[],
)


def pad_batch(
    sequences: Sequence[Sequence[int]],
    action_starts: Sequence[int],
    *,
    batch_size: int,
    length: int,
    pad_id: int,
    advantages: Sequence[float] | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    weights: Sequence[float] | None = None,
) -> Batch:
    """Packs sequences into a fixed-shape batch (padding rows get weight 0).

    Args:
      sequences: token ids, prompt followed by action (and its stop token).
      action_starts: index in each sequence of its first action token.
      batch_size, length: the static shape; sequences longer than `length` raise.
      pad_id: padding token.
      advantages: one scalar per sequence (broadcast to its action tokens).
      old_logprobs: per action token log-probs (len == len(seq) - action_start).
      weights: per-sequence loss weights (default 1).
    """
    weights_in = weights
    n = len(sequences)
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit in a batch of {batch_size}.")
    tokens = np.full((batch_size, length), pad_id, np.int32)
    mask = np.zeros((batch_size, length), np.float32)
    adv = np.zeros((batch_size, length), np.float32)
    old = np.zeros((batch_size, length), np.float32)
    weights = np.zeros((batch_size,), np.float32)
    for i, (seq, start) in enumerate(zip(sequences, action_starts)):
        if len(seq) > length:
            raise ValueError(
                f"Sequence {i} has {len(seq)} tokens, more than the batch length {length}."
            )
        if not 0 < start <= len(seq):
            raise ValueError(f"Sequence {i}: action start {start} outside (0, {len(seq)}].")
        tokens[i, : len(seq)] = seq
        mask[i, start : len(seq)] = 1.0
        weights[i] = 1.0 if weights_in is None else float(weights_in[i])
        if advantages is not None:
            adv[i, start : len(seq)] = advantages[i]
        if old_logprobs is not None:
            lp = np.asarray(old_logprobs[i], np.float32)
            if len(lp) != len(seq) - start:
                raise ValueError(
                    f"Sequence {i}: {len(lp)} old log-probs for {len(seq) - start} tokens."
                )
            old[i, start : len(seq)] = lp
    return Batch(tokens, mask, adv, old, weights)
