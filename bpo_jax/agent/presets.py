"""The lengths of the verl-agent protocol, which the published ALFWorld and WebShop numbers
(GiGPO, and the GRPO / RLOO / PPO baselines trained with verl-agent) use.

Experiment files apply them to their full settings, so that the full setting's numbers are
comparable with published ones: the episode step limit (`env.max_steps`), the (observation,
action) pairs kept in the prompt (`agent.history_turns`), the longest response
(`agent.max_action_tokens`: reasoning plus the `<action>`), and the prompt budget
(`agent.max_prompt_tokens`, verl-agent's `data.max_prompt_length`). No import beyond the
standard library: configs load fast.

`CPU_CHAT` cuts the same lengths to what a small instruct model (SmolLM2-135M) plays on two CPU
cores (`model=smollm2_135m` with `cpu`): there one turn of a batch (a prompt of up to 1k tokens,
an answer of up to 128: a short reasoning and the action) takes one to two minutes, so an
evaluation of two ALFWorld games over 10 steps takes about 20 minutes.
"""

from __future__ import annotations

import types

VERL_AGENT = types.MappingProxyType(
    {
        "alfworld": types.MappingProxyType(
            {
                "max_steps": 50,
                "history_turns": 2,
                "max_action_tokens": 512,
                "max_prompt_tokens": 2048,
            }
        ),
        "webshop": types.MappingProxyType(
            {
                "max_steps": 15,
                "history_turns": 2,
                "max_action_tokens": 512,
                "max_prompt_tokens": 4096,
            }
        ),
    }
)


CPU_CHAT = types.MappingProxyType(
    {
        "alfworld": types.MappingProxyType(
            {
                "max_steps": 10,
                "history_turns": 2,
                "max_action_tokens": 128,
                "max_prompt_tokens": 1024,
            }
        ),
        "webshop": types.MappingProxyType(
            {
                "max_steps": 6,
                "history_turns": 2,
                "max_action_tokens": 128,
                "max_prompt_tokens": 1536,
            }
        ),
        # No verl-agent setting: the cpu variant's steps, a file view and a test run in the prompt.
        "swe": types.MappingProxyType(
            {
                "max_steps": 6,
                "history_turns": 2,
                "max_action_tokens": 128,
                "max_prompt_tokens": 1536,
            }
        ),
    }
)


def apply_protocol(config, env: str, cpu: bool = False) -> None:
    """Sets the chat format and verl-agent's lengths for `env` on an experiment ConfigDict
    (`cpu`: the `CPU_CHAT` lengths); `model.max_seq_len` grows to hold prompt and answer."""
    p = (CPU_CHAT if cpu else VERL_AGENT)[env]
    config.agent.format = "chat"
    config.agent.history_turns = p["history_turns"]
    config.agent.max_action_tokens = p["max_action_tokens"]
    config.agent.max_prompt_tokens = p["max_prompt_tokens"]
    config.env.max_steps = p["max_steps"]
    needed = p["max_prompt_tokens"] + p["max_action_tokens"]
    config.model.max_seq_len = max(config.model.max_seq_len, needed)
