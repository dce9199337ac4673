"""Finding ALFWorld's game files and turning them into tasks.

The data root holds `json_2.1.1/<split>/<task-type>-<objects>-<scene>/<trial>/game.tw-pddl`, the
layout `alfworld-download` writes. Each game file is JSON with the PDDL problem and a
`walkthrough`, an expert action sequence that wins the game. The task type is only recorded in the
folder name, so it is parsed from there.

This module needs neither textworld nor alfworld installed: listing tasks is cheap and should not
pay for (or depend on) the game engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random

from envs import base
from envs.base import Task

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_ROOT",
    "SPLITS",
    "TASK_TYPES",
    "AlfworldTask",
    "load_tasks",
    "resolve_data_root",
    "task_type_of",
]

# The environment variable alfworld itself reads for its data root.
DATA_ENV_VAR = "ALFWORLD_DATA"

# Where `alfworld-download` puts the data when ALFWORLD_DATA is unset (alfworld 0.4.2, info.py).
DEFAULT_DATA_ROOT = "~/.cache/alfworld"

SPLITS = ("train", "valid_seen", "valid_unseen")

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

_GAMES_DIR = "json_2.1.1"
_GAME_FILE = "game.tw-pddl"
_GET_DATA_HINT = (
    "Get the data with `pip install alfworld && alfworld-download` on a machine with internet "
    f"access, then point {DATA_ENV_VAR} (or the data-root argument) at the folder that contains "
    f"{_GAMES_DIR}/."
)


@dataclasses.dataclass(frozen=True)
class AlfworldTask(Task):
    """One ALFWorld game.

    Attributes:
        task_id: `<split>/<task-folder>/<trial>`, the game's folder relative to `json_2.1.1/`.
        game_file: Absolute path of the game's `game.tw-pddl` file.
        split: One of `SPLITS`.
        task_type: One of `TASK_TYPES`.
        walkthrough: Expert actions that win the game from its initial state.
    """

    game_file: str
    split: str
    task_type: str
    walkthrough: tuple[str, ...]


def resolve_data_root(root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Finds the ALFWorld data root: `root`, else `$ALFWORLD_DATA`, else `~/.cache/alfworld`.

    Returns:
        The resolved root; it contains a `json_2.1.1` folder.

    Raises:
        FileNotFoundError: If the chosen root does not exist or has no `json_2.1.1` folder.
    """
    return base.resolve_data_root(
        root,
        env_var=DATA_ENV_VAR,
        default=DEFAULT_DATA_ROOT,
        label="ALFWorld data root",
        hint=_GET_DATA_HINT,
        marker=_GAMES_DIR,
    )


def task_type_of(folder_name: str) -> str | None:
    """Returns the task type a game folder name starts with, or None if it is not one of ours.

    Args:
        folder_name: A name like `pick_two_obj_and_place-Apple-None-Fridge-12`.
    """
    # Longest match first, so that a type that is a prefix of another cannot shadow it.
    for task_type in sorted(TASK_TYPES, key=len, reverse=True):
        if folder_name == task_type or folder_name.startswith(task_type + "-"):
            return task_type
    return None


def load_tasks(
    root: str | os.PathLike[str] | None,
    split: str,
    task_types: tuple[str, ...] | list[str] | None = None,
    limit: int | None = None,
    seed: int | None = None,
) -> list[AlfworldTask]:
    """Lists the games of one split as tasks.

    Like alfworld's own loader, this skips games it cannot play: other ALFRED task types (e.g.
    `pick_and_place_with_movable_recep`), sliced-object games, trials without a game file, and
    games marked unsolvable.

    Args:
        root: Data root, resolved by `resolve_data_root` (None: `$ALFWORLD_DATA` or the default).
        split: One of `SPLITS`.
        task_types: Keep only these task types (each one of `TASK_TYPES`); None keeps all.
        limit: Keep at most this many tasks (after filtering by type).
        seed: If given, shuffle with this seed before applying `limit`, so a limited run sees a
            random but reproducible subset. Without it, tasks are in `task_id` order.

    Returns:
        The tasks, sorted by `task_id` unless `seed` is given.

    Raises:
        FileNotFoundError: If the data root or the split's folder is missing, or the folder
            holds no game.
        ValueError: If `split`, a task type, or `limit` is invalid.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown ALFWorld split {split!r}; expected one of {list(SPLITS)}.")
    base.check_task_types(task_types, TASK_TYPES, env="ALFWorld", noun="task types")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative or None, got {limit}.")

    games_dir = resolve_data_root(root) / _GAMES_DIR
    split_dir = games_dir / split
    if not split_dir.is_dir():
        raise FileNotFoundError(
            f"ALFWorld split folder {str(split_dir)!r} does not exist. {_GET_DATA_HINT}"
        )
    wanted = set(TASK_TYPES if task_types is None else task_types)

    tasks = []
    games_seen = 0  # Game files in the split, whatever their type: none means no data.
    for task_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        games_seen += sum(1 for t in task_dir.iterdir() if (t / _GAME_FILE).is_file())
        task_type = task_type_of(task_dir.name)
        # Sliced-object games are skipped by alfworld's loader too: the text engine cannot play
        # them.
        if task_type not in wanted or "Sliced" in task_dir.name:
            continue
        for trial_dir in sorted(p for p in task_dir.iterdir() if p.is_dir()):
            game_file = trial_dir / _GAME_FILE
            if not game_file.is_file():
                continue
            with open(game_file) as f:
                game = json.load(f)
            if not game.get("solvable", False):
                continue
            tasks.append(
                AlfworldTask(
                    task_id=trial_dir.relative_to(games_dir).as_posix(),
                    game_file=str(game_file),
                    split=split,
                    task_type=task_type,
                    walkthrough=tuple(game.get("walkthrough", ())),
                )
            )
    if not games_seen:
        raise FileNotFoundError(
            f"no games found under {str(split_dir)!r}: it holds no <task>/<trial>/{_GAME_FILE}. "
            f"{_GET_DATA_HINT}"
        )

    tasks.sort(key=lambda t: t.task_id)
    if seed is not None:
        random.Random(seed).shuffle(tasks)
    if limit is not None:
        tasks = tasks[:limit]
    return tasks
