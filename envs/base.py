"""What every environment shares: tasks, text spaces, the `TextEnv` base class, data roots.

Every environment is a `gymnasium.Env` over text: `reset(seed=None, options={"task": task})`
returns `(observation, info)`, `step(action)` returns `(observation, reward, terminated,
truncated, info)`. Actions are free text from a language model, so an environment never raises
on a bad action; it answers with its own "that did nothing" observation, sets
`info["invalid_action"]` and lets the reward say it was wrong. Exceptions are kept for misuse by
the caller (stepping before `reset` or after the episode ended).

The info contract (every `reset` and `step` of a `TextEnv`):
- `won` (bool): the task was achieved;
- `invalid_action` (bool): the env rejected or ignored the action (ALFWorld's "Nothing
  happens.", WebShop's unavailable click, a malformed tool call, no action at all);
- `truncated` (bool): the same as the `truncated` flag (the step limit cut the episode off);
- `steps` (int): actions taken in the episode so far;
- `refused` (str, only on a step whose action `action_refusal` refused): why.
Environments add their own keys (`goal` at reset, `admissible_commands`, ...).

Tasks: `reset(options={"task": task})` plays `task`, an instance of the env's `Task` subclass;
`reset()` without one draws a task from the env's default list with its seeded generator (see
`TextEnv`). An environment lists its tasks with `load_tasks(data_root, split, task_types,
**options)` on its class (a classmethod, or a module's loader as a staticmethod);
`load_tasks(name, ...)` below finds the class from any name (`envs.registry`) and calls it, so
a user's env needs no registration for its tasks.

Snapshots, restores and forks are the sandbox layer's job (`envs.sandbox`); it drives the same
gymnasium API and reports `done = terminated or truncated` as a `StepResult`.

Example:
    env = make_env("alfworld", max_steps=50)          # or make_env("bpo_jax/ALFWorld-v0")
    observation, info = env.reset(options={"task": task})
    observation, reward, terminated, truncated, info = env.step("go to desk 1")
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import string
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import gymnasium
from gymnasium import spaces

from envs.registry import env_class, known_envs, load_tasks, make_env, register_env

__all__ = [
    "ACTION_MAX_CHARS",
    "OBSERVATION_MAX_CHARS",
    "StepResult",
    "Task",
    "TextEnv",
    "TextSpace",
    "action_refusal",
    "check_task_types",
    "env_class",
    "known_envs",
    "load_tasks",
    "make_env",
    "register_env",
    "reset_to",
    "resolve_data_root",
    "step_result",
]

# A language model's action: generated tokens decode to at most a few dozen characters each, and
# no config generates more than a few hundred tokens per action; this bound is far above both.
ACTION_MAX_CHARS = 1 << 16
# Observations: the longest page any env here shows is a few thousand characters (SWE tool output
# is cut to `observation_chars`); a game that printed more would be a bug worth a failed check.
OBSERVATION_MAX_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Task:
    """One thing to do in an environment; subclasses add what their environment needs.

    Attributes:
        task_id: Stable, unique name of the task, used in logs and to split data. Within one
            environment, equal ids mean the same task.
    """

    task_id: str


class StepResult(NamedTuple):
    """One step as the sandbox layer reports it (`step_result`).

    Attributes:
        observation: Text the agent sees next.
        reward: Reward for this step alone (not cumulative).
        done: `terminated or truncated`: `step` must not be called again until the next reset.
        info: The env's info (see the module docstring); `info["truncated"]` is the flag.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


