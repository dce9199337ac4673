"""WebShop (Yao et al., NeurIPS 2022) in text mode: gymnasium id `bpo_jax/WebShop-v0`, short
name "webshop".

Used as in the example in `envs`: `load_tasks(None, "test")` (data root from $WEBSHOP_DATA),
`make_env("webshop", max_steps=15)`; each task's `walkthrough` solves it.
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
