"""WebShop goals (instructions to buy something), their splits, expert walkthroughs and tasks.

Goals are made as WebShop makes them:
- synthetic (from the attribute file): for every product with an `instruction`, one goal per
  combination of its option values, "<instruction> with <group>: <value>, and ... , and price
  lower than <limit> dollars"; the goal's attributes are the instruction's attributes;
- human (from `items_human_ins.json`): each written instruction plus the price text.
The price limit is the larger of two draws from the first four multiples of $10 above the
product's price (none, and no price text, when fewer than two exist). Draws are seeded per
goal, so goals are the same in every process.

Splits follow WebShop's: all goals shuffled with seed 233, then the first `split_sizes[0]` are
"test", the next `split_sizes[1]` "eval", the rest "train" (500 and 1,000 by default).

Each task carries an expert walkthrough that earns reward 1: search (the goal product's query
if that lists it on the first page, else the instruction), go to the page that lists it, click
it, click the goal's options, buy.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
from collections.abc import Sequence

from envs.base import Task, check_task_types
from envs.webshop.data import (
    HUMAN_GOALS_FILE,
    Catalog,
    CatalogSpec,
    Product,
    get_catalog,
    resolve_catalog,
    resolve_data_root,
    verified_file,
)
from envs.webshop.scoring import option_matches

__all__ = [
    "GOAL_SOURCES",
    "RESULTS_PER_PAGE",
    "SEARCH_RESULTS",
    "SPLITS",
    "SPLIT_SEED",
    "TASK_TYPES",
    "Goal",
    "WebShopTask",
    "human_goals",
    "load_tasks",
    "split_goals",
    "synthetic_goals",
    "walkthrough",
]

SPLITS = ("train", "eval", "test")
SPLIT_SEED = 233  # WebShop's shuffle seed for its goal list.
DEFAULT_SPLIT_SIZES = (500, 1000)  # (test, eval); train is the rest.
# WebShop's top-level product categories; a task's type is its goal product's category.
TASK_TYPES = ("beauty", "electronics", "fashion", "food", "furniture")
GOAL_SOURCES = ("auto", "synthetic", "human")
# The results page lists 10 products of the top 50 search hits (WebShop's numbers).
RESULTS_PER_PAGE = 10
SEARCH_RESULTS = 50
_PRICE_STEPS = [10.0 * i for i in range(1, 100)]
_NO_LIMIT = 1_000_000.0


@dataclasses.dataclass(frozen=True)
class Goal:
    """What to buy.

    Attributes:
        asin: The product the goal was made from (another product can satisfy it too).
        instruction: The text the agent is given.
        attributes: Attributes the product should have.
        options: (group, value) the product should be bought with; group is "" for human goals,
            whose options name only values.
        price_upper: Price limit in dollars (1e6: none).
        query, name, product_category, category: The goal product's search query, title,
            breadcrumb and top-level category (for the type check and task types).
        source: "synthetic" or "human".
    """

    asin: str
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    price_upper: float
    query: str
    name: str
    product_category: str
    category: str
    source: str


@dataclasses.dataclass(frozen=True)
class WebShopTask(Task):
    """One WebShop episode: a goal in a catalog.

    Attributes:
        task_id: "<split>/<goal index>/<asin>", the index into the shuffled goal list.
        goal: What to buy.
        catalog: The catalog the goal lives in (the env loads it by this spec).
        split: One of `SPLITS`.
        task_type: The goal product's category (one of `TASK_TYPES` for WebShop's data).
        walkthrough: Expert actions that buy the goal product with its options (reward 1).
    """

    goal: Goal
    catalog: CatalogSpec
    split: str
    task_type: str
    walkthrough: tuple[str, ...]


def _price_limit(rng: random.Random, price: float) -> tuple[float, str]:
    above = [p for p in _PRICE_STEPS if p > price][:4]
    if len(above) < 2:
        return _NO_LIMIT, ""
    upper = max(rng.sample(above, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def _goal(
    product: Product,
    source: str,
    instruction: str,
    attributes: tuple[str, ...],
    options: tuple[tuple[str, str], ...],
    price_upper: float,
) -> Goal:
    """A goal made from `product`: its ASIN, query, title and categories, and the rest given."""
    return Goal(
        asin=product.asin,
        instruction=instruction,
        attributes=attributes,
        options=options,
        price_upper=price_upper,
        query=product.query,
        name=product.name,
        product_category=product.product_category,
        category=product.category,
        source=source,
    )


def synthetic_goals(catalog: Catalog) -> list[Goal]:
    """One goal per option combination of every product with an instruction, in catalog order."""
    goals = []
    for p in catalog.products:
        if not p.instruction or not p.instruction_attributes:
            continue
        groups = sorted(p.options)
        for combo in itertools.product(*(values for _, values in groups)):
            chosen = tuple(zip((g for g, _ in groups), combo))
            option_text = ", and ".join(f"{g}: {v}" for g, v in chosen)
            rng = random.Random(f"webshop-goal:{p.asin}:{option_text}")
            upper, price_text = _price_limit(rng, p.price)
            with_text = f" with {option_text}" if option_text else ""
            instruction = f"{p.instruction}{with_text}{price_text}"
            goals.append(
                _goal(p, "synthetic", instruction, p.instruction_attributes, chosen, upper)
            )
    return goals


def human_goals(catalog: Catalog, human: dict) -> list[Goal]:
    """Goals from `items_human_ins.json` (ASIN -> list of instructions) for catalog products."""
    goals = []
    for p in catalog.products:
        for i, entry in enumerate(human.get(p.asin) or ()):
            attributes = tuple(entry.get("instruction_attributes") or ())
            if not attributes:  # WebShop skips these too.
                continue
            options = entry.get("instruction_options") or ()
            # Values as written: WebShop scores them so (its exact "size" match and colour
            # reduction are case-sensitive; the chosen values are lower case).
            if isinstance(options, dict):
                options = tuple((str(g).lower(), str(v)) for g, v in options.items())
            else:
                options = tuple(("", str(v)) for v in options)
            text = str(entry.get("instruction") or "").strip().strip(".")
            rng = random.Random(f"webshop-human-goal:{p.asin}:{i}:{text}")
            upper, price_text = _price_limit(rng, p.price)
            goals.append(_goal(p, "human", text + price_text, attributes, options, upper))
    return goals


def split_goals(
    goals: Sequence[Goal], split: str, split_sizes: Sequence[int] = DEFAULT_SPLIT_SIZES
) -> list[tuple[int, Goal]]:
    """(index, goal) of one split after WebShop's shuffle; see the module docstring."""
    if split not in SPLITS:
        raise ValueError(f"Unknown WebShop split {split!r}; expected one of {list(SPLITS)}.")
    n_test, n_eval = (int(n) for n in split_sizes)
    if n_test < 0 or n_eval < 0:
        raise ValueError(f"split_sizes must be two non-negative counts, got {split_sizes!r}.")
    indexed = list(enumerate(goals))
    random.Random(SPLIT_SEED).shuffle(indexed)
    ranges = {
        "test": (0, n_test),
        "eval": (n_test, n_test + n_eval),
        "train": (n_test + n_eval, len(indexed)),
    }
    start, stop = ranges[split]
    return [(pos, goal) for pos, (_, goal) in enumerate(indexed) if start <= pos < stop]