class TextSpace(spaces.Text):
    """Every Unicode string of `min_length` to `max_length` characters.

    `gymnasium.spaces.Text` checks each character against its charset, and a charset of all of
    Unicode costs seconds and hundreds of MB to build; model text can hold any character, so
    membership here checks the length alone. `sample()` draws from `charset` (printable ASCII by
    default), which is what `check_env` feeds an env.
    """

    def __init__(
        self, max_length: int, *, min_length: int = 0, charset: str = string.printable, seed=None
    ):
        super().__init__(max_length, min_length=min_length, charset=charset, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace({self.min_length}, {self.max_length}, any Unicode)"


class TextEnv(gymnasium.Env):
    """Base class of the text environments: step counting, the step limit, misuse errors, info.

    Subclasses set `task_class` (the `Task` subclass `reset` accepts), implement `_start(task)
    -> (observation, info)` and `_play(action) -> (observation, reward, terminated, info)`
    (`info` with `won` and `invalid_action`), and may override `_close()`. `self.steps` already
    counts the action when `_play` runs, so `self.last_step` says whether it is the last one.

    Tasks: `cls.load_tasks(data_root, split, task_types, **options)` lists them (what
    `envs.base.load_tasks(name, ...)` calls). `reset()` without a task draws one with
    `self.np_random` from `default_tasks()` (the constructor's `tasks`, else `load_tasks(None,
    default_split)`), so `reset(seed=s)` picks the same task for the same seed.

    Sandboxes: `preload_modules` are imported by a sandbox worker before it creates the env
    (modules the env would otherwise import on its first reset), so that every fork has them.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    observation_space = TextSpace(OBSERVATION_MAX_CHARS)
    action_space = TextSpace(ACTION_MAX_CHARS)
    task_class: ClassVar[type[Task]] = Task
    preload_modules: ClassVar[tuple[str, ...]] = ()
    default_split: ClassVar[str | None] = None

    def __init__(
        self,
        max_steps: int | None = 50,
        invalid_action_penalty: float = 0.0,
        tasks: Sequence[Task] | None = None,
    ):
        """Validates and keeps the settings every env has.

        Args:
            max_steps: Episode length limit: the step that reaches it ends the episode with
                `truncated` (unless it terminates it). None: no limit.
            invalid_action_penalty: Non-negative amount an env subtracts for an invalid action.
            tasks: What `reset()` without a task draws from (None: `load_tasks(None,
                default_split)` on first use).

        Raises:
            ValueError: If an argument is out of range.
        """
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
        ):
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}.")
        if not invalid_action_penalty >= 0:
            raise ValueError(
                f"invalid_action_penalty must be >= 0 (it is subtracted), got "
                f"{invalid_action_penalty!r}."
            )
        self.max_steps = max_steps
        self.invalid_action_penalty = float(invalid_action_penalty)
        # The class declares the spaces; each env samples from its own copy (gymnasium seeds an
        # env's spaces separately from other envs').
        self.observation_space = copy.deepcopy(type(self).observation_space)
        self.action_space = copy.deepcopy(type(self).action_space)
        self._task: Task | None = None
        self._steps = 0
        self._done = True  # No episode running until reset.
        self._default_tasks = None if tasks is None else list(tasks)
        if self._default_tasks is not None and not self._default_tasks:
            raise ValueError("tasks must hold at least one task, or be None.")

    # Tasks --------------------------------------------------------------------------------------

    @classmethod
    def load_tasks(
        cls,
        data_root: str | None,
        split: str,
        task_types: tuple[str, ...] | None = None,
        **options: Any,
    ) -> list[Task]:
        """Lists the tasks of one split (override; the base class has none).

        Raises:
            ValueError: Always, naming the class: it defines no task loader.
        """
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__} has no task loader; define a `load_tasks` "
            "classmethod (data_root, split, task_types=None, **options) -> list[Task] on it."
        )

    def default_tasks(self) -> Sequence[Task]:
        """The tasks `reset()` draws from when no task is given (cached)."""
        if self._default_tasks is None:
            if self.default_split is None:
                raise ValueError(
                    f"{type(self).__name__}.reset needs options={{'task': ...}}: it has no "
                    "default_split to draw a task from."
                )
            self._default_tasks = list(type(self).load_tasks(None, self.default_split))
            if not self._default_tasks:
                raise ValueError(f"{type(self).__name__}: split {self.default_split!r} is empty.")
        return self._default_tasks

    # The gymnasium API --------------------------------------------------------------------------

    @property
    def task(self) -> Task | None:
        """The task of the current (or last) episode."""
        return self._task

    @property
    def steps(self) -> int:
        """Actions taken in the current episode."""
        return self._steps

    @property
    def done(self) -> bool:
        """Whether no episode is running (before the first reset, or after the last step)."""
        return self._done

    @property
    def last_step(self) -> bool:
        """Whether the action being played reaches `max_steps` (read inside `_play`)."""
        return self.max_steps is not None and self._steps >= self.max_steps

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Starts an episode of `options["task"]` (or of a task drawn from `default_tasks()`).

        Args:
            seed: Seeds `self.np_random` (gymnasium's rule), which draws the default task.
            options: `{"task": task}` or None/{}; no other keys.

        Returns:
            The first observation and the info dict (see the module docstring).

        Raises:
            TypeError: If the task is not a `task_class`.
            ValueError: For an unknown option.
        """
        super().reset(seed=seed)
        options = dict(options or {})
        task = options.pop("task", None)
        if options:
            raise ValueError(
                f"{type(self).__name__}.reset got unknown options {sorted(options)}; the only "
                "option is 'task'."
            )
        if task is None:
            tasks = self.default_tasks()
            task = tasks[int(self.np_random.integers(len(tasks)))]
        if not isinstance(task, self.task_class):
            raise TypeError(
                f"{type(self).__name__}.reset expects a {self.task_class.__name__} (from its "
                f"load_tasks), got {type(task).__name__}: {task!r}."
            )
        # Until the new episode is up none is running, so that a failed start leaves no
        # half-reset episode that could be stepped.
        self._done = True
        self._task, self._steps = task, 0
        observation, info = self._start(task)
        self._done = False
        return observation, self._common_info(info, truncated=False)

    def step(self, action: str | None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Plays one action.

        Args:
            action: The agent's text, or None when no action could be parsed from its output
                (always invalid). Invalid actions are answered, never raised. Text that
                `action_refusal` refuses (not a str, over `ACTION_MAX_CHARS`, a NUL, a lone
                surrogate) never reaches the env: the step is an invalid action whose
                observation and `info["refused"]` say why.

        Returns:
            `(observation, reward, terminated, truncated, info)`.

        Raises:
            RuntimeError: If no episode is running (before `reset`, or after it ended).
        """
        self.check_can_step()
        self._steps += 1
        refusal = None if action is None else action_refusal(action)
        if refusal is None:
            observation, reward, terminated, info = self._play(action)
        else:
            # Text no env could act on: answered here, at a cost bounded by ACTION_MAX_CHARS,
            # before the env writes it to a file, a pipe or a tokenizer that would raise.
            observation, terminated = f"Invalid action: {refusal}", False
            reward = -self.invalid_action_penalty
            info = {"won": False, "invalid_action": True, "refused": refusal}
        terminated = bool(terminated)
        truncated = not terminated and self.last_step
        self._done = terminated or truncated
        return observation, float(reward), terminated, truncated, self._common_info(info, truncated)

    def close(self) -> None:
        """Ends any episode and frees what the env holds. Safe to call more than once."""
        self._done = True
        self._close()

    def check_can_step(self) -> None:
        """Refuses a step before `reset` or after the episode ended.

        Raises:
            RuntimeError: Naming the env class, and the task and step count when it ended.
        """
        name = type(self).__name__
        if self._task is None:
            raise RuntimeError(f"{name}.step called before reset; call reset first.")
        if self._done:
            raise RuntimeError(
                f"{name}.step called after the episode of {self._task.task_id} ended (after "
                f"{self._steps} steps); call reset to start a new one."
            )

    # What subclasses implement ------------------------------------------------------------------

    def _start(self, task: Task) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError

    def _close(self) -> None:  # noqa: B027 - optional hook.
        """Frees the env's own resources (a game engine, a workspace)."""

    def _common_info(self, info: dict[str, Any], truncated: bool) -> dict[str, Any]:
        missing = {"won", "invalid_action"} - info.keys()
        if missing:
            raise KeyError(f"{type(self).__name__} left {sorted(missing)} out of its info dict.")
        info["truncated"] = truncated
        info["steps"] = self._steps
        return info


def action_refusal(action: Any) -> str | None:
    """Why no env should be given `action`, or None if it is text an env can act on.

    Refused: anything but a `str`; more than `ACTION_MAX_CHARS` characters; a NUL (it ends a C
    string: a path or a command line would be cut short or rejected by the OS); a lone
    surrogate (U+D800..U+DFFF on its own is not Unicode text: encoding it to UTF-8 raises).
    The checks cost O(len(action)) with the length checked first, so the cost is bounded.
    """
    if not isinstance(action, str):
        return f"an action is text (a str), got {type(action).__name__}."
    if len(action) > ACTION_MAX_CHARS:
        return f"the action has {len(action):,} characters; at most {ACTION_MAX_CHARS:,} are read."
    nul = action.find("\x00")
    if nul >= 0:
        return f"the action holds a NUL character (at {nul}); write plain text."
    if not action.isascii():
        try:
            action.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"the action holds a lone surrogate (U+{ord(action[e.start]):04X} at {e.start}),"
                " which is not valid Unicode text; write plain text."
            )
    return None


# The sandbox layer's view of an env -------------------------------------------------------------


def reset_to(env: gymnasium.Env, task: Task) -> tuple[str, dict[str, Any]]:
    """`env.reset(options={"task": task})`: how the sandbox layer starts every episode."""
    observation, info = env.reset(options={"task": task})
    return observation, dict(info)


def step_result(env: gymnasium.Env, action: str | None) -> StepResult:
    """Plays `action` in any gymnasium env and reports it with `done = terminated or truncated`.

    `info["truncated"]` is set from the flag, so that envs that do not follow the info contract
    (a user's own gymnasium env) report truncation the same way.
    """
    observation, reward, terminated, truncated, info = env.step(action)
    info = dict(info)
    info["truncated"] = bool(truncated)
    return StepResult(observation, float(reward), bool(terminated or truncated), info)


def check_task_types(
    task_types: Sequence[str] | None, known: Sequence[str], *, env: str, noun: str
) -> None:
    """Checks a task loader's `task_types` argument (None keeps every task).

    Args:
        task_types: The task types asked for, or None.
        known: Every task type the environment has.
        env: The environment's name, for messages ("ALFWorld").
        noun: What a task type is, for messages ("task types", "categories").

    Raises:
        ValueError: If `task_types` is a bare string (it would be iterated character by
            character) or names a task type not in `known`.
    """
    if task_types is None:
        return
    if isinstance(task_types, str):
        raise ValueError(
            f"task_types must be a list of {noun}, got the string {task_types!r}; wrap it in a "
            f"list: [{task_types!r}]."
        )
    unknown = [t for t in task_types if t not in known]
    if unknown:
        raise ValueError(f"Unknown {env} task type(s) {unknown}; expected some of {list(known)}.")


def resolve_data_root(
    root: str | os.PathLike[str] | None,
    *,
    env_var: str,
    default: str,
    label: str,
    hint: str,
    marker: str | None = None,
) -> pathlib.Path:
    """Finds an environment's data folder: `root`, else `$env_var`, else `default`.

    Args:
        root: Explicit folder (None or "": use the environment variable or the default).
        env_var: Environment variable to read.
        default: Folder used when both are unset.
        label: What the folder holds, for messages ("ALFWorld data root").
        hint: How to get the data, appended to the error message.
        marker: A file or folder that must exist inside it (e.g. "json_2.1.1").

    Raises:
        FileNotFoundError: If the folder (or its `marker`) does not exist; says where the path
            came from and how to get the data.
    """
    if root:
        source = "the data-root argument"
    elif os.environ.get(env_var):
        root, source = os.environ[env_var], f"${env_var}"
    else:
        root, source = default, f"the default ({env_var} is unset)"
    path = pathlib.Path(root).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"{label} {str(path)!r} (from {source}) does not exist. {hint}")
    if marker is not None and not (path / marker).exists():
        raise FileNotFoundError(f"{label} {str(path)!r} (from {source}) has no {marker}. {hint}")
    return path
