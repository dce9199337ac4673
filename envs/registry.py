"""Names for environments: short names, gymnasium ids and entry points, and their tasks.

`make_env(name, **kwargs)` and `load_tasks(name, ...)` accept three kinds of name:
- a short name: the built-in "alfworld", "webshop", "swe", "tabular" (aliases of their gymnasium
  ids), or one registered with `@register_env(name)` (the sandbox package's test envs);
- a gymnasium id, ours (`bpo_jax/ALFWorld-v0`, `bpo_jax/WebShop-v0`, `bpo_jax/RepoRepair-v0`,
  `bpo_jax/TabularTree-v0`, registered on `import envs`) or a user's (`gymnasium.register`);
- an entry point "package.module:ClassName" of a class that needs no registration.

The env must produce text: `reset(options={"task": task})` and `step(text)` with string
observations (subclassing `envs.base.TextEnv` gives that and the info contract).

Tasks: an environment's tasks come from its class: `load_tasks(name, data_root, split,
task_types, **options)` calls `cls.load_tasks(data_root, split, task_types, **options)` (a
class- or staticmethod; `TextEnv` documents it). A gymnasium env without one has no tasks to
list here: give it a `load_tasks` classmethod, or build the tasks yourself and hand them to the
sandbox pool.

`make_env` builds the env itself, unwrapped (gymnasium.make's order and passive checkers are the
sandbox layer's job here), with the spec's kwargs under the caller's; a spec's
`max_episode_steps` is kept as a `TimeLimit` wrapper.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import gymnasium

__all__ = [
    "GYM_IDS",
    "SHORT_NAMES",
    "env_class",
    "known_envs",
    "load_tasks",
    "make_env",
    "preload_for",
    "register_env",
    "register_gym_envs",
]

# Our gymnasium ids and the classes behind them (imported on first use: ALFWorld's engine takes
# a second to import).
GYM_IDS: dict[str, str] = {
    "bpo_jax/ALFWorld-v0": "envs.alfworld.env:AlfworldEnv",
    "bpo_jax/WebShop-v0": "envs.webshop.env:WebShopEnv",
    "bpo_jax/RepoRepair-v0": "envs.swe.env:SweEnv",
    "bpo_jax/TabularTree-v0": "envs.tabular.env:TabularEnv",
}
# The names configs have always used.
SHORT_NAMES: dict[str, str] = {
    "alfworld": "bpo_jax/ALFWorld-v0",
    "webshop": "bpo_jax/WebShop-v0",
    "swe": "bpo_jax/RepoRepair-v0",
    "tabular": "bpo_jax/TabularTree-v0",
}

_T = TypeVar("_T", bound=type)
# Short name -> class, filled by `register_env` at import time.
_REGISTRY: dict[str, type] = {}


def register_gym_envs() -> None:
    """Registers `GYM_IDS` with gymnasium (done by `import envs`; safe to repeat)."""
    for env_id, entry_point in GYM_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)


def register_env(name: str) -> Callable[[_T], _T]:
    """Class decorator: makes an environment constructible by `make_env(name)`.

    Raises:
        ValueError: If `name` is taken by a different class, or is a built-in or entry point.
    """
    if name in SHORT_NAMES or ":" in name or "/" in name:
        raise ValueError(
            f"register_env({name!r}): built-in names, gymnasium ids and entry points are not "
            "short names; pick a plain name, or register a gymnasium id with gymnasium.register."
        )

    def decorator(cls: _T) -> _T:
        existing = _REGISTRY.get(name)
        # Re-importing a module (importlib.reload, notebooks) re-runs the decorator with a new but
        # equivalent class object; only a genuinely different class is a conflict.
        if existing is not None and _qualified_name(existing) != _qualified_name(cls):
            raise ValueError(
                f"Environment name {name!r} is already registered to {_qualified_name(existing)}; "
                f"cannot register {_qualified_name(cls)} under the same name. Pick another name."
            )
        _REGISTRY[name] = cls
        return cls

    return decorator


def known_envs() -> list[str]:
    """The short names and gymnasium ids `make_env` accepts (entry points are not listed)."""
    register_gym_envs()
    return sorted(set(_REGISTRY) | set(SHORT_NAMES) | set(gymnasium.registry))


def _spec(name: str) -> gymnasium.envs.registration.EnvSpec | None:
    register_gym_envs()
    env_id = SHORT_NAMES.get(name, name)
    return gymnasium.registry.get(env_id)


def _load(entry_point: Any) -> Any:
    if callable(entry_point):
        return entry_point
    module, _, attr = str(entry_point).partition(":")
    if not module or not attr:
        raise ValueError(f"entry point {entry_point!r} is not of the form 'package.module:Name'.")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def env_class(name: str) -> Any:
    """The class (or factory) `make_env(name)` calls; see the module docstring for names.

    Raises:
        ValueError: If `name` is none of the three kinds.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    spec = _spec(name)
    if spec is not None:
        return _load(spec.entry_point)
    if ":" in name:
        try:
            return _load(name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"Environment entry point {name!r} does not load: {e}") from e
    raise ValueError(
        f"Unknown environment {name!r}. Give a short name "
        f"({sorted(set(_REGISTRY) | set(SHORT_NAMES))}), "
        "a registered gymnasium id (e.g. 'bpo_jax/ALFWorld-v0'), or an entry point "
        "'package.module:ClassName'. Short names come from @register_env(name), once their "
        "module is imported."
    )


def make_env(name: str, **kwargs: Any) -> Any:
    """Constructs the environment `name` names (see the module docstring).

    Args:
        name: Short name, gymnasium id or entry point.
        **kwargs: Constructor arguments (over a gymnasium spec's own kwargs).

    Raises:
        ValueError: If `name` names no environment.
    """
    spec = None if name in _REGISTRY else _spec(name)
    factory = env_class(name)
    if spec is None:
        return factory(**kwargs)
    env = factory(**{**spec.kwargs, **kwargs})
    if spec.max_episode_steps is not None:
        env = gymnasium.wrappers.TimeLimit(env, spec.max_episode_steps)
    return env


def load_tasks(
    name: str,
    data_root: str | None,
    split: str,
    task_types: tuple[str, ...] | None = None,
    **options: Any,
) -> list[Any]:
    """Lists the tasks of one split of environment `name`: `env_class(name).load_tasks(...)`.

    Args:
        name: Short name, gymnasium id or entry point.
        data_root: A path, or None for the env's default (e.g. from an environment variable).
        split: A split name.
        task_types: Task-type names to keep, or None (all).
        **options: The experiment's `env.task_options`.

    Raises:
        ValueError: If the environment has no `load_tasks` classmethod.
    """
    cls = env_class(name)
    loader = getattr(cls, "load_tasks", None)
    if loader is None:
        raise ValueError(
            f"Environment {name!r} ({_qualified_name(cls)}) has no task loader: give its class a "
            "`load_tasks(data_root, split, task_types=None, **options)` classmethod."
        )
    return loader(data_root, split, task_types, **options)


def preload_for(name: str) -> tuple[str, ...]:
    """Modules a sandbox worker imports before `make_env(name)`.

    The env class's own module (which registers a short name, and usually a gymnasium id, on
    import) and the class's `preload_modules` (what it would otherwise import on first use).
    """
    cls = env_class(name)
    module = getattr(cls, "__module__", None)
    return tuple(
        dict.fromkeys([*([module] if module else []), *getattr(cls, "preload_modules", ())])
    )


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
