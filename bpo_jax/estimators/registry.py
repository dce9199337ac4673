"""The estimators' common interface: the `Forest` pytree and the registry of estimators.

An estimator is `fn(forest, **options)` registered under a name that configs choose by string;
it returns advantages per segment (expanded to steps by `step_advantages`) or per step. The
sibling-baseline methods (bpo, rloo, grpo) are registered here, the step-level ones (treerl,
gigpo) in `step_level`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import struct

from bpo_jax.estimators.kernels import DEFAULT_EPS, METHODS, expand_to_steps, tree_advantages
from bpo_jax.estimators.validation import validate_forest


@struct.dataclass
class Forest:
    """A batch of rollouts as a forest (a pytree; num_nodes is static).

    Attributes:
      seg_parent, seg_child, seg_reward: see the module docstring, shape [S].
      num_nodes: static number of node ids.
      step_segment: int32[T], the segment of each step, -1 for padding. Steps of one segment
        must appear in time order (segments may interleave).
      step_reward: float32[T], optional per-step reward (summing to seg_reward per segment);
        when absent a segment's reward counts as collected at its last step.
      step_obs_id: int32[T], optional id of the observation text a step acts on (GiGPO groups);
        -1 puts a step in no group.
    """

    seg_parent: Any
    seg_child: Any
    seg_reward: Any
    num_nodes: int = struct.field(pytree_node=False)
    step_segment: Any = None
    step_reward: Any = None
    step_obs_id: Any = None

    def validate(self) -> None:
        """Host-side checks of the segment and step arrays (see `validate_forest`)."""
        validate_forest(self.seg_parent, self.seg_child, self.num_nodes, seg_reward=self.seg_reward)
        if self.step_segment is None:
            return
        step_segment = np.asarray(self.step_segment)
        num_segments = np.shape(self.seg_parent)[0]
        bad = np.flatnonzero((step_segment < -1) | (step_segment >= num_segments))
        if bad.size:
            raise ValueError(f"step_segment[{bad[0]}] = {step_segment[bad[0]]} is out of range")
        real = step_segment >= 0
        on_padding = np.flatnonzero(real & (np.asarray(self.seg_parent)[step_segment] < 0))
        if on_padding.size:
            raise ValueError(f"step {on_padding[0]} belongs to a padding segment")
        for name in ("step_reward", "step_obs_id"):
            arr = getattr(self, name)
            if arr is not None and np.shape(arr) != step_segment.shape:
                raise ValueError(f"{name} has shape {np.shape(arr)}, expected {step_segment.shape}")
        if self.step_reward is not None:
            step_reward = np.where(real, np.asarray(self.step_reward, np.float64), 0.0)
            summed = np.bincount(step_segment[real], step_reward[real], minlength=num_segments)
            seg_reward = np.where(np.asarray(self.seg_parent) >= 0, self.seg_reward, 0.0)
            bad = np.flatnonzero(~np.isclose(summed, seg_reward, rtol=1e-5, atol=1e-4))
            if bad.size:
                raise ValueError(
                    f"step rewards of segment {bad[0]} sum to {summed[bad[0]]}, but "
                    f"seg_reward[{bad[0]}] = {seg_reward[bad[0]]}"
                )


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: `fn(forest, **options)` -> advantages per segment or per step."""

    name: str
    fn: Callable[..., jax.Array]
    per_step: bool

    def __call__(self, forest: Forest, **options) -> jax.Array:
        return self.fn(forest, **options)


_REGISTRY: dict[str, Estimator] = {}


def register_estimator(name: str, *, per_step: bool = False):
    """Decorator: registers `fn(forest, **options)` under `name` (per_step: returns [T])."""

    def decorate(fn):
        if name in _REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered")
        _REGISTRY[name] = Estimator(name, fn, per_step)
        return fn

    return decorate


def get_estimator(name: str) -> Estimator:
    """Returns the estimator registered under `name`; ValueError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; known: {sorted(_REGISTRY)}") from None


def estimator_names() -> list[str]:
    return sorted(_REGISTRY)


def step_advantages(forest: Forest, name: str, **options) -> jax.Array:
    """Per-step advantages [T] from any registered estimator (segment ones are expanded)."""
    estimator = get_estimator(name)
    adv = estimator(forest, **options)
    if estimator.per_step:
        return adv
    if forest.step_segment is None:
        raise ValueError(f"estimator {name!r} gives per-segment advantages; set step_segment")
    return expand_to_steps(adv, forest.step_segment)


def _sibling_estimator(method: str):
    def estimate(forest: Forest, *, normalize: str = "none", eps: float = DEFAULT_EPS):
        return tree_advantages(
            forest.seg_parent,
            forest.seg_child,
            forest.seg_reward,
            forest.num_nodes,
            method,
            normalize,
            eps=eps,
        )[1]

    estimate.__doc__ = f"'{method}' advantages from `tree_advantages` (per segment)."
    return estimate


for _method in METHODS:
    register_estimator(_method)(_sibling_estimator(_method))
