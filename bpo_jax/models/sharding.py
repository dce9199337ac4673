"""Logical-axis sharding: model code names axes, one rules table maps them to the mesh.

Model code only ever says which *logical* axis a dimension is (`batch`, `length`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`). The rules table (`axes.DEFAULT_RULES`,
copied into the experiment config as `mesh.rules`, where it can be overridden) says which mesh
axes (`data`, `fsdp`, `tensor`) each logical axis is split over. A dimension whose size is not
divisible by the mesh axes it maps to is replicated instead of failing, so the same rules serve
a 7B model on a pod and the tiny model on 8 fake CPU devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bpo_jax.models.axes import DEFAULT_RULES, MESH_AXES

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "axis_rules",
    "constrain",
    "current_rules",
    "logical_to_spec",
    "make_mesh",
    "named_sharding",
]

_RULES: contextvars.ContextVar = contextvars.ContextVar("bpo_jax_axis_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def axis_rules(rules):
    """Sets the logical-axis rules used by `constrain` and `logical_to_spec` in this context."""
    token = _RULES.set(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules():
    return _RULES.get()


def make_mesh(shape: dict[str, int] | Sequence[int], devices=None) -> Mesh:
    """Builds a (data, fsdp, tensor) mesh with Auto axes.

    Args:
      shape: sizes of (data, fsdp, tensor), as a dict or sequence; one size may be -1 to take
        all remaining devices.
      devices: devices to use (default: all).

    Returns:
      A `jax.sharding.Mesh` whose axis types are Auto, so `with_sharding_constraint` works.
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(shape, dict):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(
                f"Unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}."
            )
        sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    else:
        sizes = [int(s) for s in shape]
        if len(sizes) != len(MESH_AXES):
            raise ValueError(f"Mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}.")
    if sizes.count(-1) > 1:
        raise ValueError(f"At most one mesh axis may be -1, got {sizes}.")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise ValueError(f"{len(devices)} devices cannot be split by fixed mesh sizes {sizes}.")
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"but {len(devices)} are available."
        )
    arr = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules=None,
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis is used at most once (first logical axis wins). When `shape` and `mesh` are
    given, mesh axes that do not divide the dimension are dropped (that dimension is replicated
    over them) rather than producing an invalid sharding.
    """
    rules = dict(current_rules() if rules is None else rules)
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise ValueError(
                f"Logical axis {name!r} has no sharding rule; rules cover {sorted(rules)}."
            )
        if target is None:
            out.append(None)
            continue
        mesh_axes = (target,) if isinstance(target, str) else tuple(target)
        kept = []
        for a in mesh_axes:
            if a in used:
                continue
            if mesh is not None:
                size = mesh.shape[a] if a in mesh.shape else 1
                if shape is not None and shape[i] % (size * math.prod(mesh.shape[k] for k in kept)):
                    continue
            kept.append(a)
        used.update(kept)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return PartitionSpec(*out)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by logical axes under the current mesh.

    Outside a mesh context (`jax.set_mesh`) there is nothing to constrain to, and `x` is returned
    unchanged; under one (including a mesh of fake CPU devices) the constraint is applied.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:
        return x
    spec = logical_to_spec(axes, x.shape, mesh)
    if mesh.manual_axes:
        # Inside a shard_map over some axes (the sampler's per-replica decode): the array is
        # already this replica's block along them, so only the automatic axes are constrained.
        spec = PartitionSpec(*(_without(entry, mesh.manual_axes) for entry in spec))
    return jax.lax.with_sharding_constraint(x, spec)


def _without(entry, axes):
    """A PartitionSpec entry with the mesh axes in `axes` removed."""
    if entry is None:
        return None
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))
