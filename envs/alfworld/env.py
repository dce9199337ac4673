"""ALFWorld's text household games as an `Environment`.

Games are played offline with textworld's PDDL backend and alfworld's wrappers (which give objects
their readable names, e.g. "desk 1"). textworld and alfworld are imported on the first `reset`,
not at module import: they take about a second to import, and importing alfworld sets
`$ALFWORLD_DATA` (to `~/.cache/alfworld` if unset) and creates that folder.

All game state lives inside the `AlfworldEnv` object, so a process can be forked with an env in it.
The live game cannot be pickled or copied; build an env per worker instead.
"""

from __future__ import annotations

import re
from typing import Any

from envs.alfworld.data import AlfworldTask
from envs.base import StepResult, check_can_step, register_env

__all__ = ["NOTHING_HAPPENS", "AlfworldEnv", "normalize_action"]

# The game's own reply to a command it cannot execute; reused for actions never sent to the game,
# so that the agent sees one consistent message for every kind of invalid action.
NOTHING_HAPPENS = "Nothing happens."

_BANNER_RE = re.compile(r"^\s*-=.*?=-\s*")
_GOAL_RE = re.compile(r"^Your task is to:.*$", re.MULTILINE)
_WHITESPACE_RE = re.compile(r"\s+")


def normalize_action(action: str | None) -> str:
    """Puts an action into the form the game's admissible commands use.

    Language models write "Go to desk 1." as readily as "go to desk 1"; both should count.

    Args:
        action: Raw action text, or None.

    Returns:
        The action stripped, lowercased, with whitespace runs collapsed to one space and trailing
        periods dropped; "" for None.
    """
    if action is None:
        return ""
    return _WHITESPACE_RE.sub(" ", action).strip().lower().rstrip(".").rstrip()


