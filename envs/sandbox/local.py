"""In-process sandboxes: the environment object lives in the trainer's own process.

Shared by the `inprocess` and `replay` backends. Calls run synchronously when started, so a pool
gets no parallelism from them, and a step that hangs or crashes the interpreter takes the trainer
with it (the timeouts are not enforced). An exception from the env faults the sandbox, as it
does in a worker process.
"""

from __future__ import annotations

from typing import Any

from envs.base import StepResult, Task, make_env, reset_to, step_result
from envs.registry import preload_for
from envs.sandbox.backend import SandboxBackend, import_modules
from envs.sandbox.base import Call, DoneCall, Sandbox, SandboxFault

__all__ = ["LocalBackend", "LocalSandbox"]


class LocalSandbox(Sandbox):
    """A sandbox around an env object in this process; remembers its episode's actions."""

    def __init__(self, backend: LocalBackend, env: Any):
        super().__init__(backend)
        self.env = env
        self.actions: list[str | None] = []
        self.last_observation: str | None = None

    def start_reset(self, task: Task) -> Call:
        self._check_open()

        def run() -> tuple[str, dict[str, Any]]:
            observation, info = self._guard("reset", lambda: reset_to(self.env, task))
            self._after_reset(task)
            self.actions = []
            self.last_observation = observation
            return observation, info

        return DoneCall.run(run)

    def start_step(self, action: str | None) -> Call:
        self._check_open()

        def run() -> StepResult:
            result = self._guard("step", lambda: step_result(self.env, action))
            self._after_step(result)
            self.actions.append(action)
            self.last_observation = result.observation
            return result

        return DoneCall.run(run)

    def _guard(self, op: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:
            self.backend._fault(self)
            raise SandboxFault(
                "error", f"{type(e).__name__}: {e} (raised by {type(self.env).__name__}.{op})"
            ) from e


class LocalBackend(SandboxBackend):
    """Base of the in-process backends: creates env objects in this process.

    Args:
        preload: Modules to import before creating envs (default:
            `envs.registry.preload_for(env_name)`).
        Other arguments: see `SandboxBackend`.
    """

    def __init__(self, env_name: str, env_kwargs: Any = None, *, preload: Any = None, **options):
        super().__init__(env_name, env_kwargs, **options)
        import_modules(preload_for(env_name) if preload is None else tuple(preload))

    def _make_env(self) -> Any:
        return make_env(self.env_name, **self.env_kwargs)

    def _new_sandbox(self) -> Sandbox:
        return LocalSandbox(self, self._make_env())

    def _close_sandbox_impl(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, LocalSandbox)
        try:
            sandbox.env.close()
        except Exception:  # noqa: BLE001 - a broken env is being thrown away anyway.
            pass
