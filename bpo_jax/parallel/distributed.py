"""JAX's multi-host runtime: start-up, task shares, and the few collectives the host side needs.

One process per host (a TPU VM worker, or several processes on one machine over 127.0.0.1).
Every process runs the same program: the jitted update is one SPMD program over the global mesh
(its batch assembled from process-local rows, `global_batch`), while the rollouts are each
host's own: a host plays its shares of every batch of tasks (`my_shares`) with its own sandbox
pool, on its own devices (`local_mesh`, `to_local`), and the hosts then exchange what they
played (`allgather_objects`) so that every host holds the same forest, the same examples and
the same metrics. A share is played as one batch with its own key, so results depend on the
number of shares, never on the number of processes that play them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bpo_jax.models.axes import MESH_AXES

log = logging.getLogger(__name__)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> None:
    """Starts JAX's distributed runtime, when asked to.

    Args:
      coordinator_address: "HOST:PORT" of process 0's coordinator (CPUs and clusters without
        auto-detection); needs `num_processes` and `process_id` with it.
      num_processes, process_id: this run's process count and this process's index.
      auto: no address given: let JAX detect the cluster (TPU VM slices, SLURM, ...).

    Raises:
      ValueError: an address without the process count and index, or those without an address.
    """
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError(
                "--coordinator_address, --num_processes and --process_id go together, got "
                f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r}."
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id must lie in [0, {num_processes}), got {process_id}.")
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    elif auto:
        jax.distributed.initialize()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_lead() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def num_shares(configured: int) -> int:
    """Shares every batch of tasks is split into: `configured`, or one per process (0)."""
    return configured if configured > 0 else jax.process_count()


def share_slices(num_items: int, shares: int) -> list[slice]:
    """Contiguous, disjoint, near-equal slices of `num_items` items, one per share, in order."""
    bounds = np.linspace(0, num_items, shares + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def my_shares(shares: int) -> list[int]:
    """The shares this process plays: p, p + P, p + 2P, ... (P processes)."""
    return list(range(jax.process_index(), shares, jax.process_count()))


def share_key(rng, share: int, shares: int):
    """Share `share`'s key: `rng` itself when there is one share (a one-process run's key)."""
    return rng if shares == 1 else jax.random.fold_in(rng, share)


def local_key(key):
    """A PRNG key replicated over the global mesh as a key on this process's devices (rollouts
    fold indices into it on their own, without the other hosts); call under `on_local_mesh`."""
    if jax.process_count() == 1 or getattr(key, "is_fully_addressable", True):
        return key
    data = np.asarray(jax.random.key_data(key))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


@contextlib.contextmanager
def on_local_mesh():
    """This process's devices (`local_mesh` of the current mesh) as the current mesh, so that
    host-local work (rollouts) runs without the other hosts. A no-op with one process."""
    mesh = jax.sharding.get_mesh()
    if jax.process_count() == 1 or mesh.empty:
        yield
        return
    with jax.set_mesh(local_mesh(mesh)):
        yield


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable), in process order; every process gets the same list.

    A collective: every process must call it, in the same order.
    """
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    buf = np.zeros((int(sizes.max()),), np.uint8)
    buf[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [pickle.loads(gathered[p, : sizes[p]].tobytes()) for p in range(len(sizes))]


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier of this name."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def fetch(x: jax.Array) -> np.ndarray:
    """`x` as one host array on every process, also when its shards live on other hosts."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mesh_of(tree) -> Mesh | None:
    """The mesh of a pytree's first leaf with a `NamedSharding`, or None."""
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def global_batch(tree, mesh: Mesh, axes: Sequence[str] = ("data", "fsdp")):
    """A pytree of host arrays, the same on every process, as global arrays over `mesh`.

    The leading (row) dimension is split over the mesh `axes` that divide it, the rest
    replicated; each process contributes the rows its own devices hold
    (`jax.make_array_from_process_local_data`).
    """

    def put(x):
        x = np.asarray(x)
        kept, size = [], 1
        for a in axes:
            n = mesh.shape.get(a, 1)
            if x.ndim and n > 1 and x.shape[0] % (size * n) == 0:
                kept.append(a)
                size *= n
        spec = PartitionSpec(tuple(kept) if kept else None, *([None] * (x.ndim - 1)))
        sharding = NamedSharding(mesh, spec if x.ndim else PartitionSpec())
        local = x[_process_rows(sharding, x.shape)] if x.ndim else x  # A scalar: replicated.
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    return jax.tree.map(put, tree)


def _process_rows(sharding: NamedSharding, shape) -> slice:
    """The rows of a row-sharded array that this process's devices hold (one contiguous run)."""
    if not shape:
        return slice(None)
    index = sharding.addressable_devices_indices_map(tuple(shape))
    starts = [idx[0].start or 0 for idx in index.values()]
    stops = [shape[0] if idx[0].stop is None else idx[0].stop for idx in index.values()]
    return slice(min(starts), max(stops))


def local_mesh(global_mesh: Mesh) -> Mesh:
    """This process's devices as a mesh with the global mesh's axis names.

    The axes keep as much of their global size as the local devices allow, `tensor` first (a
    model too large for one device stays split the same way), then `fsdp`, then `data`; any
    remainder goes to `data` (more sampling replicas). With one process it is the global mesh.
    """
    if jax.process_count() == 1:
        return global_mesh
    return process_mesh(global_mesh, jax.process_index())


def process_mesh(global_mesh: Mesh, process: int) -> Mesh:
    """`local_mesh` of process `process` (any process can compute every other one's)."""
    devices = [d for d in global_mesh.devices.flat if d.process_index == process]
    if not devices:
        raise ValueError(
            f"Process {process} holds no device of the mesh {dict(global_mesh.shape)}."
        )
    left = len(devices)
    sizes = dict.fromkeys(MESH_AXES, 1)
    for a in ("tensor", "fsdp", "data"):
        sizes[a] = math.gcd(global_mesh.shape.get(a, 1), left)
        left //= sizes[a]
    sizes["data"] *= left
    from bpo_jax.models.sharding import make_mesh

    return make_mesh(sizes, devices=devices)


# The axis of `staging_mesh` over processes: a leaf is replicated over it, each process's copy
# laid out on that process's devices as its local mesh lays it out.
PROCESS_AXIS = "process"


def staging_mesh(global_mesh: Mesh, mesh: Mesh) -> Mesh:
    """The global mesh's devices as every process's local mesh, stacked along `PROCESS_AXIS`.

    A `NamedSharding` on it with a local-mesh spec puts on each device exactly the block that
    device holds in its process's local layout: resharding a global array to it is one SPMD
    program over all devices, after which each process's shards *are* its local array.

    Raises:
      ValueError: when `mesh` is not this process's `local_mesh` (the other processes could not
        know its layout), or the processes' local meshes differ in shape.
    """
    meshes = [process_mesh(global_mesh, p) for p in range(jax.process_count())]
    mine = meshes[jax.process_index()]
    if mine.axis_names != mesh.axis_names or not (mine.devices == mesh.devices).all():
        raise ValueError(
            f"to_local needs this process's local_mesh(global_mesh) {dict(mine.shape)}, got "
            f"the mesh {dict(mesh.shape)} over other devices or in another order."
        )
    shapes = {m.devices.shape for m in meshes}
    if len(shapes) != 1:
        raise ValueError(f"Processes' local meshes differ in shape ({sorted(shapes)}).")
    return Mesh(
        np.stack([m.devices for m in meshes]),
        (PROCESS_AXIS, *mesh.axis_names),
        axis_types=(AxisType.Auto,) * (1 + len(mesh.axis_names)),
    )


def to_local(tree, mesh: Mesh):
    """A pytree of global arrays as arrays on `mesh`, this process's `local_mesh`.

    Each leaf keeps its partition spec where `mesh` can hold it (mesh axes that do not divide
    the dimension are dropped). A leaf other processes hold shards of is resharded in one
    collective (every process calls `to_local` at the same point) to `staging_mesh`, where
    each device receives only its block of the local layout, e.g. 1/4 of a parameter on a
    host of 4 chips whose local mesh splits it 4 ways: no device ever holds a whole copy of a
    leaf it is not meant to hold whole. The received blocks become the local array as they are.
    """
    leaves = jax.tree.leaves(tree)
    if jax.process_count() == 1 or all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return tree
    global_mesh = next(x.sharding.mesh for x in leaves if not x.is_fully_addressable)
    staging = staging_mesh(global_mesh, mesh)

    def local_spec(x):
        return _fit_spec(getattr(x.sharding, "spec", PartitionSpec()), x.shape, mesh)

    def stage(x):
        if x.is_fully_addressable:  # Already on this process's devices: a local copy.
            return jax.device_put(x, NamedSharding(mesh, local_spec(x)))
        return jax.device_put(x, NamedSharding(staging, local_spec(x)))

    def localize(staged, x):
        local = NamedSharding(mesh, local_spec(x))
        if staged.is_fully_addressable:
            return staged
        return jax.make_array_from_single_device_arrays(
            x.shape, local, [s.data for s in staged.addressable_shards]
        )

    return jax.tree.map(localize, jax.tree.map(stage, tree), tree)


def _fit_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    out = []
    for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept, size = [], 1
        for a in axes:
            n = mesh.shape.get(a, 1)
            if shape[i] % (size * n) == 0:
                kept.append(a)
                size *= n
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)
