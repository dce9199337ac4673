"""The tiny agent's notes (`agent.notes`): ALFWorld's summary of the texts an episode showed,
where the prompt puts it, and the configuration's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpo_jax.agent import EpisodeText, build_prompt, encode_prompt, make_agent, parse_action
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from envs.alfworld.memory import TextMemory, notes

ROOT = Path(__file__).resolve().parents[1]
ROOM = (
    "You are in the middle of a room. Looking quickly around you, you see a bed 1, a desk 1, "
    "a drawer 1, a drawer 2, a sidetable 1, and a shelf 1.\n\n"
)
LOOK = "Your task is to: look at cd under the desklamp."
PLACE = "Your task is to: put a pen in shelf."


def episode(goal: str, turns: list[tuple[str, str]]) -> EpisodeText:
    ep = EpisodeText.start(ROOM + goal)
    for action, reply in turns:
        ep.record(action, reply)
    return ep


def test_notes_at_the_start_list_every_receptacle_in_the_rooms_order():
    assert notes(episode(LOOK, [])) == (
        "at the start ; holding nothing ; seen: none ; "
        "to visit: bed 1, desk 1, drawer 1, drawer 2, sidetable 1, shelf 1"
    )


def test_notes_follow_visits_sightings_and_hands():
    ep = episode(
        LOOK,
        [
            ("go to bed 1", "You arrive at bed 1. On the bed 1, you see a cd 1, and a pillow 1."),
            ("go to desk 1", "You arrive at desk 1. On the desk 1, you see a desklamp 1."),
        ],
    )
    # The object, then the goal's lamp, are noted (the pillow is not).
    assert notes(ep) == (
        "at desk 1 ; holding nothing ; seen: cd 1 in bed 1, desklamp 1 in desk 1 ; "
        "to visit: drawer 1, drawer 2, sidetable 1, shelf 1"
    )
    ep.record("go to bed 1", "You arrive at bed 1. On the bed 1, you see a cd 1, and a pillow 1.")
    ep.record("take cd 1 from bed 1", "You pick up the cd 1 from the bed 1.")
    assert notes(ep) == (
        "at bed 1 ; holding cd 1 ; seen: desklamp 1 in desk 1 ; "
        "to visit: drawer 1, drawer 2, sidetable 1, shelf 1"
    )


def test_a_command_that_does_nothing_changes_no_note():
    """A receptacle the room lacks stays unvisited and does not move the agent (so recovery
    examples keep their label), while a listed one reached from a shared spot does."""
    base = [("go to desk 1", "You arrive at desk 1. On the desk 1, you see a pen 1.")]
    before = notes(episode(PLACE, base))
    assert notes(episode(PLACE, base + [("go to drawer 9", "Nothing happens.")])) == before
    assert notes(episode(PLACE, base + [("open cabinet 3", "Nothing happens.")])) == before
    shared = notes(episode(PLACE, base + [("go to drawer 1", "Nothing happens.")]))
    assert shared.startswith("at drawer 1 ;") and "to visit: bed 1, drawer 2," in shared


def test_notes_are_a_function_of_the_texts_only():
    """Two episodes that showed the same texts have the same notes; an edited text (the pen not
    shown) gives other notes."""
    turns = [("go to desk 1", "You arrive at desk 1. On the desk 1, you see a pen 1.")]
    assert notes(episode(PLACE, turns)) == notes(episode(PLACE, list(turns)))
    edited = [("go to desk 1", "You arrive at desk 1. On the desk 1, you see a vase 9.")]
    assert "pen 1 in desk 1" in notes(episode(PLACE, turns))
    assert "seen: none" in notes(episode(PLACE, edited))


def test_memory_of_a_place_goal_notes_the_object_only():
    m = TextMemory(ROOM, PLACE)
    m.update("go to desk 1", "You arrive at desk 1. On the desk 1, you see a pen 1, a shelf 2.")
    assert m.known("pen") == [("desk 1", "pen 1")]
    m.update("take pen 1 from desk 1", "You pick up the pen 1 from the desk 1.")
    m.update("go to shelf 1", "You arrive at shelf 1. On the shelf 1, you see nothing.")
    m.update("move pen 1 to shelf 1", "You move the pen 1 to the shelf 1.")
    assert m.finished and m.holding is None


def test_notes_sit_before_the_current_observation_and_survive_the_budget():
    ep = episode(
        LOOK,
        [
            (f"go to drawer {i}", f"You arrive at drawer {i}. The drawer {i} is closed.")
            for i in (1, 2)
        ]
        * 3,
    )
    text = "".join(build_prompt(ep, 2, notes))
    assert text.index("</act> <notes> at drawer 2 ;") < text.rindex("<obs> You arrive at drawer 2")
    assert text.endswith("The drawer 2 is closed. <act>")

    class Chars:
        bos_id = 1

        def encode(self, s):
            return [3 + ord(c) % 200 for c in s]

    tok = Chars()
    tail = tok.encode(" <notes> " + notes(ep))
    full = encode_prompt(tok, ep, 2, 10_000, notes=notes)
    for budget in (len(full), len(full) - 80):
        ids = encode_prompt(tok, ep, 2, budget, notes=notes)
        assert len(ids) <= budget
        assert any(ids[i : i + len(tail)] == tail for i in range(len(ids)))
    # Without notes the prompt is the plain tiny format.
    assert "<notes>" not in "".join(build_prompt(ep, 2))


def test_an_echoed_notes_tag_ends_the_action():
    assert parse_action(" go to desk 1 <notes> at desk 1") == "go to desk 1"


def cpu_config():
    return load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")


def test_config_takes_notes_for_alfworld_and_refuses_them_elsewhere():
    cfg = cpu_config()
    cfg.agent.notes = True
    assert validate(cfg).agent.notes is True
    cfg = load_experiment(ROOT / "experiments" / "webshop.py").get_config("cpu")
    cfg.agent.notes = True
    with pytest.raises(ValueError, match="config.agent.notes needs .*'webshop'"):
        validate(cfg)


def test_the_chat_format_has_no_notes():
    with pytest.raises(ValueError, match="notes"):
        make_agent("chat", object(), history_turns=2, max_prompt_tokens=64, notes=notes)
