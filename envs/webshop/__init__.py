"""WebShop (Yao et al., NeurIPS 2022) in text mode: gymnasium id `bpo_jax/WebShop-v0`, short
name "webshop".

Example:
    from envs.webshop import load_tasks
    from envs.base import make_env

    tasks = load_tasks(None, "test")  # data root from $WEBSHOP_DATA
    env = make_env("webshop", max_steps=15)
    observation, info = env.reset(options={"task": tasks[0]})
    for action in tasks[0].walkthrough:
        observation, reward, terminated, truncated, info = env.step(action)
"""

from envs.webshop.data import (
    CACHE_ENV_VAR,
    CATALOGS,
    DATA_ENV_VAR,
    SHA256,
    Catalog,
    CatalogSpec,
    DataIntegrityError,
    Product,
    get_catalog,
    resolve_catalog,
    resolve_data_root,
)
from envs.webshop.env import WebShopEnv, parse_action
from envs.webshop.scoring import Score, score
from envs.webshop.tasks import (
    RESULTS_PER_PAGE,
    SEARCH_RESULTS,
    SPLITS,
    TASK_TYPES,
    Goal,
    WebShopTask,
    load_tasks,
    walkthrough,
)

__all__ = [
    "CACHE_ENV_VAR",
    "CATALOGS",
    "DATA_ENV_VAR",
    "RESULTS_PER_PAGE",
    "SEARCH_RESULTS",
    "SHA256",
    "SPLITS",
    "TASK_TYPES",
    "Catalog",
    "CatalogSpec",
    "DataIntegrityError",
    "Goal",
    "Product",
    "Score",
    "WebShopEnv",
    "WebShopTask",
    "get_catalog",
    "load_tasks",
    "parse_action",
    "resolve_catalog",
    "resolve_data_root",
    "score",
    "walkthrough",
]
