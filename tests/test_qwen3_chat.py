"""Qwen3's chat template and the chat agent's training examples.

Qwen3's template drops the reasoning (`<think>...</think>`) of assistant turns before the last
user message, so in a multi-turn conversation a later turn's prompt is not the earlier prompt
plus its answer. The chat agent (`bpo_jax.agent.chat`) renders every turn as one user message
(the verl-agent protocol: the history is text inside it, parsed actions only, no earlier
answers), so that rewrite never applies to its prompts. These tests play a random Qwen3-style
policy (per-head q/k norms) through the engine with a Qwen3-style template and check that every
training example pairs the token ids the sampler saw with the log-probs it recorded; they also
measure what the prefix cache reuses with thinking on and off (the template's
`enable_thinking`, which the agent cannot pass: "off" is a template that sets it).
"""

import jax
import numpy as np
import pytest
from chat_fixtures import write_chat_checkpoint
from flax import nnx

from bpo_jax import learner
from bpo_jax.agent import make_agent
from bpo_jax.models import config
from bpo_jax.models.factory import create_model
from bpo_jax.rl import forest_examples
from bpo_jax.rollout.engine import TreeSpec, play_forest
from bpo_jax.sampler.policy import Policy
from bpo_jax.tokenizer import load_tokenizer

# Written for these tests in the manner of Qwen3's template (not a copy of it): no default
# system message; an assistant turn before the last user message loses everything up to its
# `</think>`; with `enable_thinking` false the generation prompt holds an empty think block.
QWEN3_STYLE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m['role'] == 'assistant' -%}
        {%- set content = m['content'] -%}
        {%- if loop.index0 < ns.last_user and '</think>' in content -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
<|im_start|>assistant
{{ content }}<|im_end|>
{% else -%}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""
THINKING_OFF = "{%- set enable_thinking = false -%}\n" + QWEN3_STYLE
ANSWER = 24


def _tokenizer(folder, template: str):
    write_chat_checkpoint(folder)
    (folder / "chat_template.jinja").write_text(template)  # Takes priority, as in transformers.
    return load_tokenizer(folder)


def _play(tok, seed=0):
    """A random tiny Qwen3-style policy's forest on the tabular env: (forest, policy)."""
    from envs.sandbox import SandboxPool
    from envs.tabular import load_tasks

    mcfg = config.tiny(vocab_size=tok.vocab_size, qk_norm=True, qkv_bias=False, max_seq_len=2048)
    graphdef, params = nnx.split(create_model(mcfg, seed=seed))
    policy = Policy(graphdef, params, tok, mcfg, max_new_tokens=ANSWER, cache_len=1024 + ANSWER)
    agent = make_agent(
        "chat", tok, history_turns=2, max_prompt_tokens=1024, env_name="tabular", max_steps=3
    )
    tasks = load_tasks(None, "train", instance="generic", copies=2)
    env = {"max_steps": 3, "invalid_action_penalty": 0.1, "instance": "generic"}
    with SandboxPool("tabular", env, backend="inprocess") as pool:
        forest = play_forest(
            pool, policy, agent, tasks, TreeSpec(root_group=2), rng=jax.random.key(seed)
        )
    return forest, policy


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    return {
        name: (tok, *_play(tok))
        for name, template in (("thinking_on", QWEN3_STYLE), ("thinking_off", THINKING_OFF))
        for tok in [_tokenizer(tmp_path_factory.mktemp(name), template)]
    }


def test_the_template_rewrites_earlier_turns(tmp_path):
    """The hazard: rendered as a conversation, turn 2's prompt does not extend turn 1's."""
    tok = _tokenizer(tmp_path, QWEN3_STYLE)
    answer = "<think>The drawer is closed.</think>\n\n<action>open drawer 1</action>"
    first = tok.chat_template.render([{"role": "user", "content": "A"}], add_generation_prompt=True)
    conversation = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "B"},
    ]
    second = tok.chat_template.render(conversation, add_generation_prompt=True)
    assert not second.startswith(first + answer)
    assert "<think>" not in second and "<action>open drawer 1</action>" in second


@pytest.mark.slow  # The two forests take about 2 minutes on 2 busy cores.
@pytest.mark.parametrize("name", ["thinking_on", "thinking_off"])
def test_every_example_pairs_the_sampled_ids_with_their_logprobs(played, name):
    tok, forest, policy = played[name]
    steps = [s for s in forest.steps() if s.action_ids]
    assert len(steps) >= 8
    head = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if name == "thinking_off" else "")
    for s in steps:
        text = tok.decode(s.prompt_ids, skip_special=False)
        # One user message and the generation prompt: no earlier answer for the template to
        # rewrite, so the prompt is exactly what the sampler was given.
        assert text.count("<|im_start|>user") == 1 and text.count("<|im_start|>assistant") == 1
        assert text.endswith(head), text[-60:]
    ones = np.ones(len(forest.steps()))
    examples = forest_examples(forest, ones, ones)
    assert len(examples) == len(steps)
    # Teacher forcing the training example reproduces the log-probs recorded while sampling.
    score = learner.make_logprob_fn(policy.graphdef, policy.temperature)
    worst = 0.0
    for ex, s in zip(examples, steps):
        assert ex.tokens == s.prompt_ids + s.action_ids and ex.action_start == len(s.prompt_ids)
        logp, _ = score(policy.params, np.asarray([ex.tokens], np.int32))
        got = np.asarray(logp[0, ex.action_start : len(ex.tokens)])  # logp[t]: token t.
        np.testing.assert_allclose(got, s.logprobs, atol=1e-4, rtol=0)
        worst = max(worst, float(np.abs(got - s.logprobs).max()))
    print(f"{name}: {len(examples)} examples, max |logprob difference| {worst:.2e}")


@pytest.mark.slow
def test_prefix_cache_reuse_with_thinking_on_and_off(played):
    """What the prefix cache saves: prefilled against prompt tokens, per template."""
    reuse = {}
    for name, (_, forest, _) in played.items():
        prompts = sum(len(s.prompt_ids) for s in forest.steps())
        prefilled = forest.stats.prefilled_tokens
        reuse[name] = 1 - prefilled / prompts
        share = f"{reuse[name]:.1%}"
        print(f"{name}: {prefilled} of {prompts} prompt tokens prefilled ({share} reused)")
    # Turns of one episode share the message's head (role, task, instruction): reused either
    # way; the empty think block sits at the prompt's end, after every shared prefix.
    assert all(0 < r < 1 for r in reuse.values())
    assert abs(reuse["thinking_on"] - reuse["thinking_off"]) < 0.05