@register_env("alfworld")
class AlfworldEnv:
    """One ALFWorld game at a time, behind the `envs.base.Environment` protocol.

    Rewards: 1.0 on the step that wins, `-invalid_action_penalty` for an invalid action, else 0.
    An action is invalid if it is None, empty after normalisation, or not among the current
    admissible commands. Invalid non-empty actions are still sent to the game, which answers with
    its own message ("Nothing happens." in practice); empty ones get that message directly.

    Info keys (from `reset` and every `step`): `won`, `truncated`, `steps` (actions taken so far),
    `invalid` (this action was invalid), `admissible_commands` (list of valid next actions), and
    `action` (the normalised action played, None at reset). `reset` adds `goal`, `task_type` and
    `task_id`.

    Example:
        env = AlfworldEnv(max_steps=50)
        observation, info = env.reset(task)
        for action in task.walkthrough:
            observation, reward, done, info = env.step(action)
        env.close()
    """

    def __init__(self, max_steps: int = 50, invalid_action_penalty: float = 0.1):
        """Creates the env; the game engine itself starts on the first `reset`.

        Args:
            max_steps: Episode length limit; the step that reaches it ends the episode with
                `info['truncated'] = True` (unless it also wins).
            invalid_action_penalty: Non-negative amount subtracted from the reward of an invalid
                action.

        Raises:
            ValueError: If an argument is out of range.
        """
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}.")
        if not invalid_action_penalty >= 0:
            raise ValueError(
                f"invalid_action_penalty must be >= 0 (it is subtracted), got "
                f"{invalid_action_penalty!r}."
            )
        self.max_steps = max_steps
        self.invalid_action_penalty = float(invalid_action_penalty)

        self._game: Any = None  # The wrapped textworld env; None until the first reset.
        self._game_file: str | None = None  # The game file `_game` has loaded.
        self._task: AlfworldTask | None = None
        self._admissible: list[str] = []
        self._steps = 0
        self._done = True  # No episode running until reset.

    @property
    def task(self) -> AlfworldTask | None:
        """The task of the current (or last) episode."""
        return self._task

    def reset(self, task: AlfworldTask) -> tuple[str, dict[str, Any]]:
        """Starts a new episode of `task`.

        Resetting the same game again is cheaper than switching games (no reload).

        Args:
            task: The game to play, from `load_tasks`.

        Returns:
            The first observation (without textworld's welcome banner; it ends with the goal
            sentence) and the info dict.

        Raises:
            TypeError: If `task` is not an `AlfworldTask`.
            RuntimeError: If the game has no "Your task is to: ..." sentence.
        """
        if not isinstance(task, AlfworldTask):
            raise TypeError(
                f"AlfworldEnv.reset expects an AlfworldTask (from envs.alfworld.load_tasks), got "
                f"{type(task).__name__}: {task!r}."
            )
        # Until the new game is up, no episode is running and no game is known to be loaded, so
        # that a failed load cannot leave the env half in the old game.
        self._done = True
        if self._game is None:
            self._game = _start_game(task.game_file)
        elif self._game_file != task.game_file:
            self._game_file = None
            self._game.load(task.game_file)
        self._game_file = task.game_file
        state = self._game.reset()

        self._task = task
        self._steps = 0
        self._done = False
        self._admissible = list(state["admissible_commands"])
        observation = _BANNER_RE.sub("", state.feedback).strip()
        goal = _GOAL_RE.search(observation)
        if goal is None:
            raise RuntimeError(
                f"Game {task.game_file!r} ({task.task_id}) has no 'Your task is to: ...' sentence "
                f"in its first observation: {observation!r}. The game file may be corrupt; "
                "re-download the data or drop this task."
            )
        info = self._info(won=bool(state["won"]), truncated=False, invalid=False, action=None)
        info.update(goal=goal.group(0).strip(), task_type=task.task_type, task_id=task.task_id)
        return observation, info

    def step(self, action: str | None) -> StepResult:
        """Plays one action; see the class docstring for rewards and info.

        Args:
            action: The agent's action, or None if none could be parsed from its output.

        Returns:
            The step's result. `done` is True on a win or when `max_steps` is reached.

        Raises:
            RuntimeError: If called before `reset` or after the episode ended.
        """
        check_can_step(self, self._game is not None, self._done, self._task, self._steps)

        command = normalize_action(action)
        game_over = won = False
        if not command:
            invalid = True
            observation = NOTHING_HAPPENS
        else:
            invalid = command not in self._admissible
            state, _, game_over = self._game.step(command)
            observation = state.feedback.strip()
            won = bool(state["won"])
            self._admissible = list(state["admissible_commands"])

        self._steps += 1
        game_over = bool(game_over) or won
        truncated = not game_over and self._steps >= self.max_steps
        self._done = game_over or truncated
        if won:
            reward = 1.0
        elif invalid:
            reward = -self.invalid_action_penalty
        else:
            reward = 0.0
        info = self._info(won=won, truncated=truncated, invalid=invalid, action=command or None)
        return StepResult(observation, reward, self._done, info)

    def close(self) -> None:
        """Releases the game engine. A later `reset` starts a fresh one."""
        if self._game is not None:
            self._game.close()
        self._game = None
        self._game_file = None
        self._done = True

    def __enter__(self) -> AlfworldEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Without this, pickling fails deep inside textworld with an unhelpful message.
        raise TypeError(
            "AlfworldEnv holds a live textworld game and cannot be pickled or copied; create one "
            "env per worker with make_env('alfworld', ...) or fork the process that holds it."
        )

    def _info(self, *, won: bool, truncated: bool, invalid: bool, action: str | None) -> dict:
        return {
            "won": won,
            "truncated": truncated,
            "steps": self._steps,
            "invalid": invalid,
            "admissible_commands": list(self._admissible),
            "action": action,
        }


def _start_game(game_file: str) -> Any:
    """Starts textworld on `game_file` with alfworld's naming and info wrappers."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    request_infos = textworld.EnvInfos(
        won=True, admissible_commands=True, feedback=True, extras=["gamefile"]
    )
    return textworld.start(
        game_file, request_infos=request_infos, wrappers=[AlfredDemangler(), AlfredInfos]
    )
