"""The agent's turn formats: how a prompt is built from an episode and an action parsed back,
and the expert demonstrations written in them (`demos`, what behaviour cloning trains on).

May import: io.

Two formats, chosen by `config.agent.format`:
- `tiny` (`bpo_jax.agent.tiny`, the CPU default): tagged plain text (`<task> ... <room> ...
  <obs> ... <act>`), for the tiny policy that learns it by cloning the walkthroughs;
- `chat` (`bpo_jax.agent.chat`, the full settings): for pretrained instruct models: one user
  message per turn in the checkpoint's own chat template, an instruction per environment
  (`bpo_jax.agent.instructions`), reasoning then `<action>...</action>`.

An agent has `encode(episode) -> token ids` (within the prompt budget) and `parse(text) ->
action or None`; None is played as a malformed action, which the environment answers with
its invalid-format penalty. The episode's text (`EpisodeText`) is the same for both.
"""

from __future__ import annotations

from bpo_jax.agent.chat import ChatAgent, parse_chat_action
from bpo_jax.agent.episode import EpisodeText, admissible_actions, clean_text
from bpo_jax.agent.instructions import Instruction, instruction_for
from bpo_jax.agent.tiny import (
    NOTES_SYMBOL,
    SPECIAL_SYMBOLS,
    TinyAgent,
    build_prompt,
    encode_prompt,
    parse_action,
)

__all__ = [
    "AGENT_FORMATS",
    "NOTES_SYMBOL",
    "SPECIAL_SYMBOLS",
    "ChatAgent",
    "EpisodeText",
    "Instruction",
    "TinyAgent",
    "admissible_actions",
    "build_prompt",
    "clean_text",
    "encode_prompt",
    "instruction_for",
    "make_agent",
    "parse_action",
    "parse_chat_action",
]

AGENT_FORMATS = ("tiny", "chat")


def make_agent(
    fmt: str,
    tokenizer,
    *,
    history_turns: int,
    max_prompt_tokens: int,
    env_name: str = "",
    max_steps: int | None = None,
    notes=None,
):
    """The agent of format `fmt` (one of `AGENT_FORMATS`).

    Args:
      fmt: "tiny" or "chat".
      tokenizer: The policy's tokenizer (for "chat", one with a chat template).
      history_turns: Past (observation, action) pairs in the prompt.
      max_prompt_tokens: The prompt's token budget.
      env_name: The environment as `config.env.name` names it ("chat": picks its instruction).
      max_steps: The episode's step limit ("chat": told to the model).
      notes: "tiny": the agent's notes on the episode so far (`EpisodeText -> str`), or None.

    Raises:
      ValueError: For an unknown format, or "chat" with a tokenizer without a chat template.
    """
    if fmt == "tiny":
        return TinyAgent(tokenizer, history_turns, max_prompt_tokens, notes)
    if fmt == "chat":
        if notes is not None:
            raise ValueError("agent notes are a tiny-format section; the chat format has none.")
        return ChatAgent(
            tokenizer, instruction_for(env_name), history_turns, max_prompt_tokens, max_steps
        )
    raise ValueError(f"agent format must be one of {AGENT_FORMATS}, got {fmt!r}.")
