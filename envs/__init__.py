"""Text environments as gymnasium envs (envs/base.py), and their sandboxes (envs/sandbox).

Importing this package registers the gymnasium ids `bpo_jax/ALFWorld-v0`, `bpo_jax/WebShop-v0`,
`bpo_jax/RepoRepair-v0` and `bpo_jax/TabularTree-v0` (their modules load on first use).

Example (each env the same way, by its short name; each package's docstring names its data root,
splits and step limit):
    from envs.base import load_tasks, make_env

    tasks = load_tasks("webshop", None, "test")  # data root from $WEBSHOP_DATA
    env = make_env("webshop", max_steps=15)
    observation, info = env.reset(options={"task": tasks[0]})
    for action in tasks[0].walkthrough:  # The task's expert solution, replayed.
        observation, reward, terminated, truncated, info = env.step(action)
"""

from envs.registry import register_gym_envs

register_gym_envs()
