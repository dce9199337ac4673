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
from collections.abc import Collection, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bpo_jax.models.axes import DEFAULT_RULES, MESH_AXES

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "axis_rules",
    "check_replication",
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


def make_mesh(shape: dict[str, int] | Sequence[int], devices=None, *, dcn_data: int = 0) -> Mesh:
    """Builds a (data, fsdp, tensor) mesh with Auto axes, laid out on the devices' network.

    On TPUs the layout is `jax.experimental.mesh_utils`': within a slice `create_device_mesh`
    maps the axes onto the ICI torus (`tensor`, the most communication per step, on the
    nearest chips); devices that span several slices (multislice: devices carry `slice_index`)
    make one hybrid mesh (`create_hybrid_device_mesh`) whose `data` axis runs over the slices
    (DCN) while `fsdp` and `tensor` stay inside each slice, so no parameter all-gather crosses
    the slow network. Devices without a topology (CPU) keep their order, one slice.

    Args:
      shape: sizes of (data, fsdp, tensor) *within one slice*, as a dict or sequence; one size
        may be -1 to take the rest of a slice's devices. With one slice these are the mesh's.
      devices: devices to use (default: all).
      dcn_data: slices the `data` axis spans (`config.mesh.dcn_data`); the mesh's data axis is
        `dcn_data * data`. 0: as many as the devices span. Any other value must equal that
        number; it lets a config insist on its slice count.

    Returns:
      A `jax.sharding.Mesh` whose axis types are Auto, so `with_sharding_constraint` works.

    Raises:
      ValueError: unknown axes or sizes that do not divide a slice's devices (naming the
        slice count, since fsdp and tensor may not cross slices), slices of unequal size, or a
        `dcn_data` that is not the number of slices the devices span.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = _axis_sizes(shape)
    slices = _slices(devices)
    if dcn_data < 0 or (dcn_data and dcn_data != len(slices)):
        raise ValueError(
            f"dcn_data={dcn_data} (config.mesh.dcn_data) must be the number of slices the "
            f"{len(devices)} devices span, {len(slices)}, or 0 for that number."
        )
    per_slice = len(slices[0])
    if any(len(s) != per_slice for s in slices):
        counts = {i: len(s) for i, s in enumerate(slices)}
        raise ValueError(f"Slices of unequal size (devices per slice: {counts}); cannot mesh them.")
    where = "" if len(slices) == 1 else f" per slice ({len(slices)} slices)"
    if sizes.count(-1) > 1:
        raise ValueError(f"At most one mesh axis may be -1, got {sizes}.")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if per_slice % rest:
            raise ValueError(
                f"{per_slice} devices{where} cannot be split by fixed mesh sizes {sizes}."
                + _CROSSING_HINT * (len(slices) > 1)
            )
        sizes[sizes.index(-1)] = per_slice // rest
    if math.prod(sizes) != per_slice:
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices{where}, "
            f"but {per_slice} are available{where}." + _CROSSING_HINT * (len(slices) > 1)
        )
    if len(slices) == 1:
        # TPU: the ICI-aware order (physical axes split only when no whole-axis product fits);
        # other platforms: the devices' own order (GPU: by id).
        arr = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    else:
        arr = mesh_utils.create_hybrid_device_mesh(
            sizes,
            (len(slices),) + (1,) * (len(MESH_AXES) - 1),
            devices,
            allow_split_physical_axes=True,
        )
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


_CROSSING_HINT = (
    " The sizes are per slice: fsdp and tensor never cross slices (their all-gathers would run "
    "over DCN) and the data axis is multiplied by the slice count, e.g. data=1, fsdp=-1 gives "
    "data over the slices and fsdp over each slice's chips."
)


def _axis_sizes(shape: dict[str, int] | Sequence[int]) -> list[int]:
    if isinstance(shape, dict):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(
                f"Unknown mesh axes {sorted(unknown)}; expected a subset of {MESH_AXES}."
            )
        return [int(shape.get(a, 1)) for a in MESH_AXES]
    sizes = [int(s) for s in shape]
    if len(sizes) != len(MESH_AXES):
        raise ValueError(f"Mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}.")
    return sizes


def _slices(devices) -> list[list]:
    """The devices grouped by `slice_index`, in slice order (one group where devices have none)."""
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(getattr(d, "slice_index", 0), []).append(d)
    return [groups[k] for k in sorted(groups)]


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules=None,
    exclude: Collection[str] = (),
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis is used at most once (first logical axis wins). When `shape` and `mesh` are
    given, mesh axes that do not divide the dimension are dropped (that dimension is replicated
    over them) rather than producing an invalid sharding. Axes in `exclude` are never used
    (inside a `shard_map` over them the array is already one block along them).
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
            if a in used or a in exclude:
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
    # Inside a shard_map over some axes (the sampler's per-replica programs) the array is
    # already this replica's block along them: only the automatic axes are constrained, and
    # only they count in whether a dimension divides. Counting the manual `data` axis too
    # replicated a replica's rows over `fsdp` where they split exactly (64 rows over fsdp 64
    # with data 2: XLA asked for 22.99 GiB of prefill temporaries on 2 x v5litepod-64).
    spec = logical_to_spec(axes, x.shape, mesh, exclude=mesh.manual_axes)
    return jax.lax.with_sharding_constraint(x, spec)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


# Mesh axes a parameter may be split over. No rule maps one to `data` on purpose: parameters
# are replicated over it so that each data-parallel replica samples on its own (axes.py).
PARAM_MESH_AXES = ("fsdp", "tensor")


def replicated_bytes(params) -> tuple[int, list[tuple[str, int]]]:
    """Parameter bytes held by more devices than the mesh's parameter axes could split them over.

    For a parameter split over mesh axes whose sizes multiply to `a`, on a mesh whose parameter
    axes (`PARAM_MESH_AXES`) multiply to `m`, a device holds `bytes / a` where it could hold
    `bytes / m`; the parameter's replicated bytes are `bytes * (1 - a / m)` (all of it for a
    fully replicated parameter).

    Args:
      params: a tree of arrays or `jax.ShapeDtypeStruct`s with `NamedSharding`s.

    Returns:
      (total parameter bytes, [(parameter path, replicated bytes)] for each parameter that has any,
      largest first).
    """
    total, worst = 0, []
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        total += nbytes
        mesh, spec = x.sharding.mesh, x.sharding.spec
        could = math.prod(mesh.shape[a] for a in PARAM_MESH_AXES if a in mesh.shape)
        used = {a for entry in spec if entry is not None for a in _axes_of(entry)}
        achieved = math.prod(mesh.shape[a] for a in used if a in PARAM_MESH_AXES)
        excess = nbytes - nbytes * achieved // could
        if excess:
            worst.append((jax.tree_util.keystr(path), excess))
    worst.sort(key=lambda item: -item[1])
    return total, worst


def check_replication(params, max_fraction: float = 0.01) -> None:
    """Fails when more than `max_fraction` of the parameter bytes are needlessly replicated.

    Call it once at start-up with the sharded parameters (or their abstract shapes), e.g.
    `sharding.check_replication(params)` after `create_model(cfg, mesh=mesh, ...)`: a rules
    table that leaves a large matrix unsplit on a mesh that could split it costs a chip its
    whole copy, and shows up only as an out-of-memory hours later.

    Raises:
      ValueError: naming the parameters that hold the most replicated bytes and their specs.
    """
    total, worst = replicated_bytes(params)
    replicated = sum(n for _, n in worst)
    if total and replicated > max_fraction * total:
        top = ", ".join(f"{name} ({n / 2**20:.1f} MiB)" for name, n in worst[:5])
        raise ValueError(
            f"{replicated / total:.1%} of the parameter bytes ({replicated / 2**30:.2f} GiB) are "
            f"replicated over mesh axes {PARAM_MESH_AXES} that could split them (limit "
            f"{max_fraction:.0%}); the largest: {top}. Map their logical axes to those mesh axes "
            "in config.mesh.rules, or choose a mesh whose axis sizes divide their dimensions."
        )


def _axes_of(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)
