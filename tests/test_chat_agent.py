"""The chat-format agent: prompts in the checkpoint's template, `<action>` parsing, budgets,
its wiring through the rollout engine and the configs, and two RL iterations on a random Qwen2.
"""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from chat_fixtures import write_chat_checkpoint

from bpo_jax import agent as agent_lib
from bpo_jax.agent import ChatAgent, EpisodeText, instruction_for, make_agent, parse_chat_action
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from bpo_jax.rollout.engine import TreeSpec, play_forest
from bpo_jax.sampler.policy import ActionSample
from bpo_jax.tokenizer import HFTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

FIRST = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
    "around you, you see a cabinet 1, a countertop 1, a drawer 2 and a fridge 1.\n\n"
    "Your task is to: put a clean mug in coffeemachine."
)
ADMISSIBLE = ["go to cabinet 1", "go to countertop 1", "help", "inventory", "look"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_chat_checkpoint(tmp_path_factory.mktemp("chat")))


def alfworld_agent(tok, history_turns=2, max_prompt_tokens=4096):
    return make_agent(
        "chat",
        tok,
        history_turns=history_turns,
        max_prompt_tokens=max_prompt_tokens,
        env_name="alfworld",
        max_steps=50,
    )


def episode(turns: int) -> EpisodeText:
    ep = EpisodeText.start(FIRST, actions=ADMISSIBLE)
    for i in range(turns):
        ep.record(
            f"go to drawer {i}", f"You arrive at drawer {i}. The drawer {i} is closed.", ADMISSIBLE
        )
    return ep


# Parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        (
            "<think>The mug is on the counter.</think><action>go to countertop 1</action>",
            "go to countertop 1",
        ),
        (
            "<think>x</think>\n<action>  go to countertop 1 \n</action><|im_end|>",
            "go to countertop 1",
        ),
        # The format reminder echoed in the reasoning: the last complete pair is the answer.
        (
            "I answer inside <action> </action> tags.\n<action>open drawer 2</action>",
            "open drawer 2",
        ),
        ("<action>look</action> or rather <action>inventory</action>", "inventory"),
        ("<action>look</action><action>inventory", "look"),  # A later pair cut off: not it.
        ("<ACTION>look</Action>", "look"),
        ("<action>click[buy now]\n</action>", "click[buy now]"),
        ("<action>go to \ud800desk</action>", "go to \ufffddesk"),
        # Malformed: no action.
        ("go to countertop 1", None),
        ("<think>go to countertop 1</think>", None),
        ("<action>go to countertop 1", None),  # Cut off by the response limit.
        ("go to countertop 1</action>", None),
        ("</action>look<action>", None),
        ("<action></action>", None),
        ("<action> \n </action>", None),
        ("", None),
        ("<act>look</act>", None),
    ],
)
def test_parse_chat_action(text, expected):
    assert parse_chat_action(text) == expected


def test_parse_lowercases_where_the_protocol_does(tok):
    answer = "<think>t</think><action>Go to Countertop 1</action>"
    assert alfworld_agent(tok).parse(answer) == "go to countertop 1"
    swe = make_agent("chat", tok, history_turns=2, max_prompt_tokens=4096, env_name="swe")
    assert swe.parse("<action>view Src/Calc.py 1-9</action>") == "view Src/Calc.py 1-9"


# Prompts ---------------------------------------------------------------------------------------


