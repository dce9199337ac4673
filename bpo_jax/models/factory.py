"""Builds `Transformer`s whose parameters are born sharded over a device mesh.

The model is traced once with `nnx.eval_shape` (no memory), each parameter's `logical_axes`
metadata is turned into a `NamedSharding` through the rules table, and the initialiser is jitted
with those shardings as `out_shardings`. XLA then computes each device's slice of every
parameter on that device: no parameter ever exists whole on one device, which is what lets a 7B
model initialise on chips that could not hold it unsharded.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bpo_jax.models import sharding
from bpo_jax.models.config import ModelConfig
from bpo_jax.models.llama import Transformer


def abstract_model(cfg: ModelConfig, *, seed: int = 0) -> Transformer:
    """The model with `jax.ShapeDtypeStruct`s in place of arrays (costs no device memory)."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))


def logical_axes_of(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The `logical_axes` metadata of a variable, or None when it has none."""
    return var.get_metadata().get("logical_axes")


def param_specs(abstract_state, mesh: Mesh, rules=None):
    """Shardings of a (possibly abstract) model state, from each variable's logical axes.

    Args:
      abstract_state: an `nnx.State` (e.g. from `nnx.split(abstract_model(cfg))`) whose variables
        hold arrays or `jax.ShapeDtypeStruct`s.
      mesh: the device mesh to shard over.
      rules: logical-axis rules; defaults to `sharding.current_rules()`.

    Returns:
      The same tree with each variable's value replaced by its `NamedSharding`. A dimension that
      the mapped mesh axes do not divide is replicated. Variables without `logical_axes` metadata
      are replicated.
    """

    def spec(var):
        if not isinstance(var, nnx.Variable):  # a bare array leaf: no metadata to go by
            return NamedSharding(mesh, PartitionSpec())
        axes = logical_axes_of(var)
        shape = var.get_value().shape  # var[...] would index a ShapeDtypeStruct
        if axes is None:
            return var.replace(NamedSharding(mesh, PartitionSpec()))
        if len(axes) != len(shape):
            raise ValueError(
                f"Variable of shape {shape} has logical_axes {axes} of a different rank; give one "
                "logical axis (or None) per dimension."
            )
        return var.replace(NamedSharding(mesh, sharding.logical_to_spec(axes, shape, mesh, rules)))

    return jax.tree.map(spec, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_model(
    cfg: ModelConfig, *, mesh: Mesh | None = None, rules=None, seed: int = 0
) -> Transformer:
    """Initialises a `Transformer`, sharded over `mesh` from birth when a mesh is given.

    Args:
      cfg: the architecture.
      mesh: optional device mesh; without one, the model is initialised on the default device.
      rules: logical-axis rules for the shardings (default: `sharding.current_rules()`).
      seed: PRNG seed of the parameter initialisers.

    Returns:
      The model. With a mesh, every parameter is a global array laid out by `param_specs`.
    """

    def init():
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    # Jitted even without a mesh, so that both paths run the same program: a seed gives the
    # same parameters whatever the mesh.
    graphdef, abstract_state = nnx.split(abstract_model(cfg, seed=seed))
    if mesh is None:
        return nnx.merge(graphdef, jax.jit(init)())
    state = jax.jit(init, out_shardings=param_specs(abstract_state, mesh, rules))()
    return nnx.merge(graphdef, state)
