"""The protocol every environment implements, and the registry that picks one by name.

An environment plays one episode at a time: `reset(task)` starts it, `step(action)` advances it by
one text action, `close()` frees what it holds. Actions are free text from a language model, so an
environment never raises on a bad action; it answers with its own "that did nothing" observation
and lets the reward say it was wrong. Exceptions are kept for misuse by the caller (stepping
before `reset` or after the episode ended).

Backends that can snapshot and restore a running episode extend this protocol elsewhere; the base
stays minimal so that every environment can implement it.

Example:
    env = make_env("alfworld", max_steps=50)
    observation, info = env.reset(task)
    result = env.step("go to desk 1")
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

__all__ = [
    "check_can_step",
    "Environment",
    "StepResult",
    "Task",
    "known_envs",
    "load_tasks",
    "make_env",
    "register_env",
    "register_task_loader",
]


@dataclasses.dataclass(frozen=True)
class Task:
    """One thing to do in an environment; subclasses add what their environment needs.

    Attributes:
        task_id: Stable, unique name of the task, used in logs and to split data. Within one
            environment, equal ids mean the same task.
    """

    task_id: str


class StepResult(NamedTuple):
    """What one `Environment.step` returns.

    Attributes:
        observation: Text the agent sees next.
        reward: Reward for this step alone (not cumulative).
        done: Whether the episode has ended, by success or by truncation. `step` must not be
            called again until the next `reset`.
        info: Diagnostics. Every environment sets `truncated` (the episode was cut off by a step
            limit, not ended by the game) and `won` (the task was achieved); environments add
            their own keys.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """A text environment that plays one episode at a time."""

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Starts a new episode of `task`, abandoning any episode in progress.

        Args:
            task: The task to play; its concrete type is the environment's own `Task` subclass.

        Returns:
            The first observation and an info dict (same common keys as `StepResult.info`).
        """
        ...

    def step(self, action: str | None) -> StepResult:
        """Plays one action.

        Args:
            action: The agent's action text, or None when no action could be parsed from the
                agent's output. Invalid actions are penalised through the reward, not raised.

        Returns:
            The step's result.

        Raises:
            RuntimeError: If no episode is running (before `reset`, or after `done`).
        """
        ...

    def close(self) -> None:
        """Releases the resources the environment holds. Safe to call more than once."""
        ...


_EnvFactory = Callable[..., Environment]
_F = TypeVar("_F", bound=_EnvFactory)

# Name -> factory (usually the environment class). Filled by `register_env` at import time.
_REGISTRY: dict[str, _EnvFactory] = {}
# Name -> task loader, `loader(data_root, split, task_types, **options) -> list[Task]`.
_TaskLoader = Callable[..., list[Task]]
_TASK_LOADERS: dict[str, _TaskLoader] = {}

# Environments shipped in this repo, imported on first use so that `make_env("alfworld")` works
# without the caller importing the package that registers it (and without paying its import cost
# when it is not used).
_BUILTIN_MODULES: dict[str, str] = {
    "alfworld": "envs.alfworld",
    "swe": "envs.swe",
    "webshop": "envs.webshop",
    "tabular": "envs.tabular",
}


def check_can_step(env: Any, started: bool, done: bool, task: Task | None, steps: int) -> None:
    """The guard every env's `step` starts with: refuses a step before `reset` or after the end.

    Raises:
        RuntimeError: naming the env class, and the task and step count when the episode ended.
    """
    name = type(env).__name__
    if not started or task is None:
        raise RuntimeError(f"{name}.step called before reset; call reset(task) first.")
    if done:
        raise RuntimeError(
            f"{name}.step called after the episode of {task.task_id} ended (after {steps} "
            "steps); call reset(task) to start a new one."
        )


def register_env(name: str) -> Callable[[_F], _F]:
    """Class decorator that makes an environment constructible by `make_env(name)`.

    Args:
        name: The name configs use to select the environment.

    Returns:
        A decorator that registers its argument and returns it unchanged.

    Raises:
        ValueError: If `name` is already taken by a different factory.
    """

    def decorator(factory: _F) -> _F:
        existing = _REGISTRY.get(name)
        # Re-importing a module (importlib.reload, notebooks) re-runs the decorator with a new but
        # equivalent class object; only a genuinely different factory is a conflict.
        if existing is not None and _qualified_name(existing) != _qualified_name(factory):
            raise ValueError(
                f"Environment name {name!r} is already registered to "
                f"{_qualified_name(existing)}; cannot register {_qualified_name(factory)} under "
                "the same name. Pick another name."
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def known_envs() -> list[str]:
    """Returns the sorted names `make_env` accepts."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def make_env(name: str, **kwargs: Any) -> Environment:
    """Constructs the environment registered under `name`.

    Args:
        name: A registered environment name, e.g. "alfworld".
        **kwargs: Passed to the environment's constructor.

    Returns:
        A new environment.

    Raises:
        ValueError: If no environment is registered under `name`.
    """
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown environment {name!r}. Known environments: {known_envs()}. Register new "
            "ones with @register_env(name) and import their module before calling make_env."
        )
    return _REGISTRY[name](**kwargs)


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def register_task_loader(name: str) -> Callable[[_TaskLoader], _TaskLoader]:
    """Decorator that makes `load_tasks(name, ...)` list an environment's tasks.

    The loader is called as `loader(data_root, split, task_types, **options)`: `data_root` is
    a path or None (the environment's default, e.g. from an environment variable), `split` a
    split name, `task_types` a tuple of task-type names or None (all), and `options` the
    experiment's `env.task_options`.
    """

    def decorator(loader):
        _TASK_LOADERS[name] = loader
        return loader

    return decorator


def load_tasks(
    name: str,
    data_root: str | None,
    split: str,
    task_types: tuple[str, ...] | None = None,
    **options: Any,
) -> list[Task]:
    """Lists the tasks of one split of the environment registered under `name`.

    Raises:
        ValueError: If the environment has no task loader.
    """
    if name not in _TASK_LOADERS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _TASK_LOADERS:
        raise ValueError(
            f"Environment {name!r} has no task loader. Known: {sorted(_TASK_LOADERS)}. Register "
            "one with @register_task_loader(name) in the environment's package."
        )
    return _TASK_LOADERS[name](data_root, split, task_types, **options)
