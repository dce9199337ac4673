"""Small, exactly solvable tree MDPs for testing estimators and rollout engines.

- `envs.tabular.mdp`: the MDP (`TreeMDP`) and its named instances (`make_mdp`);
- `envs.tabular.exact`: exact objective, gradient and return moments of a softmax policy;
- `envs.tabular.policy`: `TabularPolicy`, a softmax table with the LM policy's sampling
  interface, so the real rollout engine plays the MDP with an exactly known gradient;
- `envs.tabular.env`: `TabularEnv`, the MDP as a text env (gymnasium id `bpo_jax/TabularTree-v0`,
  short name "tabular"), and its task loader `load_tasks`.
"""

from envs.tabular.env import TabularEnv, TabularTask, load_tasks, mdp_tasks, parse_action
from envs.tabular.exact import (
    BranchMoments,
    Trajectories,
    branch_moments,
    enumerate_trajectories,
    objective,
    objective_grad,
    policy_probs,
    prefix_rewards,
    random_logits,
    reward_to_go_moments,
    state_visit_probs,
    trajectory_probs,
)
from envs.tabular.mdp import (
    INSTANCES,
    TreeMDP,
    first_action_decides_mdp,
    generic_mdp,
    make_mdp,
    optimal_actions,
    reward_density_mdp,
)

__all__ = [
    "INSTANCES",
    "BranchMoments",
    "TabularEnv",
    "TabularTask",
    "Trajectories",
    "TreeMDP",
    "branch_moments",
    "enumerate_trajectories",
    "first_action_decides_mdp",
    "generic_mdp",
    "load_tasks",
    "mdp_tasks",
    "make_mdp",
    "objective",
    "objective_grad",
    "optimal_actions",
    "parse_action",
    "policy_probs",
    "prefix_rewards",
    "random_logits",
    "reward_density_mdp",
    "reward_to_go_moments",
    "state_visit_probs",
    "trajectory_probs",
]
