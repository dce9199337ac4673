"""What an ALFWorld agent knows from the text it has read, and the notes the tiny agent keeps.

`TextMemory` reads an episode's texts, action by action: where the agent is, what it holds,
which receptacles it has visited or found closed, what each receptacle showed the last time it
was looked at, which commands did nothing. The searching demonstrator (`search_expert.py`)
decides from it; `notes` renders it for the tiny turn format (`agent.notes`).

Why notes: the tiny agent's prompt keeps the last `history_turns` turns. A searching policy has
to know which receptacles it has already visited and where it saw the objects of its goal;
with two turns of history that is gone after two moves, and a policy cloned from the searching
demonstrator oscillates between receptacles (docs/start_policy.md). The notes are the agent's
own summary of its history h_t, a deterministic function of the texts it has seen (the same
texts give the same notes; nothing of the game's hidden state enters), like a scratchpad an
agent keeps:

    at drawer 1 ; holding nothing ; seen: keychain 2 in drawer 1 ; to visit: drawer 2, shelf 1

`seen` lists the objects of the goal's classes (the object's, then the lamp's of a look-at
goal), each class's at the current receptacle first, then in the order the room lists the
receptacles; `to visit`
lists the receptacles not visited yet, in the room's order.
"""

from __future__ import annotations

import re

__all__ = ["NOTHING", "TextMemory", "item_class", "items", "notes", "parse_goal"]

# The four goal sentences of the two task types the notes and the demonstrator know.
_GOALS = (
    (re.compile(r"look at (\w+) under the (\w+)"), "look"),
    (re.compile(r"examine the (\w+) with the (\w+)"), "look"),
    (re.compile(r"put (?:a|an|some) (\w+) (?:in|on) (\w+)"), "place"),
)
_ITEM_RE = re.compile(r"\ban? ([a-z]+ \d+)")  # "a desk 1", "an apple 2" -> "desk 1"
_ARRIVE_RE = re.compile(r"You arrive at ([a-z]+ \d+)\.")
_OPEN_RE = re.compile(r"You open the ([a-z]+ \d+)\.")
_CLOSED_RE = re.compile(r"The ([a-z]+ \d+) is closed\.")
# The sentence that lists a receptacle's contents (on arriving, opening or examining it).
_CONTENTS_RE = re.compile(r"On the ([a-z]+ \d+), you see|The ([a-z]+ \d+) is open\. In it, you see")
_SEE_RE = re.compile(r"you see (.*?)\.(?:\s|$)", re.DOTALL)
_PICK_RE = re.compile(r"You pick up the ([a-z]+ \d+) from the ([a-z]+ \d+)\.")
_MOVE_RE = re.compile(r"You move the ([a-z]+ \d+) to the ([a-z]+ \d+)\.")
_TURN_ON_RE = re.compile(r"You turn on the ([a-z]+ \d+)\.")
NOTHING = "Nothing happens."


def parse_goal(goal: str) -> tuple[str, str, str] | None:
    """(kind, object class, lamp or receptacle class) of a goal sentence, or None.

    `kind` is "look" (look at the object under a lamp) or "place" (put it in a receptacle).
    """
    text = goal.split("Your task is to:")[-1].strip().lower()
    for pattern, kind in _GOALS:
        m = pattern.search(text)
        if m:
            return kind, m.group(1), m.group(2)
    return None


def item_class(name: str) -> str:
    return name.rsplit(" ", 1)[0]  # "desk 1" -> "desk"


def items(text: str) -> list[str]:
    """The names in a "you see a x 1, a y 2, and a z 3." sentence, in order ([] for nothing)."""
    m = _SEE_RE.search(text)
    return _ITEM_RE.findall(m.group(1)) if m else []


