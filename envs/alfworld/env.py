"""ALFWorld's text household games as a gymnasium env (`bpo_jax/ALFWorld-v0`, "alfworld").

Games are played offline with textworld's PDDL backend and alfworld's wrappers (which give objects
their readable names, e.g. "desk 1"). textworld and alfworld are imported on the first `reset`,
not at module import: they take about a second to import, and importing alfworld sets
`$ALFWORLD_DATA` (to `~/.cache/alfworld` if unset) and creates that folder. Sandbox workers
import them ahead (`preload_modules`), so that every fork starts with them.

By default the env plays and scores a game as alfworld's own `AlfredTWEnv` (0.4.2) does, the
environment verl-agent and the papers we compare with train and evaluate on: the action string
goes to the game as given (textworld strips surrounding whitespace and nothing else, so
"Go to shelf 3." is not "go to shelf 3" and gets "Nothing happens."), observations are the
game's text verbatim (the first one starts with the "-= Welcome to TextWorld, ALFRED! =-"
header), and the reward is the game's score: 1 on the step that wins, 0 on every other step,
an inadmissible command included. What the project adds is opt-in and named:
`normalize_actions` (lenient matching), `strip_welcome`, and the two penalties below.

All game state lives inside the `AlfworldEnv` object, so a process can be forked with an env in it.
The live game cannot be pickled or copied; build an env per worker instead.
"""

from __future__ import annotations

import re
from typing import Any

from envs.alfworld.data import AlfworldTask, load_tasks
from envs.base import TextEnv

__all__ = ["NOTHING_HAPPENS", "WELCOME_RE", "AlfworldEnv", "normalize_action"]

# The game's own reply to a command it cannot execute; also the reply to no action at all (None),
# which is never sent to the game.
NOTHING_HAPPENS = "Nothing happens."

# The header the game puts before the first room description ("-= Welcome to TextWorld,
# ALFRED! =-" and a blank line); removed only with `strip_welcome=True`.
WELCOME_RE = re.compile(r"^\s*-=.*?=-\s*")
_GOAL_RE = re.compile(r"^Your task is to:.*$", re.MULTILINE)
_WHITESPACE_RE = re.compile(r"\s+")


