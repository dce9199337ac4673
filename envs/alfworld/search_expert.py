"""A searching demonstrator for ALFWorld that decides from what the agent sees, and nothing else.

The games' walkthroughs come from the PDDL planner, which knows where every object is: they go
straight to the receptacle that holds the target. In a new game that knowledge is not in the
observations, so a policy cloned from walkthroughs learns "go to the receptacle the planner knew
about", which it cannot reproduce on games it has not seen. `SearchExpert` plays the way an agent
that only reads the text has to: it visits the receptacles in the order the first observation
lists them, opens the closed ones, and acts on an object once an observation shows it.

Why it uses only observations: an expert is built from two strings, the first observation and
the goal sentence, and afterwards receives only the text each of its actions produced
(`observe`). It never sees the task, the game file, the PDDL problem, the game's facts or its
admissible commands (alfworld's own hand-coded expert, `alfworld.agents.expert`, reads the
game's facts, e.g. `holds agent X`, and its admissible commands, so it is not used). Two experts
given the same texts therefore choose the same actions, whatever game produced them; the tests
check exactly that. What it knows beyond the text is the game's command grammar (`go to R`,
`open R`, `take O from R`, `use L`, `move O to R`), which the agent's actions share.

Task types: `look_at_obj_in_light` (find the object, take it, find the lamp, use it) and
`pick_and_place_simple` (find the object, take it, go to a receptacle of the goal's class,
open it if closed, move the object there). Other goals get no action (`act` returns None).
"""

from __future__ import annotations

import re

__all__ = ["SUPPORTED_TASK_TYPES", "SearchExpert", "parse_goal"]

SUPPORTED_TASK_TYPES = ("look_at_obj_in_light", "pick_and_place_simple")

# The four goal sentences of the two task types (the games' `task` grammar rule).
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
_NOTHING = "Nothing happens."


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


def _class(name: str) -> str:
    return name.rsplit(" ", 1)[0]  # "desk 1" -> "desk"


def _items(text: str) -> list[str]:
    """The names in a "you see a x 1, a y 2, and a z 3." sentence, in order ([] for nothing)."""
    m = _SEE_RE.search(text)
    return _ITEM_RE.findall(m.group(1)) if m else []


class SearchExpert:
    """Chooses each action from the goal and the observations so far (see the module docstring).

    Example:
        expert = SearchExpert(first_observation, goal)
        while (action := expert.act()) is not None:
            observation, reward, done, info = play(action)
            expert.observe(observation)
            if done:
                break
    """

    task_types = SUPPORTED_TASK_TYPES  # The goals it knows (what `bc.demos='search'` checks).

    def __init__(self, first_observation: str, goal: str | None = None, max_actions: int = 200):
        """Args:
        first_observation: The game's first observation (the room and its receptacles).
        goal: The "Your task is to: ..." sentence; None reads it from `first_observation`.
        max_actions: `act` returns None after this many actions (a guard, never reached by
            the rules below on a finite room: each action visits, opens or acts once).
        """
        room = first_observation.split("Your task is to:")[0]
        self.goal = parse_goal(goal if goal is not None else first_observation)
        self.receptacles = list(dict.fromkeys(_items(room)))  # In the order the room lists them.
        self.max_actions = max_actions
        self.location: str | None = None
        self.seen: dict[str, list[str]] = {}  # Receptacle -> what its last observation showed.
        self.visited: set[str] = set()
        self.closed: set[str] = set()
        self.holding: str | None = None
        self.failed: set[str] = set()  # Actions the game answered with "Nothing happens.".
        self.actions: list[str] = []
        self.finished = False  # The goal's last action succeeded (the game is won).

    def act(self) -> str | None:
        """The next action, or None when the goal is unknown or nothing is left to try."""
        if self.goal is None or self.finished or len(self.actions) >= self.max_actions:
            return None
        for action in self._candidates():
            if action not in self.failed:
                self.actions.append(action)
                return action
        return None

    def observe(self, observation: str) -> None:
        """Reads the text that the last action (`self.actions[-1]`) produced."""
        last = self.actions[-1] if self.actions else None
        if observation.strip() == _NOTHING:
            if last is not None and last.startswith("go to "):
                # Receptacles that share a spot (drawers stacked in one cabinet) cannot be gone
                # to from each other: the game says nothing happens, so the agent is there.
                self.location = last[len("go to ") :]
                self.visited.add(self.location)
            elif last is not None:
                self.failed.add(last)
            return
        if m := _ARRIVE_RE.search(observation):
            self.location = m.group(1)
            self.visited.add(self.location)
        if m := _OPEN_RE.search(observation):
            self.closed.discard(m.group(1))
        if m := _CLOSED_RE.search(observation):
            self.closed.add(m.group(1))
        if m := _CONTENTS_RE.search(observation):
            self.seen[m.group(1) or m.group(2)] = _items(observation)
        if m := _PICK_RE.search(observation):
            self.holding = m.group(1)
            self.seen[m.group(2)] = [o for o in self.seen.get(m.group(2), []) if o != self.holding]
        if m := _MOVE_RE.search(observation):
            self.holding = None
            self.seen.setdefault(m.group(2), []).append(m.group(1))
            self.finished = (
                _class(m.group(1)) == self.goal[1] and _class(m.group(2)) == self.goal[2]
            )
        if _TURN_ON_RE.search(observation) and self.holding is not None:
            self.finished = _class(self.holding) == self.goal[1]

    # The rules, as candidate actions in order of preference -------------------------------

    def _candidates(self):
        kind, obj, other = self.goal
        if self.holding is None or _class(self.holding) != obj:
            yield from self._fetch(obj, skip_class=other if kind == "place" else None)
        elif kind == "look":
            yield from self._go_and(other, lambda lamp: f"use {lamp}")
        else:
            yield from self._put(other)

    def _known(self, cls: str) -> list[tuple[str, str]]:
        """(receptacle, item) for every item of class `cls` seen, the current place first."""
        here = [(self.location, o) for o in self.seen.get(self.location, []) if _class(o) == cls]
        there = [
            (r, o)
            for r in self.receptacles
            if r != self.location
            for o in self.seen.get(r, [])
            if _class(o) == cls
        ]
        return here + there

    def _fetch(self, obj: str, skip_class: str | None):
        for r, o in self._known(obj):
            if r == self.location:
                yield f"take {o} from {r}"
            else:
                yield f"go to {r}"
        # The goal's own receptacle class cannot already hold the object (the game would be won).
        yield from self._explore(skip_class)

    def _go_and(self, cls: str, use):
        for r, o in self._known(cls):
            yield use(o) if r == self.location else f"go to {r}"
        yield from self._explore(None)

    def _put(self, cls: str):
        targets = [r for r in self.receptacles if _class(r) == cls]
        if self.location in targets:
            if self.location in self.closed:
                yield f"open {self.location}"
            elif self.location not in self.seen:
                yield f"examine {self.location}"
            yield f"move {self.holding} to {self.location}"
        for r in targets:
            if r != self.location:
                yield f"go to {r}"

    def _explore(self, skip_class: str | None):
        """Looks into the receptacle here, else goes to the next one not visited yet."""
        if self.location in self.closed:
            yield f"open {self.location}"
        elif self.location is not None and self.location not in self.seen:
            yield f"examine {self.location}"  # Reached without a description (a shared spot).
        for r in self.receptacles:
            if r not in self.visited and _class(r) != skip_class:
                yield f"go to {r}"
