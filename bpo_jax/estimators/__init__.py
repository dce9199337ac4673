"""Advantage estimators over a forest of segments, as jitted segment-sum kernels.

May import: nothing from bpo_jax.

The forest (see DESIGN.md) is a set of flat arrays. A *node* is a sandbox state with two or
more children (a task's initial state, or a branch point); a *segment* is a run of steps from a
node to the next node or to termination:

- `seg_parent: int32[S]`: the node segment s starts from; -1 marks a padding segment.
- `seg_child: int32[S]`: the node s ends at, or -1 when s ends at a terminal state (a leaf).
- `seg_reward: float32[S]`: the reward collected inside s.
- `num_nodes`: static number of node ids; ids that no segment uses are allowed.

Values are computed bottom-up, `V(s) = seg_reward[s] + mean(V(c) for c with seg_parent[c] ==
seg_child[s])`, by a `lax.while_loop` that runs one iteration per tree level (it stops when the
integer node heights stop changing, so the trip count is the forest's height + 1). Every
quantity is a `jax.ops.segment_sum` (or `segment_max`) over node ids plus gathers; there is no
Python loop over segments or nodes.

Conventions, fixed here for every estimator:
- Standard deviations are *population* std (divide by K, as `jnp.std` and most GRPO
  implementations in JAX do; PyTorch's `Tensor.std` default would be the sample std, K - 1).
- `eps` is added to the std, not under the square root: `A / (std + eps)`.
- Padding segments and padding steps get 0 everywhere.
- A node with fewer than two children is an error. With concrete inputs `tree_advantages`
  raises `ValueError` naming the node (`validate_forest`); under `jax.jit` inputs are tracers and
  cannot be checked, so the advantages of that node's children are NaN (loud, never a silent 0:
  a silent 0 is exactly the "early actions get no gradient" trap of DESIGN.md).

The modules, one role each:
- `kernels`: `tree_advantages`, `segment_weights`, `trajectory_weights`, `path_lengths`, and
  `expand_to_steps` / `expand_to_tokens` (the per-segment kernels).
- `structure`: the traced building blocks (index arrays, bottom-up and top-down level sweeps).
- `registry`: the `Forest` pytree, the estimator registry and `step_advantages`.
- `step_level`: the TreeRL and GiGPO estimators.
- `gae`: PPO's turn-level GAE (needs the critic's values).
- `baselines`: BPO's tree with the task's other backbones as baseline (`bpo_traj`), or a mix of
  them and the siblings (`bpo_shrink`, `shrink_lambda`).
- `decomposition`: f, the share of the return variance a branch point's history explains, and
  the per-decision advantage moments of the sibling and trajectory baselines, per branch point
  (`branch_stats`, `task_depth_parts`).
- `validation`: host-side checks (`validate_forest`).
"""

from bpo_jax.estimators.baselines import (  # registers "bpo_traj", "bpo_shrink"
    DEFAULT_SHRINK,
    bpo_shrink,
    bpo_traj,
    lambda_from_parts,
    shrink_lambda,
    shrunk_advantages,
)
from bpo_jax.estimators.decomposition import (
    PART_SUMS,
    BranchStats,
    branch_stats,
    task_depth_parts,
)
from bpo_jax.estimators.gae import gae, gae_advantages  # registers "gae"
from bpo_jax.estimators.kernels import (
    DEFAULT_EPS,
    METHODS,
    NORMALIZE,
    expand_to_steps,
    expand_to_tokens,
    path_lengths,
    segment_weights,
    trajectory_weights,
    tree_advantages,
)
from bpo_jax.estimators.registry import (
    Estimator,
    Forest,
    estimator_names,
    get_estimator,
    register_estimator,
    step_advantages,
)
from bpo_jax.estimators.step_level import gigpo, treerl  # registers them
from bpo_jax.estimators.validation import validate_forest

__all__ = [
    "DEFAULT_EPS",
    "DEFAULT_SHRINK",
    "METHODS",
    "NORMALIZE",
    "PART_SUMS",
    "BranchStats",
    "Estimator",
    "Forest",
    "bpo_shrink",
    "bpo_traj",
    "branch_stats",
    "estimator_names",
    "expand_to_steps",
    "expand_to_tokens",
    "gae",
    "gae_advantages",
    "get_estimator",
    "gigpo",
    "lambda_from_parts",
    "path_lengths",
    "register_estimator",
    "segment_weights",
    "shrink_lambda",
    "shrunk_advantages",
    "step_advantages",
    "task_depth_parts",
    "trajectory_weights",
    "tree_advantages",
    "treerl",
    "validate_forest",
]