def test_prompt_is_the_templates_rendering_of_one_user_message(tok):
    agent = alfworld_agent(tok)
    ep = episode(0)
    ids = agent.encode(ep)
    user = agent.user_message(ep, 2)
    expected = tok.chat_template.render([{"role": "user", "content": user}])
    assert ids == tok.encode(expected)
    text = tok.decode(ids, skip_special=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "ALFWorld" in user and "Your task is to: put a clean mug in coffeemachine." in user
    assert "This is your first step (at most 50 in all)." in user
    # The first observation is the room (the goal sentence is the task line's).
    assert "[Current observation, step 1] -= Welcome to TextWorld" in user
    assert user.count("Your task is to:") == 1
    listed = user.split("Admissible actions:\n")[1].split("\n\n")[0].split("\n")
    assert listed == ["go to cabinet 1", "go to countertop 1", "inventory", "look"]  # No help.
    assert user.endswith("<action>go to countertop 1</action>.")


def test_prompt_keeps_the_last_turns(tok):
    agent = alfworld_agent(tok, history_turns=2)
    ep = episode(3)
    ep.turns[1] = (ep.turns[1][0], "")  # An invalid answer is recorded as no action.
    user = agent.user_message(ep, 2)
    assert "You have taken 3 step(s) so far (at most 50 in all)." in user
    assert "[Observation 1]" not in user and "go to drawer 0" not in user
    assert "[Observation 2] You arrive at drawer 0." in user
    assert "[Action 2] (no valid action)" in user
    assert "[Observation 3] You arrive at drawer 1." in user and "[Action 3] go to drawer 2" in user
    assert user.index("[Action 3]") < user.index(
        "[Current observation, step 4] You arrive at drawer 2"
    )
    # The first turn's observation is the room description.
    assert "[Observation 1] -= Welcome" in agent.user_message(episode(1), 2)


def test_budget_drops_history_then_cuts_observation_then_actions(tok):
    agent = alfworld_agent(tok, history_turns=2)
    ep = episode(3)
    full = agent.encode(ep)
    no_history = alfworld_agent(tok, history_turns=0).encode(ep)
    one_turn = alfworld_agent(tok, history_turns=1).encode(ep)
    assert len(no_history) < len(one_turn) < len(full)
    # Just under the full prompt, the oldest turn goes first.
    assert alfworld_agent(tok, 2, len(full) - 1).encode(ep) == one_turn
    assert alfworld_agent(tok, 2, len(one_turn) - 1).encode(ep) == no_history
    # Below that, the current observation is cut at its end, then the action list.
    ep.current = "You arrive at drawer 2. " + "On the drawer 2, you see a spoon 1. " * 40
    long = alfworld_agent(tok, 0).encode(ep)
    bare = len(tok.encode(agent.render(agent.user_message(ep, 0, "", []))))
    for budget in (len(long) - 1, len(long) - 100, bare + 40, bare + 5, bare):
        ids = alfworld_agent(tok, 2, budget).encode(ep)
        assert len(ids) <= budget
        text = tok.decode(ids, skip_special=False)
        assert "Your task is to: put a clean mug" in text and text.endswith("assistant\n")
    cut = tok.decode(alfworld_agent(tok, 2, len(long) - 100).encode(ep))
    assert "You arrive at drawer 2. On the drawer 2" in cut and " [...]" in cut
    assert "Admissible actions:\ngo to cabinet 1" in cut
    with pytest.raises(ValueError, match="max_prompt_tokens=.* too small"):
        alfworld_agent(tok, 2, bare - 1).encode(ep)


def test_instructions_per_environment(tok):
    alf = instruction_for("alfworld")
    assert alf == instruction_for("bpo_jax/ALFWorld-v0") and alf.hidden_actions == ("help",)
    assert "search[your query]" in instruction_for("webshop").action_format
    from envs.swe.tools import HELP

    assert HELP in instruction_for("swe").action_format
    assert instruction_for("bpo_jax/TabularTree-v0").example == "a0"
    generic = instruction_for("mypackage.envs:MyEnv")
    assert "text environment" in generic.role and generic.example == ""
    # An env that lists no actions gets no action list.
    agent = make_agent("chat", tok, history_turns=2, max_prompt_tokens=4096, env_name="swe")
    ep = EpisodeText.start("Fix the bug.\n\nTools: view PATH", goal="fix calc")
    assert "Admissible actions" not in agent.user_message(ep, 2)


def test_chat_needs_a_template(tmp_path, tok):
    folder = write_chat_checkpoint(tmp_path)
    data = json.loads((folder / "tokenizer_config.json").read_text())
    del data["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        make_agent("chat", HFTokenizer(folder), history_turns=2, max_prompt_tokens=512)
    with pytest.raises(ValueError, match="must be one of"):
        make_agent("xml", tok, history_turns=2, max_prompt_tokens=512)
    assert isinstance(alfworld_agent(tok), ChatAgent)
    assert agent_lib.AGENT_FORMATS == ("tiny", "chat")


# Through the rollout engine ---------------------------------------------------------------------


class _Context(list):
    prefilled_tokens = 0


class ScriptedChatPolicy:
    """Answers each chat prompt like an instruct model: reasoning, then the last admissible
    action in `<action>` tags; at the first step it forgets the tags (a malformed answer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prompts = []

    def prefill(self, prompts):
        self.prompts.extend(prompts)
        return _Context(prompts)

    def next_token_entropy(self, ctx):
        return np.zeros(len(ctx))

    def sample(self, ctx, rng, rows=None, *, greedy=False, keep_context=False):
        out = []
        for r in range(len(ctx)) if rows is None else rows:
            text = self.tokenizer.decode(ctx[r], skip_special=False)
            step = int(re.search(r"\[Current observation, step (\d+)\]", text).group(1))
            last = text.split("Admissible actions:\n")[1].split("\n\n")[0].split("\n")[-1]
            answer = f"<think>Step {step}.</think>" + (
                f"I pick {last}." if step == 1 else f"<action>{last}</action>"
            )
            ids = self.tokenizer.encode(answer) + [self.tokenizer.eos_id]
            out.append(ActionSample(ids, answer, np.zeros(len(ids)), np.zeros(len(ids))))
        return out


def test_rollout_plays_parsed_actions_and_charges_malformed_ones(tok):
    from envs.sandbox import SandboxPool
    from envs.tabular import load_tasks

    agent = make_agent(
        "chat", tok, history_turns=2, max_prompt_tokens=1024, env_name="tabular", max_steps=4
    )
    policy = ScriptedChatPolicy(tok)
    tasks = load_tasks(None, "train", instance="generic", copies=2)  # 3 actions, horizon 3.
    env = {"max_steps": 4, "invalid_action_penalty": 0.25, "instance": "generic"}
    with SandboxPool("tabular", env, backend="inprocess") as pool:
        forest = play_forest(
            pool, policy, agent, tasks, TreeSpec(root_group=2), rng=jax.random.key(0)
        )
    paths = forest.paths()
    assert len(paths) == 4
    for path in paths:
        first, *rest = path.steps
        assert len(path.steps) == 4 and not path.truncated  # The leaf, at step 4.
        # The malformed first answer is no action: invalid, charged the format penalty.
        assert first.action_text is None and first.invalid and first.reward == -0.25
        assert rest and all(not s.invalid and s.action_text == "a2" for s in rest)
        for s in path.steps:  # Every prompt is the agent's chat rendering.
            assert tok.decode(s.prompt_ids, skip_special=False).startswith("<|im_start|>system")
    second = tok.decode(paths[0].steps[1].prompt_ids)
    assert "[Action 1] (no valid action)" in second and "Admissible actions:\na0\na1\na2" in second


# Configs ----------------------------------------------------------------------------------------


def _config(name, arg):
    return load_experiment(ROOT / "experiments" / f"{name}.py").get_config(arg)


@pytest.mark.parametrize("name,steps,prompt", [("alfworld", 50, 2048), ("webshop", 15, 4096)])
def test_full_settings_use_chat_with_the_verl_agent_lengths(name, steps, prompt):
    cfg = _config(name, "")
    cfg.model.hf_checkpoint = "/path/to/Qwen2.5-7B-Instruct"
    v = validate(cfg)
    assert (v.agent.format, v.agent.history_turns, v.agent.max_action_tokens) == ("chat", 2, 512)
    assert (v.env.max_steps, v.agent.max_prompt_tokens, v.bc.steps) == (steps, prompt, 0)
    assert validate(_config(name, "cpu")).agent.format == "tiny"


def test_config_refuses_chat_without_a_template_source_or_with_cloning():
    cfg = _config("alfworld", "cpu")
    cfg.agent.format = "chat"
    with pytest.raises(ValueError, match="agent.format='chat' renders prompts"):
        validate(cfg)
    cfg.model.hf_checkpoint = "/path/to/instruct"
    with pytest.raises(ValueError, match="config.bc.steps must be 0 with agent.format='chat'"):
        validate(cfg)
    cfg.bc.steps = 0
    assert validate(cfg).agent.format == "chat"
    cfg.agent.format = "xml"
    with pytest.raises(ValueError, match="config.agent.format must be one of"):
        validate(cfg)


# Two RL iterations of the full-setting agent ------------------------------------------------------


@pytest.mark.slow
def test_chat_agent_trains_a_random_qwen2_for_two_iterations(tmp_path):
    """The full setting's agent (chat format, verl-agent's history) on a randomly initialised
    Qwen2 checkpoint of the tiny preset: ALFWorld, GRPO, two iterations, on the CPU."""
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    ckpt = write_chat_checkpoint(tmp_path / "qwen2_tiny", weights=True)
    cfg = _config("alfworld", "cpu")
    cfg.train.algo = "grpo"  # One update per iteration at this size (BPO's trees make more).
    cfg.agent.format = "chat"
    cfg.agent.history_turns = 2
    cfg.agent.max_prompt_tokens = 1536
    cfg.agent.max_action_tokens = 32
    cfg.model.hf_checkpoint = str(ckpt)
    cfg.model.max_seq_len = 2048
    cfg.bc.steps = 0
    cfg.env.num_train_tasks = 2
    cfg.env.max_steps = 3
    cfg.env.invalid_action_penalty = 0.1
    cfg.eval.num_tasks = 2
    cfg.train.iterations = 2
    cfg.train.tasks_per_iter = 1
    cfg.train.group_size = 2
    cfg.train.minibatch_size = 8
    summary = train_and_evaluate(cfg, tmp_path / "run")
    assert summary["iterations"] == 2 and summary["rl_updates"] == 2
    assert not (tmp_path / "run" / "tokenizer.model").exists()  # The checkpoint's tokenizer.
    evals = json.loads((tmp_path / "run" / "evals.json").read_text())
    # A random model never closes an <action> tag: every answer is malformed, charged the
    # format penalty (the tiny parser would have played the text, at no cost).
    for name in ("initial", "before_rl", "after_rl"):
        assert evals[name]["eval/invalid_frac"] == 1.0
        assert evals[name]["eval/return"] == pytest.approx(-0.1 * 3)
    records = read_metrics(tmp_path / "run")
    iters = [r for r in records if "train/iteration" in r]
    assert [r["train/iteration"] for r in iters] == [1, 2]
    assert all(r["compute/generated_tokens"] > 0 for r in iters)
    assert all(np.isfinite(r["update/grad_norm"]) for r in records if "update/grad_norm" in r)