def normalize_action(action: str | None) -> str:
    """The lenient form of an action that `normalize_actions=True` sends to the game.

    Language models write "Go to desk 1." as readily as "go to desk 1"; with this option both
    name the same command. The official game accepts only the second (it strips surrounding
    whitespace and compares exactly), so this is off by default.

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
    """One ALFWorld game at a time, played and scored as alfworld's `AlfredTWEnv` does.

    Rewards: 1.0 on the step that wins, else 0.0, minus a penalty named for what it punishes:
    - `invalid_format_penalty` for no action at all (`step(None)`: the agent's output held no
      parseable action; verl-agent's 0.1 penalty is this one). Nothing is sent to the game; the
      reply is "Nothing happens.".
    - `inadmissible_action_penalty` for an action the game does not execute (not among the
      admissible commands once stripped, the game's own test; default 0, as the game scores it).
      The action is sent to the game, which answers (with "Nothing happens.").
    Both set `info["invalid_action"]`. The trainer's `invalid_action_penalty` is the format
    penalty (its config documents it as the reward of an unparseable action).

    Info keys besides the common ones (`envs.base`), upstream's names first:
    `admissible_commands` (valid next commands, sorted, as textworld lists them),
    `extra.gamefile` (the game file; upstream sets it at reset only, here on every step),
    `extra.expert_plan` (only with `expert_plan=True`: the PDDL planner's remaining plan, what
    `AlfredExpert(expert_type="planner")` gives), `action` (the string sent to the game; None for
    no action, and at reset), `invalid_format` (the action was None). `reset` adds `goal`,
    `task_type` and `task_id`. `reset()` without a task draws a `valid_seen` game (verl-agent's
    evaluation default; data root from `$ALFWORLD_DATA`).

    Example:
        env = AlfworldEnv(max_steps=50)
        observation, info = env.reset(options={"task": task})
        for action in task.walkthrough:
            observation, reward, terminated, truncated, info = env.step(action)
        env.close()
    """

    task_class = AlfworldTask
    load_tasks = staticmethod(load_tasks)  # (data_root, split, task_types, **options)
    default_split = "valid_seen"
    preload_modules = ("textworld", "alfworld.agents.environment.alfred_tw_env")

    def __init__(
        self,
        max_steps: int = 50,
        invalid_action_penalty: float | None = None,
        tasks=None,
        *,
        invalid_format_penalty: float | None = None,
        inadmissible_action_penalty: float = 0.0,
        normalize_actions: bool = False,
        strip_welcome: bool = False,
        expert_plan: bool = False,
    ):
        """Creates the env; the game engine itself starts on the first `reset`.

        Args:
            max_steps: Episode length limit; the step that reaches it ends the episode with
                `truncated` (unless it also wins). alfworld counts every step, "Nothing
                happens." included, and so does this.
            invalid_action_penalty: The trainer's name for `invalid_format_penalty` (give one
                of the two, or both equal).
            tasks: What `reset()` without a task draws from (default: `valid_seen`).
            invalid_format_penalty: Non-negative amount subtracted for `step(None)` (default 0).
            inadmissible_action_penalty: Non-negative amount subtracted for an action the game
                does not execute (default 0, the game's score).
            normalize_actions: Send `normalize_action(action)` instead of the action itself
                (the project's lenient matching; changes what counts as a valid command).
            strip_welcome: Drop the welcome header from the first observation.
            expert_plan: Put the planner's remaining plan in `info["extra.expert_plan"]` (asks
                the PDDL planner at every step: about 0.1 s each).

        Raises:
            ValueError: If an argument is out of range, or the two names of the format penalty
                disagree.
        """
        if invalid_format_penalty is None:
            invalid_format_penalty = (
                0.0 if invalid_action_penalty is None else invalid_action_penalty
            )
        elif (
            invalid_action_penalty is not None and invalid_action_penalty != invalid_format_penalty
        ):
            raise ValueError(
                f"invalid_action_penalty={invalid_action_penalty!r} and invalid_format_penalty="
                f"{invalid_format_penalty!r} name the same penalty (for an unparseable action); "
                "give one of them."
            )
        if not inadmissible_action_penalty >= 0 or inadmissible_action_penalty == float("inf"):
            raise ValueError(
                "inadmissible_action_penalty must be finite and >= 0 (it is subtracted), got "
                f"{inadmissible_action_penalty!r}."
            )
        # The base class checks and keeps the format penalty as `invalid_action_penalty`.
        super().__init__(max_steps, invalid_format_penalty, tasks)
        self.inadmissible_action_penalty = float(inadmissible_action_penalty)
        self.normalize_actions = bool(normalize_actions)
        self.strip_welcome = bool(strip_welcome)
        self.expert_plan = bool(expert_plan)
        self._game: Any = None  # The wrapped textworld env; None until the first reset.
        self._game_file: str | None = None  # The game file `_game` has loaded.
        self._state: Any = None  # The game's last state.

    @property
    def invalid_format_penalty(self) -> float:
        """What `step(None)` costs (the base class's `invalid_action_penalty`)."""
        return self.invalid_action_penalty

    def _start(self, task: AlfworldTask) -> tuple[str, dict[str, Any]]:
        # Resetting the same game again is cheaper than switching games (no reload). Until the
        # new game is up no game is known to be loaded, so a failed load cannot leave the env
        # half in the old one.
        if self._game is None:
            self._game = _start_game(task.game_file, self.expert_plan)
        elif self._game_file != task.game_file:
            self._game_file = None
            self._game.load(task.game_file)
        self._game_file = task.game_file
        self._state = self._game.reset()
        observation = self._state.feedback
        if self.strip_welcome:
            observation = WELCOME_RE.sub("", observation)
        goal = _GOAL_RE.search(observation)
        if goal is None:
            raise RuntimeError(
                f"Game {task.game_file!r} ({task.task_id}) has no 'Your task is to: ...' sentence "
                f"in its first observation: {observation!r}. The game file may be corrupt; "
                "re-download the data or drop this task."
            )
        info = self._info(won=bool(self._state["won"]), invalid=False, action=None)
        info.update(goal=goal.group(0).strip(), task_type=task.task_type, task_id=task.task_id)
        return observation, info

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        if action is None:
            info = self._info(won=False, invalid=True, action=None)
            info["invalid_format"] = True
            return NOTHING_HAPPENS, -self.invalid_action_penalty, False, info
        command = normalize_action(action) if self.normalize_actions else action
        # textworld's own rule (PddlEnv.step): the stripped command must be one it lists.
        invalid = command.strip() not in self._state["admissible_commands"]
        self._state, _, game_over = self._game.step(command)
        won = bool(self._state["won"])
        if won:
            reward = 1.0
        elif invalid:
            reward = -self.inadmissible_action_penalty
        else:
            reward = 0.0
        info = self._info(won=won, invalid=invalid, action=command)
        return self._state.feedback, reward, bool(game_over) or won, info

    def _close(self) -> None:
        """Releases the game engine. A later `reset` starts a fresh one."""
        if self._game is not None:
            self._game.close()
        self._game = None
        self._game_file = None
        self._state = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Without this, pickling fails deep inside textworld with an unhelpful message.
        raise TypeError(
            "AlfworldEnv holds a live textworld game and cannot be pickled or copied; create one "
            "env per worker with make_env('alfworld', ...) or fork the process that holds it."
        )

    def _info(self, *, won: bool, invalid: bool, action: str | None) -> dict:
        info = {
            "won": won,
            "invalid_action": invalid,
            "invalid_format": False,
            "admissible_commands": list(self._state["admissible_commands"]),
            "extra.gamefile": self._game_file,
            "action": action,
        }
        if self.expert_plan:
            info["extra.expert_plan"] = list(self._state["policy_commands"])
        return info


def _start_game(game_file: str, expert_plan: bool) -> Any:
    """Starts textworld on `game_file` with alfworld's naming and info wrappers.

    The wrappers and requested infos are `AlfredTWEnv.init_env`'s (for an evaluation split:
    no domain randomisation); `expert_plan` asks for the planner's commands, which
    `AlfredExpert(expert_type="planner")` reports as the expert plan (its handcoded expert needs
    the `traj_data.json` files that the game-only data leaves out).
    """
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    request_infos = textworld.EnvInfos(
        won=True,
        admissible_commands=True,
        feedback=True,
        policy_commands=expert_plan,
        extras=["gamefile"],
    )
    return textworld.start(
        game_file,
        request_infos=request_infos,
        wrappers=[AlfredDemangler(shuffle=False), AlfredInfos],
    )