def _option_clicks(catalog: Catalog, goal: Goal) -> list[str]:
    """The option values to click for a goal, one per goal option the product can match."""
    product = catalog.get(goal.asin)
    clicks = []
    for group, value in goal.options:
        candidates = product.option_values(group) if group else ()
        if value.lower() in candidates:
            clicks.append(value.lower())
            continue
        # Human goals name values only, in their own words: take the first value that matches.
        for _, values in product.options:
            match = next((v for v in values if option_matches([v], [value])), None)
            if match is not None:
                clicks.append(match)
                break
    return clicks


def _base_instruction(catalog: Catalog, goal: Goal) -> str:
    """The instruction without the option and price text appended to it."""
    if goal.source == "synthetic":
        return catalog.get(goal.asin).instruction or ""
    return re.sub(r", and price lower than [\d.]+ dollars$", "", goal.instruction)


def walkthrough(catalog: Catalog, goal: Goal) -> tuple[str, ...]:
    """Expert actions for `goal`: search, page to the product, click it, its options, buy.

    The query is the goal product's own search query if that lists the product on the first
    results page, else the first of (instruction without options and price, full instruction)
    that does, else the one that ranks it highest. If no query finds it in the top
    `SEARCH_RESULTS`, the walkthrough is just the search (it does not win).
    """
    candidates = (goal.query, _base_instruction(catalog, goal), goal.instruction)
    queries = [q for q in candidates if q.strip()]
    best: tuple[int, str] | None = None
    for query in queries:
        rank = catalog.rank_of(query, goal.asin, SEARCH_RESULTS)
        if rank is not None and (best is None or rank < best[0]):
            best = (rank, query)
        if rank is not None and rank < RESULTS_PER_PAGE:
            break
    if best is None:
        return (f"search[{queries[0]}]",)
    rank, query = best
    actions = [f"search[{query}]"]
    actions += ["click[next >]"] * (rank // RESULTS_PER_PAGE)
    actions.append(f"click[{goal.asin.lower()}]")
    actions += [f"click[{v}]" for v in _option_clicks(catalog, goal)]
    actions.append("click[buy now]")
    return tuple(actions)


# (catalog spec, source, human file) -> goals; goal lists are built once per process.
_GOALS: dict[tuple, list[Goal]] = {}


def load_tasks(
    root: str | os.PathLike[str] | None,
    split: str,
    task_types: Sequence[str] | None = None,
    *,
    catalog: str = "small",
    products_file: str | None = None,
    goals: str = "auto",
    split_sizes: Sequence[int] = DEFAULT_SPLIT_SIZES,
    limit: int | None = None,
    cache_dir: str | None = None,
) -> list[WebShopTask]:
    """Lists the tasks of one split.

    Args:
        root: Data root (None or "": `$WEBSHOP_DATA`, else the default).
        split: "train", "eval" or "test".
        task_types: Keep goals whose product category is one of these; None keeps all.
        catalog: "small" or "full" (see `envs.webshop.data.CATALOGS`).
        products_file: Use this product file (same schema) instead of the catalog's, e.g. the
            test fixture; attributes still come from the data root.
        goals: "synthetic", "human" (needs `items_human_ins.json`), or "auto": human when that
            file is in the data root, else synthetic.
        split_sizes: (test, eval) goal counts; train is the rest.
        limit: Keep at most this many tasks (in split order).
        cache_dir: Where the search index is cached (see `resolve_catalog`).

    Returns:
        Tasks in split order, each with its goal and walkthrough.

    Raises:
        FileNotFoundError, envs.webshop.data.DataIntegrityError: For missing or altered data.
        ValueError: For an unknown split, task type, goal source, or a bad limit.
    """
    check_task_types(task_types, TASK_TYPES, env="WebShop", noun="categories")
    if goals not in GOAL_SOURCES:
        raise ValueError(f"Unknown goal source {goals!r}; expected one of {list(GOAL_SOURCES)}.")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative or None, got {limit}.")
    if split not in SPLITS:
        raise ValueError(f"Unknown WebShop split {split!r}; expected one of {list(SPLITS)}.")

    spec = resolve_catalog(root, catalog, products_file, cache_dir)
    cat = get_catalog(spec)
    data_root = resolve_data_root(root)
    human_path = None
    if goals == "human" or (goals == "auto" and (data_root / HUMAN_GOALS_FILE).is_file()):
        human_path, _ = verified_file(data_root, HUMAN_GOALS_FILE)
    key = (spec, str(human_path))
    if key not in _GOALS:
        if human_path is None:
            _GOALS[key] = synthetic_goals(cat)
        else:
            with open(human_path) as f:
                _GOALS[key] = human_goals(cat, json.load(f))
    wanted = None if task_types is None else set(task_types)
    tasks = []
    for index, goal in split_goals(_GOALS[key], split, split_sizes):
        if wanted is not None and goal.category not in wanted:
            continue
        if limit is not None and len(tasks) >= limit:
            break
        tasks.append(
            WebShopTask(
                task_id=f"{split}/{index}/{goal.asin}",
                goal=goal,
                catalog=spec,
                split=split,
                task_type=goal.category,
                walkthrough=walkthrough(cat, goal),
            )
        )
    return tasks
