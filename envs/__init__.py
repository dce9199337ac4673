"""Text environments as gymnasium envs (envs/base.py), and their sandboxes (envs/sandbox).

Importing this package registers the gymnasium ids `bpo_jax/ALFWorld-v0`, `bpo_jax/WebShop-v0`,
`bpo_jax/RepoRepair-v0` and `bpo_jax/TabularTree-v0` (their modules load on first use).
"""

from envs.registry import register_gym_envs

register_gym_envs()
