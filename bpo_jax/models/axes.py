"""The sharding vocabulary: the mesh axes and the default logical-axis rules table.

The one definition of the rules table. `sharding` applies it (it is the default of
`axis_rules` / `logical_to_spec`), and `bpo_jax.experiment` copies it into every config as
`mesh.rules`, the field an experiment or a command line overrides. Nothing is imported here, so
that loading a config does not import JAX.
"""

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis (named in model code) -> the mesh axes it is split over. FSDP shards the
# parameters' embed dimension and the batch; tensor parallelism shards heads, the MLP width and
# the vocabulary. No rule maps a parameter axis to `data`: the parameters are replicated over it,
# which lets each data-parallel replica sample its rows on its own (bpo_jax/sampler/replicas.py).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
)
