"""How a config section is checked: per-field checks, the section base class, and its reader.

A section of `bpo_jax.config` is a frozen dataclass deriving from `Spec`: each field carries
its own check (`check(test, what)` beside its declaration), run on construction with every
float field required to be finite, and a section's checks that involve two of its fields are
its `_check_fields`. `read_section` builds a section from its mapping, refusing missing and
unknown fields by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class _Check:
    test: Callable[[Any], bool]
    what: str | Callable[[], str]

    def message(self) -> str:
        return self.what() if callable(self.what) else self.what


def check(test: Callable[[Any], bool], what: str | Callable[[], str], default=dataclasses.MISSING):
    """A dataclass field whose value must pass `test`; `what` says what is expected."""
    return dataclasses.field(default=default, metadata={"check": _Check(test, what)})


def at_least(n):
    return check(lambda v: v >= n, f"must be >= {n}")


def positive():
    return check(lambda v: v > 0, "must be > 0")


def unit_interval(closed_right: bool = True):
    if closed_right:
        return check(lambda v: 0 <= v <= 1, "must be in [0, 1]")
    return check(lambda v: 0 <= v < 1, "must be in [0, 1)")


def one_of(names: Callable[[], Iterable[str]]):
    """The value must be a name in a registry (read when checked, so late registrations count)."""
    return check(lambda v: v in set(names()), lambda: f"must be one of {sorted(names())}")


def subsection(cls):
    """A field holding a nested section `cls` (a `Spec`): its mapping is read into `cls` with
    `read_section` on construction; missing, it takes every default of `cls`."""
    return dataclasses.field(default_factory=cls, metadata={"subsection": cls})


class Spec:
    """Checks every field of a frozen section on construction (see the module docstring)."""

    section: ClassVar[str] = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            sub = f.metadata.get("subsection")
            if sub is not None and isinstance(value, Mapping):
                value = read_section(sub, value, f"{self.section}.{f.name}")
                object.__setattr__(self, f.name, value)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            if f.type in ("float", float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    self._fail(f.name, value, "must be a number")
                if not math.isfinite(value):
                    self._fail(f.name, value, "must be finite")
            c = f.metadata.get("check")
            if c is not None and not c.test(value):
                self._fail(f.name, value, c.message())
        self._check_fields()

    def _check_fields(self) -> None:
        """Checks that involve several fields of the section."""

    def _fail(self, name: str, value: Any, what: str):
        raise ValueError(f"config.{self.section}.{name} {what}, got {value!r}.")


def read_section(cls, raw: Mapping[str, Any], name: str):
    """The section `cls` (a `Spec`) of `config.<name>`, from its mapping `raw`."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"config.{name} must be a section (ConfigDict), got {raw!r}.")
    fields = {f.name for f in dataclasses.fields(cls)}
    optional = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    missing = fields - optional - set(raw)
    if missing:
        raise ValueError(f"config.{name} is missing field(s) {sorted(missing)}.")
    extra = set(raw) - fields
    if extra:
        raise ValueError(
            f"config.{name} has unknown field(s) {sorted(extra)}; known: {sorted(fields)}."
        )
    return cls(**{f: raw[f] for f in fields if f in raw})


# ----------------------------------------------------------------------------- model.lora

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # bpo_jax.models.lora.TARGETS


@dataclasses.dataclass(frozen=True)
class LoraSpec(Spec):
    """`model.lora`: low-rank adapters over a frozen base (`bpo_jax.models.lora`)."""

    section = "model.lora"
    rank: int = check(lambda v: v >= 0, "must be >= 0 (0: off, full fine-tuning)", default=0)
    alpha: float = check(lambda v: v > 0, "must be > 0 (the adapters' scale is alpha / rank)", 32.0)
    # Of q, k, v, o (attention) and gate, up, down (MLP).
    targets: tuple = check(
        lambda v: bool(v) and set(v) <= set(LORA_TARGETS),
        f"must be a non-empty subset of {LORA_TARGETS}",
        default=LORA_TARGETS,
    )
    dropout: float = check(
        lambda v: v == 0, "must be 0 (dropout on the adapters' input is not implemented)", 0.0
    )
