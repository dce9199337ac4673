"""Behaviour cloning's recovery examples (`bc.recovery`): commands the game cannot execute, on
written rooms and in a real ALFWorld game, and the examples `bc_examples` builds from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bpo_jax.agent import SPECIAL_SYMBOLS
from bpo_jax.agent.demos import bc_examples, corpus, inadmissible_turn_fn
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment
from envs.alfworld.inadmissible import REPLY, inadmissible_turn, room_receptacles

ROOT = Path(__file__).resolve().parents[1]
ROOM = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 2, a "
    "cabinet 1, a desk 1, a drawer 3, a drawer 2, a drawer 1, and a garbagecan 1."
)


def test_room_receptacles_reads_the_highest_number_of_each_class():
    assert room_receptacles(ROOM) == {"cabinet": 2, "desk": 1, "drawer": 3, "garbagecan": 1}
    assert room_receptacles("You see nothing.") == {}


def test_inadmissible_commands_never_name_a_receptacle_of_the_room():
    rng = np.random.default_rng(0)
    present = room_receptacles(ROOM)
    commands = [inadmissible_turn(ROOM, rng) for _ in range(500)]
    assert all(reply == REPLY for _, reply in commands)
    kinds = set()
    for command, _ in commands:
        cls, number = command.split()[-2], int(command.split()[-1])
        assert number > present.get(cls, 0), command  # Past the room's last, or a new class.
        kinds.add((cls in present, command.split()[0]))
    # Both kinds (a number too high, a missing class) and every verb occur.
    assert {k for k, _ in kinds} == {True, False}
    assert {v for _, v in kinds} == {"go", "open", "examine", "close"}


def test_inadmissible_commands_change_nothing_in_a_real_game():
    """In a real game each command gets the reply, and the walkthrough's first action after
    eight of them gives exactly what it gives in an untouched copy of the game."""
    from envs.alfworld import load_tasks
    from envs.sandbox import SandboxPool

    task = load_tasks(None, "train", ["pick_and_place_simple"])[0]
    rng = np.random.default_rng(1)
    with SandboxPool(
        "alfworld", {"max_steps": 60, "strip_welcome": True}, backend="fork", num_workers=1
    ) as pool:
        ((sid, first_obs, _),) = pool.reset_many([task])
        (clean,) = pool.clone(sid, 1)
        for _ in range(8):
            command, reply = inadmissible_turn(first_obs, rng)
            (res,) = pool.step_many([(sid, command)])
            assert res.observation.strip() == reply, (command, res.observation)
            assert not res.done
        first = task.walkthrough[0]
        detoured, untouched = pool.step_many([(sid, first), (clean, first)])
    assert detoured.observation == untouched.observation
    assert detoured.observation.strip() != REPLY


def _demo():
    return {
        "task_id": "t",
        "first_obs": ROOM,
        "goal": "Your task is to: put a pen in desk.",
        "actions": ["go to cabinet 2", "open cabinet 2", "go to cabinet 1"],
        "observations": [
            "You arrive at cabinet 2. The cabinet 2 is closed.",
            "You open the cabinet 2. The cabinet 2 is open. In it, you see nothing.",
            "You arrive at cabinet 1. On the cabinet 1, you see a pen 1.",
        ],
        "won": True,
    }


def test_recovery_examples_keep_the_experts_label_after_the_detour(tmp_path):
    from bpo_jax.tokenizer import train_sentencepiece

    texts = corpus([_demo()] * 4, 2) + ["go to open close examine drawer 9 sofa 2 " + REPLY] * 4
    tok = train_sentencepiece(texts, tmp_path / "tok", 400, SPECIAL_SYMBOLS)
    demos = [_demo(), {**_demo(), "task_id": "lost", "won": False}]
    plain = bc_examples(demos, tok, 2, 400)
    assert len(plain) == 3  # The lost demo is not cloned.
    with pytest.raises(ValueError, match="needs wrong_turn"):
        bc_examples(demos, tok, 2, 400, recovery=0.5)
    never = bc_examples(demos, tok, 2, 400, recovery=1e-9, wrong_turn=inadmissible_turn)
    assert never == plain
    every = bc_examples(demos, tok, 2, 400, recovery=0.999, wrong_turn=inadmissible_turn, seed=3)
    assert len(every) == 6
    assert every == bc_examples(
        demos, tok, 2, 400, recovery=0.999, wrong_turn=inadmissible_turn, seed=3
    )
    for i, action in enumerate(_demo()["actions"]):
        clean, detour = every[2 * i], every[2 * i + 1]
        assert clean == plain[i]
        seq, start = detour
        assert tok.decode(seq[start:-1]).strip() == action  # The expert's own label.
        prompt = tok.decode(seq[:start])
        assert prompt.endswith(f"<obs> {REPLY} <act>")  # The game's answer is the last turn.
        assert prompt.count(REPLY) in (1, 2)


def test_recovery_is_validated_and_needs_a_generator():
    def config(name, **bc):
        cfg = load_experiment(ROOT / "experiments" / f"{name}.py").get_config("cpu")
        for k, v in bc.items():
            cfg.bc[k] = v
        return cfg

    assert validate(config("alfworld")).bc.recovery == 0.0
    assert validate(config("alfworld", recovery=0.3)).bc.recovery == 0.3
    with pytest.raises(ValueError, match=r"config.bc.recovery must be in \[0, 1\)"):
        validate(config("alfworld", recovery=1.0))
    with pytest.raises(ValueError, match=r"config.bc.recovery needs a generator"):
        validate(config("webshop", recovery=0.3, steps=10))
    with pytest.raises(ValueError, match="no generator of inadmissible commands"):
        inadmissible_turn_fn("webshop")
    assert inadmissible_turn_fn("alfworld") is inadmissible_turn
