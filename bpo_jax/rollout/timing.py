"""Where an iteration's seconds go: named wall-clock phases, and JAX's compilation time.

`Timer` accumulates wall time per phase (`with timer("env"): ...`); `CompileClock` adds up the
compilation events JAX reports (`jax.monitoring`: tracing, lowering and backend compilation),
which happen inside whichever phase first runs a program, so they are reported beside the
phases, not subtracted from them. `env_floor_metrics` sets a rollout's wall time against its
environment floor (env steps x measured step latency / workers, issue 13).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class Timer:
    """Wall-clock seconds per named phase."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def as_dict(self, prefix: str = "time/") -> dict[str, float]:
        return {f"{prefix}{k}_seconds": v for k, v in self.seconds.items()}


class CompileClock:
    """Total seconds JAX has spent compiling since this process registered the clock."""

    _lock = threading.Lock()
    _total = 0.0
    _registered = False

    @classmethod
    def _listen(cls, event: str, duration: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            with cls._lock:
                cls._total += duration

    @classmethod
    def total(cls) -> float:
        if not cls._registered:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(cls._listen)
            cls._registered = True
        return cls._total


def env_floor_metrics(
    seconds: dict[str, float], env_steps: int, workers: int, rollout_seconds: float
) -> dict[str, float]:
    """The rollout's environment floor and how close the rollout came to it.

    Args:
      seconds: a forest's phases (`RolloutForest.seconds`); "env_busy" is the sum over its
        steps of each step's send-to-reply latency, as the sandbox pool measured it.
      env_steps: steps the rollout played.
      workers: the pool's `num_workers` (most steps in flight at once).
      rollout_seconds: the rollout's wall time.

    Returns:
      `time/env_step_latency_seconds` (mean per step), `time/env_floor_seconds` (env steps x
      mean latency / workers: the rollout's length if only the env steps cost time, every
      worker kept busy) and `time/rollout_over_floor` (1 = at the floor). Empty without steps.
    """
    busy = seconds.get("env_busy", 0.0)
    if env_steps <= 0 or busy <= 0.0:
        return {}
    floor = busy / workers
    return {
        "time/env_step_latency_seconds": busy / env_steps,
        "time/env_floor_seconds": floor,
        "time/rollout_over_floor": rollout_seconds / floor,
    }
