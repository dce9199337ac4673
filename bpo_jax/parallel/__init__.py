"""JAX's multi-host runtime: processes, task shares, meshes and the host-side collectives.

What every layer that touches devices uses to place arrays and agree across hosts.

May import: models.

Modules: `distributed` (start-up, shares, `global_batch`, `to_local`, `allgather_objects`),
`platforms` (which JAX platforms a command starts: no TPU discovery without TPUs).
"""
