"""Commands an ALFWorld game cannot execute, for behaviour cloning's recovery examples.

A policy cloned from an expert only ever sees the expert's own states; when it makes a mistake
at test time (a receptacle that is not in the room, a number one too high) the game answers
"Nothing happens.", and the policy, which never saw that after its own command, tends to repeat
itself to the step limit. Recovery examples (`bc.recovery`, `bpo_jax.agent.demos.bc_examples`) put
one or two such turns into a demo's history and keep the expert's action as the label. That is
exact, not an approximation of the expert: a command the game cannot execute changes nothing
in the game, so the expert's action after it is the one it took.

The commands name a receptacle the room's first observation does not list (a number above the
room's highest of that class, or a class the room lacks), which ALFWorld cannot execute.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["RECEPTACLE_CLASSES", "REPLY", "inadmissible_turn", "room_receptacles"]

REPLY = "Nothing happens."  # The game's answer to a command it cannot execute.

# ALFWorld's receptacle classes (the names its rooms list).
RECEPTACLE_CLASSES = (
    "armchair", "bathtubbasin", "bed", "cabinet", "cart", "coffeemachine", "coffeetable",
    "countertop", "desk", "diningtable", "drawer", "dresser", "fridge", "garbagecan",
    "handtowelholder", "laundryhamper", "microwave", "ottoman", "safe", "shelf", "sidetable",
    "sinkbasin", "sofa", "stoveburner", "toaster", "toilet", "toiletpaperhanger", "towelholder",
    "tvstand",
)  # fmt: skip
_VERBS = ("go to", "open", "examine", "close")
_ITEM_RE = re.compile(r"\ban? ([a-z]+) (\d+)\b")


def room_receptacles(first_observation: str) -> dict[str, int]:
    """Receptacle class -> the highest number of it the room lists ("a drawer 3" -> 3)."""
    out: dict[str, int] = {}
    for cls, n in _ITEM_RE.findall(first_observation.lower()):
        out[cls] = max(out.get(cls, 0), int(n))
    return out


def inadmissible_turn(first_observation: str, rng: np.random.Generator) -> tuple[str, str]:
    """(command, the game's reply) for a command naming a receptacle the room does not have."""
    present = room_receptacles(first_observation)
    verb = _VERBS[rng.integers(len(_VERBS))]
    classes = sorted(present)
    if classes and rng.random() < 0.7:  # A number past the room's last of a class it has.
        cls = classes[rng.integers(len(classes))]
        number = present[cls] + 1 + int(rng.integers(3))
    else:  # A class the room lacks.
        absent = [c for c in RECEPTACLE_CLASSES if c not in present]
        cls = absent[rng.integers(len(absent))]
        number = 1 + int(rng.integers(3))
    return f"{verb} {cls} {number}", REPLY
