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

from envs.alfworld.memory import TextMemory, item_class, parse_goal

__all__ = ["SUPPORTED_TASK_TYPES", "SearchExpert", "parse_goal"]

SUPPORTED_TASK_TYPES = ("look_at_obj_in_light", "pick_and_place_simple")


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
        self.memory = TextMemory(first_observation, goal)
        self.goal = self.memory.goal
        self.receptacles = self.memory.receptacles  # In the order the room lists them.
        self.max_actions = max_actions
        self.actions: list[str] = []

    def act(self) -> str | None:
        """The next action, or None when the goal is unknown or nothing is left to try."""
        m = self.memory
        if self.goal is None or m.finished or len(self.actions) >= self.max_actions:
            return None
        for action in self._candidates():
            if action not in m.failed:
                self.actions.append(action)
                return action
        return None

    def observe(self, observation: str) -> None:
        """Reads the text that the last action (`self.actions[-1]`) produced."""
        self.memory.update(self.actions[-1] if self.actions else None, observation)

    # The rules, as candidate actions in order of preference -------------------------------

    def _candidates(self):
        kind, obj, other = self.goal
        holding = self.memory.holding
        if holding is None or item_class(holding) != obj:
            yield from self._fetch(obj, skip_class=other if kind == "place" else None)
        elif kind == "look":
            yield from self._go_and(other, lambda lamp: f"use {lamp}")
        else:
            yield from self._put(other)

    def _fetch(self, obj: str, skip_class: str | None):
        for r, o in self.memory.known(obj):
            if r == self.memory.location:
                yield f"take {o} from {r}"
            else:
                yield f"go to {r}"
        # The goal's own receptacle class cannot already hold the object (the game would be won).
        yield from self._explore(skip_class)

    def _go_and(self, cls: str, use):
        for r, o in self.memory.known(cls):
            yield use(o) if r == self.memory.location else f"go to {r}"
        yield from self._explore(None)

    def _put(self, cls: str):
        m = self.memory
        targets = [r for r in self.receptacles if item_class(r) == cls]
        if m.location in targets:
            if m.location in m.closed:
                yield f"open {m.location}"
            elif m.location not in m.seen:
                yield f"examine {m.location}"
            yield f"move {m.holding} to {m.location}"
        for r in targets:
            if r != m.location:
                yield f"go to {r}"

    def _explore(self, skip_class: str | None):
        """Looks into the receptacle here, else goes to the next one not visited yet."""
        m = self.memory
        if m.location in m.closed:
            yield f"open {m.location}"
        elif m.location is not None and m.location not in m.seen:
            yield f"examine {m.location}"  # Reached without a description (a shared spot).
        for r in self.receptacles:
            if r not in m.visited and item_class(r) != skip_class:
                yield f"go to {r}"