class TextMemory:
    """The state an agent can read off the texts of one episode (see the module docstring).

    Args:
      first_observation: The game's first observation (the room and its receptacles; a goal
        sentence in it is ignored).
      goal: The goal sentence.
    """

    def __init__(self, first_observation: str, goal: str | None):
        room = first_observation.split("Your task is to:")[0]
        self.goal = parse_goal(goal if goal is not None else first_observation)
        self.receptacles = list(dict.fromkeys(items(room)))  # In the order the room lists them.
        self.location: str | None = None
        self.seen: dict[str, list[str]] = {}  # Receptacle -> what its last observation showed.
        self.visited: set[str] = set()
        self.closed: set[str] = set()
        self.holding: str | None = None
        self.failed: set[str] = set()  # Commands the game answered with "Nothing happens.".
        self.finished = False  # The goal's last action succeeded (the game is won).

    def update(self, action: str | None, observation: str) -> None:
        """Reads the text that `action` produced."""
        if observation.strip() == NOTHING:
            target = action[len("go to ") :] if action and action.startswith("go to ") else None
            if target is not None and target in self.receptacles:
                # Receptacles that share a spot (drawers stacked in one cabinet) cannot be gone
                # to from each other: the game says nothing happens, and the agent is there.
                self.location = target
                self.visited.add(target)
            elif action is not None:
                self.failed.add(action)  # A receptacle the room lacks, or any other no-op.
            return
        if m := _ARRIVE_RE.search(observation):
            self.location = m.group(1)
            self.visited.add(self.location)
        if m := _OPEN_RE.search(observation):
            self.closed.discard(m.group(1))
        if m := _CLOSED_RE.search(observation):
            self.closed.add(m.group(1))
        if m := _CONTENTS_RE.search(observation):
            self.seen[m.group(1) or m.group(2)] = items(observation)
        if m := _PICK_RE.search(observation):
            self.holding = m.group(1)
            self.seen[m.group(2)] = [o for o in self.seen.get(m.group(2), []) if o != self.holding]
        if m := _MOVE_RE.search(observation):
            self.holding = None
            self.seen.setdefault(m.group(2), []).append(m.group(1))
            self.finished = self.goal is not None and (
                item_class(m.group(1)) == self.goal[1] and item_class(m.group(2)) == self.goal[2]
            )
        if _TURN_ON_RE.search(observation) and self.holding is not None:
            self.finished = self.goal is not None and item_class(self.holding) == self.goal[1]

    def known(self, cls: str) -> list[tuple[str, str]]:
        """(receptacle, item) for every item of class `cls` seen, the current place first."""
        here_items = self.seen.get(self.location, [])
        here = [(self.location, o) for o in here_items if item_class(o) == cls]
        there = [
            (r, o)
            for r in self.receptacles
            if r != self.location
            for o in self.seen.get(r, [])
            if item_class(o) == cls
        ]
        return here + there

    def render(self) -> str:
        """The notes (module docstring); without a known goal, only place, hands and plan."""
        classes = []
        if self.goal is not None:
            kind, obj, other = self.goal
            classes = [obj, other] if kind == "look" else [obj]
        seen = [f"{o} in {r}" for cls in classes for r, o in self.known(cls)]
        to_visit = [r for r in self.receptacles if r not in self.visited]
        return (
            f"at {self.location or 'the start'} ; holding {self.holding or 'nothing'} ; "
            f"seen: {', '.join(seen) or 'none'} ; to visit: {', '.join(to_visit) or 'none'}"
        )


def notes(ep) -> str:
    """The notes after an episode's turns: its texts replayed in order.

    `ep` is a `bpo_jax.agent.EpisodeText` (goal, room, turns, current): `turns` are
    (observation, action) pairs, the first observation "" (it is `room`); the text action i
    produced is turn i + 1's observation, or `current` after the last action.
    """
    turns, current = ep.turns, ep.current
    memory = TextMemory(ep.room, ep.goal)
    for i, (_, action) in enumerate(turns):
        memory.update(action, turns[i + 1][0] if i + 1 < len(turns) else current)
    return memory.render()
