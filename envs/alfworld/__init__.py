"""ALFWorld household text games (Shridhar et al., ICLR 2021): gymnasium id
`bpo_jax/ALFWorld-v0`, short name "alfworld".

Used as in the example in `envs`: `load_tasks(None, "valid_seen")` (data root from
$ALFWORLD_DATA), `make_env("alfworld", max_steps=50)`; each task's `walkthrough` wins its game.
"""

from envs.alfworld.data import (
    DATA_ENV_VAR,
    DEFAULT_DATA_ROOT,
    SPLITS,
    TASK_TYPES,
    AlfworldTask,
    load_tasks,
    resolve_data_root,
    task_type_of,
)
from envs.alfworld.env import NOTHING_HAPPENS, WELCOME_RE, AlfworldEnv, normalize_action

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_ROOT",
    "NOTHING_HAPPENS",
    "SPLITS",
    "TASK_TYPES",
    "WELCOME_RE",
    "AlfworldEnv",
    "AlfworldTask",
    "load_tasks",
    "normalize_action",
    "resolve_data_root",
    "task_type_of",
]
