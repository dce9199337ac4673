"""ALFWorld's text household games as a gymnasium env (`bpo_jax/ALFWorld-v0`, "alfworld").

Games are played offline with textworld's PDDL backend and alfworld's wrappers (which give objects
their readable names, e.g. "desk 1"). textworld and alfworld are imported on the first `reset`,
not at module import: they take about a second to import, and importing alfworld sets
`$ALFWORLD_DATA` (to `~/.cache/alfworld` if unset) and creates that folder. Sandbox workers
import them ahead (`preload_modules`), so that every fork starts with them.

All game state lives inside the `AlfworldEnv` object, so a process can be forked with an env in it.
The live game cannot be pickled or copied; build an env per worker instead.
"""

from __future__ import annotations

import re
from typing import Any

from envs.alfworld.data import AlfworldTask, load_tasks
from envs.base import TextEnv

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


class AlfworldEnv(TextEnv):
    """One ALFWorld game at a time.

    Rewards: 1.0 on the step that wins, `-invalid_action_penalty` for an invalid action, else 0.
    An action is invalid if it is None, empty after normalisation, or not among the current
    admissible commands. Invalid non-empty actions are still sent to the game, which answers with
    its own message ("Nothing happens." in practice); empty ones get that message directly.

    Info keys besides the common ones (`envs.base`): `admissible_commands` (list of valid next
    actions) and `action` (the normalised action played, None at reset). `reset` adds `goal`,
    `task_type` and `task_id`. `reset()` without a task draws one of the `valid_unseen` games
    (data root from `$ALFWORLD_DATA`).

    Example:
        env = AlfworldEnv(max_steps=50)
        observation, info = env.reset(options={"task": task})
        for action in task.walkthrough:
            observation, reward, terminated, truncated, info = env.step(action)
        env.close()
    """

    task_class = AlfworldTask
    load_tasks = staticmethod(load_tasks)  # (data_root, split, task_types, **options)
    default_split = "valid_unseen"
    preload_modules = ("textworld", "alfworld.agents.environment.alfred_tw_env")

    def __init__(self, max_steps: int = 50, invalid_action_penalty: float = 0.1, tasks=None):
        """Creates the env; the game engine itself starts on the first `reset`.

        Args:
            max_steps: Episode length limit; the step that reaches it ends the episode with
                `truncated` (unless it also wins).
            invalid_action_penalty: Non-negative amount subtracted from the reward of an invalid
                action.
            tasks: What `reset()` without a task draws from (default: `valid_unseen`).

        Raises:
            ValueError: If an argument is out of range.
        """
        super().__init__(max_steps, invalid_action_penalty, tasks)
        self._game: Any = None  # The wrapped textworld env; None until the first reset.
        self._game_file: str | None = None  # The game file `_game` has loaded.
        self._admissible: list[str] = []

    def _start(self, task: AlfworldTask) -> tuple[str, dict[str, Any]]:
        # Resetting the same game again is cheaper than switching games (no reload). Until the
        # new game is up no game is known to be loaded, so a failed load cannot leave the env
        # half in the old one.
        if self._game is None:
            self._game = _start_game(task.game_file)
        elif self._game_file != task.game_file:
            self._game_file = None
            self._game.load(task.game_file)
        self._game_file = task.game_file
        state = self._game.reset()
        self._admissible = list(state["admissible_commands"])
        observation = _BANNER_RE.sub("", state.feedback).strip()
        goal = _GOAL_RE.search(observation)
        if goal is None:
            raise RuntimeError(
                f"Game {task.game_file!r} ({task.task_id}) has no 'Your task is to: ...' sentence "
                f"in its first observation: {observation!r}. The game file may be corrupt; "
                "re-download the data or drop this task."
            )
        info = self._info(won=bool(state["won"]), invalid=False, action=None)
        info.update(goal=goal.group(0).strip(), task_type=task.task_type, task_id=task.task_id)
        return observation, info

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
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
        if won:
            reward = 1.0
        elif invalid:
            reward = -self.invalid_action_penalty
        else:
            reward = 0.0
        info = self._info(won=won, invalid=invalid, action=command or None)
        return observation, reward, bool(game_over) or won, info

    def _close(self) -> None:
        """Releases the game engine. A later `reset` starts a fresh one."""
        if self._game is not None:
            self._game.close()
        self._game = None
        self._game_file = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Without this, pickling fails deep inside textworld with an unhelpful message.
        raise TypeError(
            "AlfworldEnv holds a live textworld game and cannot be pickled or copied; create one "
            "env per worker with make_env('alfworld', ...) or fork the process that holds it."
        )

    def _info(self, *, won: bool, invalid: bool, action: str | None) -> dict:
        return {
            "won": won,
            "invalid_action": invalid,
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
