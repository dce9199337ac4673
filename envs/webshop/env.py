"""WebShop's text mode as a gymnasium env (`bpo_jax/WebShop-v0`, "webshop"): search, results,
item pages, buy.

Pages and the actions they take (WebShop's text mode, Yao et al. 2022):

- search: `search[query]` lists the best `SEARCH_RESULTS` products by BM25;
- results: 10 products a page; `click[<asin>]`, `click[next >]`, `click[< prev]`,
  `click[back to search]`;
- item: title, price, rating, option groups; `click[<option value>]` chooses that value in its
  group, `click[description]`, `click[features]`, `click[reviews]`, `click[buy now]`,
  `click[< prev]` (back to the results), `click[back to search]`;
- description / features / reviews: `click[< prev]` (back to the item), `click[back to search]`.

Anything in [brackets] on a page is clickable. `click[buy now]` ends the episode with WebShop's
reward (`envs.webshop.scoring`, computed as WebShop's code does by default); reaching
`max_steps` ends it with `truncated` and no reward. An action that is malformed or not
available on the page changes nothing and is answered with the reason, what is valid, and the
page again; it costs `invalid_format_penalty` if it is not `search[...]`/`click[...]` (or None),
`inadmissible_action_penalty` if it is but the page does not offer it (both 0 by default: WebShop
scores an invalid action 0).

The first observation states the task as "Your task is to: <instruction>" (the line the agent's
prompt builder takes the goal from); later pages repeat it only with `show_goal_every_page`.
"""

from __future__ import annotations

import re
from typing import Any

from envs.base import TextEnv
from envs.webshop.data import Catalog, Product, get_catalog, resolve_catalog
from envs.webshop.scoring import SCORINGS, TYPE_WORDS, score, spacy_nouns
from envs.webshop.tasks import RESULTS_PER_PAGE, SEARCH_RESULTS, WebShopTask, load_tasks

__all__ = ["WebShopEnv", "parse_action"]

