"""WebShop's reward: how well a bought product (with the options chosen) fits a goal.

The rule of Yao et al. (2022), section 3.2 and the WebShop code's `get_reward`:

    reward = r_type * (attributes matched + options matched + [price <= limit])
                    / (goal attributes + goal options + 1)

- an attribute of the goal matches if some attribute of the product is a fuzzy match
  (`token_set_ratio > 85` on lower-cased alphanumeric tokens, as fuzzywuzzy's default
  processing does; rapidfuzz computes it), or if it appears verbatim in the product's title,
  features or description;
- an option of the goal matches if some chosen option value is a fuzzy match (`> 85`), after
  reducing both to a basic color word when they name one ("navy blue" -> "navy");
- `r_type` in {0, 0.1, 0.5, 1} checks that the product is the right kind of thing: same search
  query, two shared levels of the category breadcrumb, or enough shared title words.

One deliberate difference: WebShop compares the nouns of the two titles (spaCy part-of-speech
tags); this compares their content words (lower-case words of two or more letters, English
stop words and numbers removed), which needs no language model and agrees on product titles
where the nouns carry the type. The reward of the goal's own product with the goal's options is
1 either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from rapidfuzz import fuzz, utils

from envs.webshop.data import Product

__all__ = [
    "COLORS",
    "FUZZY_THRESHOLD",
    "Score",
    "attribute_matches",
    "normalize_color",
    "option_matches",
    "score",
    "title_words",
    "type_reward",
]

FUZZY_THRESHOLD = 85

# Basic color words an option value is reduced to (its first one, by position in the value),
# so that "navy blue" and "navy" or "heather gray" and "gray" count as the same color.
# Modifiers ("light", "dark") are left out on purpose: "light blue" reduces to "blue".
COLORS = frozenset(
    """
    beige black blonde blue blush bronze brown burgundy camel charcoal chocolate coffee copper
    coral cream gold gray green grey ivory khaki lavender lilac maroon mint multicolor navy nude
    olive orange peach pink plum purple red rose ruby rust sage silver tan taupe teal turquoise
    violet walnut white wine yellow
    """.split()
)

# English function words (and a few shopping words with no type information) left out of title
# comparisons.
_STOP_WORDS = frozenset(
    """
    a an and are as at be by for from has have in is it its of on or our that the their this to
    with without your you we new pack count set piece pieces inch inches oz ounce ounces fl lb
    pound pounds ft feet cm mm size sizes
    """.split()
)
_WORD_RE = re.compile(r"[a-z][a-z']*[a-z]")


class Score(NamedTuple):
    """A purchase's reward and its parts (the parts are what WebShop logs).

    Attributes:
        reward: In [0, 1].
        r_type: Product-type factor (0, 0.1, 0.5 or 1).
        r_att: Fraction of the goal's attributes matched.
        r_option: Fraction of the goal's options matched (None when the goal has none).
        r_price: Whether the price is within the goal's limit.
        query_match, category_match, title_score: What `r_type` was decided from.
    """

    reward: float
    r_type: float
    r_att: float
    r_option: float | None
    r_price: bool
    query_match: bool
    category_match: bool
    title_score: float


def normalize_color(value: str) -> str:
    """The first basic color word in `value` ("grey" read as "gray"), else `value` itself."""
    for word in re.findall(r"[a-z]+", value.lower()):
        if word in COLORS:
            return "gray" if word == "grey" else word
    return value.lower()


def _similar(a: str, b: str) -> bool:
    # Token-set similarity on lower-cased alphanumeric tokens: "x-large" contains "large".
    return fuzz.token_set_ratio(a, b, processor=utils.default_process) > FUZZY_THRESHOLD


def title_words(title: str) -> set[str]:
    """Content words of a title (lower case, stop words and numbers dropped)."""
    return {w for w in _WORD_RE.findall(title.lower()) if w not in _STOP_WORDS}


def _categories(breadcrumb: str) -> set[str]:
    return {level.strip().lower() for level in breadcrumb.split("›") if level.strip()}


def type_reward(
    product: Product, goal_query: str, goal_product_category: str, goal_name: str
) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score) of buying `product` for a goal.

    `title_score` is the fraction of the goal product's title words that the bought title has
    (0.2 when the goal title has none). `r_type` is 1 if the query matches, or two breadcrumb
    levels match, or `title_score > 0.2`; else 0.5; and it drops to 0.1 when `title_score < 0.1`
    and to 0 when no title word is shared.
    """
    query_match = product.query == goal_query
    shared_levels = _categories(product.product_category) & _categories(goal_product_category)
    category_match = len(shared_levels) >= 2
    want = title_words(goal_name)
    got = title_words(product.name)
    title_score = len(want & got) / len(want) if want else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Product, goal_attributes: Iterable[str]) -> int:
    """How many goal attributes the product has (fuzzy in its attributes, or verbatim in text)."""
    text = (product.name, " ".join(product.features), product.description)
    text = tuple(t.lower() for t in text)
    count = 0
    for wanted in goal_attributes:
        wanted_l = wanted.lower()
        if any(_similar(have, wanted) for have in product.attributes):
            count += 1
        elif any(wanted_l in t for t in text):
            count += 1
    return count


def option_matches(chosen_values: Iterable[str], goal_values: Iterable[str]) -> int:
    """How many goal option values some chosen value matches (fuzzy, colors reduced)."""
    chosen = [normalize_color(v) for v in chosen_values]
    count = 0
    for wanted in goal_values:
        wanted_n = normalize_color(wanted)
        if any(_similar(have, wanted_n) for have in chosen):
            count += 1
    return count


def score(
    product: Product,
    chosen_options: Mapping[str, str],
    *,
    goal_attributes: Iterable[str],
    goal_option_values: Iterable[str],
    price_upper: float,
    goal_query: str,
    goal_product_category: str,
    goal_name: str,
) -> Score:
    """The reward of buying `product` with `chosen_options` ({group: value}) for a goal.

    Args:
        product: The product bought.
        chosen_options: The option values selected on its page, by group.
        goal_attributes: The attributes the instruction asks for.
        goal_option_values: The option values it asks for.
        price_upper: The price limit (the product's `price` is compared to it).
        goal_query, goal_product_category, goal_name: The goal product's search query,
            breadcrumb and title (for the type check).
    """
    attributes = list(goal_attributes)
    options = list(goal_option_values)
    r_type, query_match, category_match, title_score = type_reward(
        product, goal_query, goal_product_category, goal_name
    )
    n_att = attribute_matches(product, attributes)
    n_opt = option_matches(chosen_options.values(), options)
    r_price = product.price <= price_upper
    total = (n_att + n_opt + int(r_price)) / (len(attributes) + len(options) + 1)
    return Score(
        reward=total * r_type,
        r_type=r_type,
        r_att=n_att / len(attributes) if attributes else 1.0,
        r_option=n_opt / len(options) if options else None,
        r_price=r_price,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
    )
