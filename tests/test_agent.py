"""The agent's turn format and action parsing."""

import pytest

from bpo_jax.agent import EpisodeText, build_prompt, encode_prompt, parse_action

FIRST = (
    "You are in the middle of a room. Looking quickly around you, you see a bed 1, a desk 1."
    "\n\nYour task is to: look at alarmclock under the desklamp."
)


class CharTokenizer:
    """One token per character; enough to check budgets exactly."""

    bos_id, eos_id, pad_id = 1, 2, 0

    def encode(self, text):
        return [3 + (ord(c) % 200) for c in text]


def test_episode_text_splits_goal_and_room():
    ep = EpisodeText.start(FIRST)
    assert ep.goal == "look at alarmclock under the desklamp."
    assert "Your task" not in ep.room and ep.room.startswith("You are in the middle")


def test_prompt_keeps_last_turns_in_order():
    ep = EpisodeText.start(FIRST)
    for i in range(4):
        ep.record(f"go to desk {i}", f"obs {i}")
    text = "".join(build_prompt(ep, history_turns=2))
    assert text.startswith("<task> look at alarmclock")
    assert "go to desk 0" not in text and "go to desk 1" not in text
    assert text.index("<act> go to desk 2 </act>") < text.index("<act> go to desk 3 </act>")
    assert text.endswith("<obs> obs 3 <act>")


def test_encode_prompt_respects_budget_and_keeps_current_observation():
    ep = EpisodeText.start(FIRST)
    for i in range(6):
        ep.record(f"go to drawer {i}", f"You arrive at drawer {i}. The drawer {i} is closed.")
    tok = CharTokenizer()
    full = encode_prompt(tok, ep, history_turns=6, max_tokens=10_000)
    for budget in (len(full), len(full) - 30, 200, 60):
        ids = encode_prompt(tok, ep, history_turns=6, max_tokens=budget)
        assert len(ids) <= budget
        assert ids[-len(tok.encode(" <act>")) :] == tok.encode(" <act>")
    # Oldest history goes first: at a medium budget the newest turn survives.
    mid = encode_prompt(tok, ep, history_turns=6, max_tokens=len(full) - 60)
    assert mid[0] == tok.bos_id
    newest = tok.encode("go to drawer 5 </act>")
    assert any(mid[i : i + len(newest)] == newest for i in range(len(mid)))


@pytest.mark.parametrize(
    "text,expected",
    [
        (" go to dresser 1", "go to dresser 1"),
        ("take apple 1 from table 1 </act> <obs> junk", "take apple 1 from table 1"),
        ("open drawer 2\nmore", "open drawer 2"),
        ("  use   desklamp 1.  ", "use desklamp 1"),
        ("", None),
        ("   ", None),
        ("</act>", None),
        ("<obs> you see", None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_encode_prompt_takes_lone_surrogates_and_nul(tmp_path):
    """A lone surrogate in an observation or an action of the history (no valid Unicode text)
    must not crash SentencePiece's encoder; it becomes U+FFFD. NUL is text to SentencePiece."""
    from bpo_jax.agent import SPECIAL_SYMBOLS
    from bpo_jax.tokenizer import train_sentencepiece

    tok = train_sentencepiece([FIRST, "go to desk 1", "You arrive at desk 1."] * 20,
                              tmp_path / "sp", 300, SPECIAL_SYMBOLS)  # fmt: skip
    with pytest.raises(RuntimeError):  # What the agent must never hand the tokenizer.
        tok.encode("desk \ud800 1")
    ep = EpisodeText.start(FIRST)
    ep.record("go to desk \udcff1", "You arrive at \ud800desk 1.\x00")
    ep.record("look\ud83d", "You see \udfff.")
    ids = encode_prompt(tok, ep, history_turns=4, max_tokens=10_000)
    text = tok.decode(ids)
    assert "go to desk \ufffd1" in text and "\ufffddesk 1.\x00" in text
    assert "<act> look\ufffd </act>" in text and text.endswith("<obs> You see \ufffd. <act>")
    # A valid surrogate pair is one character, kept as it is.
    ep.record("take \U0001f34e 1", "ok")
    assert "take \U0001f34e 1" in tok.decode(encode_prompt(tok, ep, 4, 10_000))
