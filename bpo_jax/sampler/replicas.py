"""Data-parallel replicas: each replica of the mesh's `data` axis samples its own rows.

When a KV cache's rows are split over the `data` axis (`init_cache(..., mesh=mesh)`), the
sampler wraps its prefill and decode programs in `per_replica`: a `shard_map` over that axis
alone, so each replica runs its rows with no communication inside the decode loop, while the
mesh's other axes (`fsdp`, `tensor`) stay automatic. Results are the same as one program over
the whole batch.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding

from bpo_jax.models.llama import KVCache

# The mesh axis of data-parallel replicas: the parameters are replicated over it (no sharding
# rule maps a parameter axis to it), so each replica can decode its rows on its own.
ROW_AXIS = "data"


def row_mesh(cache: KVCache) -> Mesh | None:
    """The mesh whose `ROW_AXIS` (of size > 1) splits the rows of `cache`, if there is one.

    The sampler then runs one program per replica on its own rows (`per_replica`).
    """
    sharding = getattr(cache.lengths, "sharding", None)
    if ROW_AXIS not in row_axes(sharding) or sharding.mesh.shape[ROW_AXIS] == 1:
        return None
    return sharding.mesh


def row_axes(sharding) -> tuple[str, ...]:
    """The mesh axes a NamedSharding splits dimension 0 (the rows) over; () for any other."""
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return ()
    first = sharding.spec[0]
    return (first,) if isinstance(first, str) else tuple(first or ())


def rows_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` laid out like `like` (a NamedSharding over its rows), if its row count allows."""
    axes = row_axes(like.sharding)
    if not axes or x.shape[0] % math.prod(like.sharding.mesh.shape[a] for a in axes):
        return x
    return jax.device_put(x, like.sharding)


def per_replica(fn, mesh: Mesh, in_specs, out_specs):
    """`fn` run by each replica of `mesh`'s ROW_AXIS on its own rows, with no communication.

    Rows are independent in a prefill and in a decode loop, so each replica runs them without
    a collective; the decode loop's exit test and the cache writes, partitioned by XLA over the
    whole batch instead, cost an all-reduce per step and an all-gather per layer and step. The
    mesh's other axes stay automatic, so a replica's parameters and rows may still be sharded
    over `fsdp` and `tensor`.
    """
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset({ROW_AXIS}),
        # The decode loop's carry starts from replicated constants (step 0, empty buffers) that
        # become per-replica values; the outputs' specs above say which are which.
        check_vma=False,
    )