_ACTION_RE = re.compile(r"^(search|click)\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)
_BACK = "back to search"
_NEXT = "next >"
_PREV = "< prev"
_BUY = "buy now"
_SUBPAGES = ("description", "features", "reviews")


def parse_action(action: str | None) -> tuple[str, str] | None:
    """Splits `search[...]` / `click[...]` into (kind, argument); None if it is neither.

    Case, surrounding whitespace, whitespace runs and a trailing period are forgiven; a click's
    argument is lower-cased (clickables are shown in lower case).
    """
    if action is None:
        return None
    text = " ".join(action.split()).rstrip(".").strip()
    m = _ACTION_RE.match(text)
    if m is None:
        return None
    kind, arg = m.group(1).lower(), m.group(2).strip()
    return kind, (arg.lower() if kind == "click" else arg)


def _clip(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return text[: max(limit - 3, 0)].rstrip() + "..."


class WebShopEnv(TextEnv):
    """One WebShop goal at a time.

    Rewards: the purchase's score (in [0, 1]) on `click[buy now]`, minus
    `invalid_format_penalty` for an action that is not `search[...]`/`click[...]` (or None) and
    `inadmissible_action_penalty` for one the page does not offer, else 0. The trainer's
    `invalid_action_penalty` is the format penalty.

    Info keys besides the common ones (`envs.base`; `won` is bought with reward 1): `action`
    (the normalised action, None at reset), `invalid_format` (the action was not
    `search[...]`/`click[...]`), `page`, and
    `available_actions` (every valid action on the page; `search[<query>]` stands for any
    search). `reset` adds `goal` (the instruction), `task_id` and `task_type`; the buying step
    adds `purchased` (ASIN), `chosen_options` and `score` (the reward's parts).

    Catalogs are read on the first reset that needs them and shared by every env of the
    process (and by processes forked from it). Pass `preload=True` with the catalog options
    to read one in the constructor, e.g. in a fork server before it forks its workers.
    `reset()` without a task draws one of the `test` goals (catalog from `$WEBSHOP_DATA`), or
    of the constructor's `tasks`.

    Example:
        env = WebShopEnv(max_steps=15)
        observation, info = env.reset(options={"task": task})
        for action in task.walkthrough:
            observation, reward, terminated, truncated, info = env.step(action)
    """

    task_class = WebShopTask
    load_tasks = staticmethod(load_tasks)  # (data_root, split, task_types, **options)
    default_split = "test"

    def __init__(
        self,
        max_steps: int = 15,
        invalid_action_penalty: float | None = None,
        *,
        invalid_format_penalty: float | None = None,
        inadmissible_action_penalty: float = 0.0,
        scoring: str = "upstream",
        type_words: str = "content_words",
        title_chars: int | None = None,
        text_chars: int | None = None,
        show_goal_every_page: bool = False,
        preload: bool = False,
        data_root: str | None = None,
        catalog: str = "small",
        products_file: str | None = None,
        cache_dir: str | None = None,
        tasks=None,
    ):
        """Creates the env.

        Args:
            max_steps: Episode length limit (15 in verl-agent's WebShop setting); the step that
                reaches it ends the episode with `info['truncated'] = True` unless it buys.
            invalid_action_penalty: The trainer's name for `invalid_format_penalty` (give one
                of the two, or both equal).
            invalid_format_penalty: Non-negative amount subtracted for an action that is not
                `search[...]` or `click[...]`, or None (default 0).
            inadmissible_action_penalty: Non-negative amount subtracted for a well-formed
                action the page does not offer (default 0, as WebShop scores it).
            scoring: "upstream" (WebShop's `get_reward`) or "project" (this project's first
                variant); see `envs.webshop.scoring`.
            type_words: Title words of the product-type check: "content_words" (default) or
                "spacy" (WebShop's nouns; needs spaCy and en_core_web_lg).
            title_chars: Cut product titles on results pages to this many characters (None or
                0: whole titles). Item pages always show the whole title.
            text_chars: Cut description and feature pages to this many characters (None or 0:
                all of it).
            show_goal_every_page: Repeat "Your task is to: ..." on every page, not only the
                first (WebShop's own pages repeat the instruction).
            preload: Read the catalog named by the next four arguments now.
            data_root, catalog, products_file, cache_dir: Which catalog to preload; see
                `envs.webshop.data.resolve_catalog`. Tasks name their own catalog, so these
                only decide what is read ahead of time.
            tasks: What `reset()` without a task draws from (default: the `test` split).

        Raises:
            ValueError: If an argument is out of range.
        """
        if invalid_format_penalty is None:
            invalid_format_penalty = invalid_action_penalty or 0.0
        elif (
            invalid_action_penalty is not None and invalid_action_penalty != invalid_format_penalty
        ):
            raise ValueError(
                f"invalid_action_penalty={invalid_action_penalty!r} and invalid_format_penalty="
                f"{invalid_format_penalty!r} name the same penalty (for a malformed action); "
                "give one of them."
            )
        if not 0 <= inadmissible_action_penalty < float("inf"):
            raise ValueError(
                "inadmissible_action_penalty must be finite and >= 0 (it is subtracted), got "
                f"{inadmissible_action_penalty!r}."
            )
        if scoring not in SCORINGS:
            raise ValueError(f"Unknown scoring {scoring!r}; expected one of {list(SCORINGS)}.")
        if type_words not in TYPE_WORDS:
            raise ValueError(
                f"Unknown type_words {type_words!r}; expected one of {list(TYPE_WORDS)}."
            )
        # The base class checks and keeps the format penalty as `invalid_action_penalty`.
        super().__init__(max_steps, invalid_format_penalty, tasks)
        self.inadmissible_action_penalty = float(inadmissible_action_penalty)
        self.scoring = scoring
        self.type_words = type_words
        if type_words == "spacy":
            spacy_nouns()  # Fails here, not at the first purchase, without spaCy's model.
        for name, value in (("title_chars", title_chars), ("text_chars", text_chars)):
            if value and (not isinstance(value, int) or value < 8):
                raise ValueError(f"{name} must be None, 0 or an int >= 8, got {value!r}.")
        self.title_chars = title_chars or None
        self.text_chars = text_chars or None
        self.show_goal_every_page = bool(show_goal_every_page)
        if preload:
            get_catalog(resolve_catalog(data_root or None, catalog, products_file, cache_dir))

        self._catalog: Catalog | None = None  # Not copied or pickled: found again by spec.
        self._page = "search"
        self._query = ""
        self._results: list[str] = []  # ASINs of the last search, best first.
        self._page_no = 1
        self._asin: str | None = None  # The item being looked at.
        self._chosen: dict[str, str] = {}  # Option group -> chosen value on the item page.

    @property
    def invalid_format_penalty(self) -> float:
        """What a malformed action costs (the base class's `invalid_action_penalty`)."""
        return self.invalid_action_penalty

    # Episode ------------------------------------------------------------------------------------

    def _start(self, task: WebShopTask) -> tuple[str, dict[str, Any]]:
        """Starts `task` on the search page.

        Raises:
            RuntimeError: If the goal's product is not in the task's catalog.
        """
        catalog = get_catalog(task.catalog)
        if catalog.get(task.goal.asin) is None:
            raise RuntimeError(
                f"Task {task.task_id}: its goal product {task.goal.asin} is not in the catalog "
                f"{task.catalog.products_path!r}; the task was made from another catalog."
            )
        self._catalog = catalog
        self._go_search()
        observation = f"Your task is to: {task.goal.instruction}\n{self._render()}"
        info = self._info(won=False, invalid=False, action=None)
        info["invalid_format"] = False
        info.update(goal=task.goal.instruction, task_id=task.task_id, task_type=task.task_type)
        return observation, info

    def _play(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """Plays one action; see the module and class docstrings."""
        parsed = parse_action(action)
        normalized = None if parsed is None else f"{parsed[0]}[{parsed[1]}]"
        error = self._why_invalid(action, parsed)
        extra: dict[str, Any] = {}
        reward, won, bought = 0.0, False, False
        if error is not None:
            reward = -(
                self.invalid_action_penalty if parsed is None else self.inadmissible_action_penalty
            )
            observation = f"Invalid action: {error}. {self._valid_hint()}\n{self._render()}"
        elif parsed[0] == "search":
            self._search(parsed[1])
            observation = self._render()
        elif parsed[1] == _BUY:
            bought = True
            result = self._buy()
            reward, won = result.reward, result.reward >= 1.0
            extra = {
                "purchased": self._asin,
                "chosen_options": dict(self._chosen),
                "score": result._asdict(),
            }
            observation = self._render_bought(result.reward)
        else:
            self._click(parsed[1])
            observation = self._render()
        if self.show_goal_every_page and not bought:
            observation = f"Your task is to: {self._task.goal.instruction}\n{observation}"
        info = self._info(won=won, invalid=error is not None, action=normalized)
        info["invalid_format"] = error is not None and parsed is None
        info.update(extra)
        return observation, float(reward), bought, info

    def __getstate__(self) -> dict[str, Any]:
        # Copies (the inprocess backend's deepcopy, pickling) share the read-only catalog
        # through the process cache instead of copying it.
        state = self.__dict__.copy()
        state["_catalog"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._task is not None:
            self._catalog = get_catalog(self._task.catalog)

    # State changes ------------------------------------------------------------------------------

    def _go_search(self) -> None:
        self._page, self._query, self._results, self._page_no = "search", "", [], 1
        self._asin, self._chosen = None, {}

    def _search(self, query: str) -> None:
        self._query = query
        self._results = [p.asin for p in self._catalog.search(query, SEARCH_RESULTS)]
        self._page, self._page_no = "results", 1

    def _click(self, target: str) -> None:
        page = self._page
        if target == _BACK:
            self._go_search()
        elif page == "results":
            if target == _NEXT:
                self._page_no += 1
            elif target == _PREV:
                self._page_no -= 1
            else:
                self._page, self._asin, self._chosen = "item", target.upper(), {}
        elif page == "item":
            if target == _PREV:
                self._page, self._asin, self._chosen = "results", None, {}
            elif target in _SUBPAGES:
                self._page = target
            else:
                for group, values in self._product().options:
                    if target in values:
                        self._chosen[group] = target
                        break
        elif page in _SUBPAGES and target == _PREV:
            self._page = "item"

    def _buy(self):
        goal = self._task.goal
        return score(
            self._product(),
            self._chosen,
            goal_attributes=goal.attributes,
            goal_options=goal.options,
            price_upper=goal.price_upper,
            goal_query=goal.query,
            goal_product_category=goal.product_category,
            goal_name=goal.name,
            scoring=self.scoring,
            type_words=self.type_words,
        )

    # Validity -----------------------------------------------------------------------------------

    def _why_invalid(self, action: str | None, parsed: tuple[str, str] | None) -> str | None:
        if parsed is None:
            if action is None or not action.strip():
                return "no action was given"
            return f"{_clip(' '.join(action.split()), 60)!r} is not search[...] or click[...]"
        kind, arg = parsed
        if kind == "search":
            if self._page != "search":
                return "search[...] only works on the search page; click[back to search] first"
            if not arg:
                return "search[] needs a query"
            return None
        if self._page == "search":
            return "there is nothing to click on the search page"
        if arg not in self._clickables():
            return f"[{_clip(arg, 60)}] is not on this page"
        return None

    def _valid_hint(self) -> str:
        if self._page == "search":
            return "Valid here: search[your query]."
        return "Valid here: click[x] for any [x] on the page."

    def _clickables(self) -> list[str]:
        page = self._page
        if page == "search":
            return []
        if page == "results":
            items = [a.lower() for a in self._page_asins()]
            buttons = [_BACK]
            if self._page_no > 1:
                buttons.append(_PREV)
            if self._page_no < self._num_pages():
                buttons.append(_NEXT)
            return items + buttons
        if page == "item":
            values = [v for _, vs in self._product().options for v in vs]
            return values + [*_SUBPAGES, _BUY, _PREV, _BACK]
        return [_PREV, _BACK]

    def _available_actions(self) -> list[str]:
        if self._page == "search":
            return ["search[<query>]"]
        return [f"click[{c}]" for c in self._clickables()]

    # Rendering ----------------------------------------------------------------------------------

    def _product(self) -> Product:
        product = self._catalog.get(self._asin)
        assert product is not None, self._asin
        return product

    def _num_pages(self) -> int:
        return max(1, -(-len(self._results) // RESULTS_PER_PAGE))

    def _page_asins(self) -> list[str]:
        start = (self._page_no - 1) * RESULTS_PER_PAGE
        return self._results[start : start + RESULTS_PER_PAGE]

    def _buttons(self, names: list[str]) -> str:
        return "Buttons: " + " ".join(f"[{n}]" for n in names)

    def _render(self) -> str:
        page = self._page
        if page == "search":
            return "You are on the search page. Type search[your query] to find products."
        if page == "results":
            buttons = [c for c in self._clickables() if c in (_BACK, _PREV, _NEXT)]
            if not self._results:
                return f'No products match "{self._query}".\n{self._buttons(buttons)}'
            lines = [
                f'Results for "{self._query}", page {self._page_no} of {self._num_pages()} '
                f"({len(self._results)} products):"
            ]
            for asin in self._page_asins():
                p = self._catalog.get(asin)
                lines.append(f"[{asin.lower()}] {_clip(p.name, self.title_chars)} ${p.price:.2f}")
            lines.append(self._buttons(buttons))
            return "\n".join(lines)
        p = self._product()
        if page == "item":
            lines = [
                f"Item {p.asin.lower()}: {p.name}",
                f"Price: ${p.price:.2f}. Rating: {p.rating}.",
            ]
            for group, values in p.options:
                chosen = self._chosen.get(group)
                note = f" (chosen: {chosen})" if chosen else ""
                lines.append(f"{group}: " + " ".join(f"[{v}]" for v in values) + note)
            lines.append(self._buttons([*_SUBPAGES, _BUY, _PREV, _BACK]))
            return "\n".join(lines)
        if page == "description":
            body = _clip(p.description or "(none)", self.text_chars)
        elif page == "features":
            body = _clip(" | ".join(p.features) or "(none)", self.text_chars)
        else:
            body = "(no reviews)"
        buttons = self._buttons([_PREV, _BACK])
        return f"{page.capitalize()} of item {p.asin.lower()}: {body}\n{buttons}"

    def _render_bought(self, reward: float) -> str:
        p = self._product()
        options = ", ".join(f"{g}: {v}" for g, v in self._chosen.items()) or "no options"
        return (
            f"You bought item {p.asin.lower()} ({_clip(p.name, 80)}) with {options} for "
            f"${p.price:.2f}. Score: {reward:.3f} (of 1). The episode is over."
        )

    def _info(self, *, won: bool, invalid: bool, action: str | None) -> dict:
        return {
            "won": won,
            "invalid_action": invalid,
            "action": action,
            "page": self._page,
            "available_actions": self._available_actions(),
        }
