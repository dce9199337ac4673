"""The tiny turn format: tagged plain text, for the policy that learns it by cloning.

A prompt is plain text made of tagged sections, which a SentencePiece tokenizer trained on the
environment's text (with the tags as single pieces) covers compactly:

    <task> {goal} <room> {first observation, without the goal}
    <obs> {observation t-h} <act> {action t-h} </act>      (the last `history_turns` turns)
    ...
    [<notes> {the agent's notes}]                          (with `notes`, e.g. `agent.notes`)
    <obs> {current observation} <act>

The notes are a function of the episode's text so far (an environment's summary of what the
agent has read: `envs/alfworld/memory.py` for ALFWorld), placed just before the current
observation, so that a history that only grows still extends the previous prompt.

The model writes the action and ends it with its end-of-sequence token (or `</act>`, or a
newline). When the prompt exceeds the token budget the oldest history turns are dropped first,
then the room description is cut from its end; the task and current observation always stay.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from bpo_jax.agent.episode import EpisodeText, clean_text

SPECIAL_SYMBOLS = ("<task>", "<room>", "<obs>", "<act>", "</act>")
NOTES_SYMBOL = "<notes>"  # A tokenizer piece of its own only where notes are used.

# (episode text) -> the agent's notes on it: a function of the texts the episode showed.
Notes = Callable[[EpisodeText], str]


def build_prompt(ep: EpisodeText, history_turns: int, notes: Notes | None = None) -> list[str]:
    """Returns the prompt as a list of text pieces, oldest first (for budgeted truncation); the
    last piece (notes and current observation) is always kept whole."""
    head = f"<task> {clean_text(ep.goal)} <room> {clean_text(ep.room)}"
    turns = ep.turns[-history_turns:] if history_turns > 0 else []
    pieces = [head]
    for obs, act in turns:
        obs_part = f" <obs> {clean_text(obs)}" if obs else ""
        pieces.append(f"{obs_part} <act> {clean_text(act)} </act>")
    current = f" <obs> {clean_text(ep.current)}" if ep.current else ""
    noted = f" {NOTES_SYMBOL} {clean_text(notes(ep))}" if notes is not None else ""
    pieces.append(f"{noted}{current} <act>")
    return pieces


def encode_prompt(
    tokenizer,
    ep: EpisodeText,
    history_turns: int,
    max_tokens: int,
    add_bos: bool = True,
    notes: Notes | None = None,
) -> list[int]:
    """Tokenises the prompt within `max_tokens`, dropping the oldest context first."""
    pieces = build_prompt(ep, history_turns, notes)
    ids = [tokenizer.encode(p) for p in pieces]
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    head, middle, tail = ids[0], ids[1:-1], ids[-1]
    while middle and len(bos) + len(head) + sum(map(len, middle)) + len(tail) > max_tokens:
        middle = middle[1:]
    budget_head = max_tokens - len(bos) - sum(map(len, middle)) - len(tail)
    if budget_head < len(head):
        head = head[: max(budget_head, 0)]
    out = bos + head + [t for m in middle for t in m] + tail
    if len(out) > max_tokens:
        # Even the current observation alone is too long: keep its end, where the action cue is.
        out = out[-max_tokens:]
    return out


def parse_action(text: str) -> str | None:
    """Extracts the action from generated text; None if there is none.

    The action is the text up to the first `</act>`, newline or tag; tags the model echoes are
    dropped. Returns None for empty or whitespace-only output, which the environment treats as an
    invalid action.
    """
    text = text.split("</act>", 1)[0].split("\n", 1)[0]
    text = re.split(r"<(?:task|room|obs|act|notes)>", text, maxsplit=1)[0]
    text = clean_text(text).strip().rstrip(".")
    return text or None


class TinyAgent:
    """The tiny format as an agent: `encode(episode) -> ids` and `parse(text) -> action`.

    Args:
      tokenizer: Any `bpo_jax.tokenizer.Tokenizer`.
      history_turns: (observation, action) pairs of the past kept in the prompt.
      max_prompt_tokens: The prompt's token budget (the oldest context is dropped first).
      notes: The agent's notes on the episode so far, or None for none.
    """

    format = "tiny"

    def __init__(
        self, tokenizer, history_turns: int, max_prompt_tokens: int, notes: Notes | None = None
    ):
        self.tokenizer = tokenizer
        self.history_turns = history_turns
        self.max_prompt_tokens = max_prompt_tokens
        self.notes = notes

    def encode(self, ep: EpisodeText) -> list[int]:
        return encode_prompt(
            self.tokenizer, ep, self.history_turns, self.max_prompt_tokens, notes=self.notes
        )

    __call__ = encode  # `play_forest` also takes a bare prompt function.

    @staticmethod
    def parse(text: str) -> str | None:
        return parse_action(text)
