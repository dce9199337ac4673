"""WebShop's reward: how well a bought product (with the options chosen) fits a goal.

The rule of Yao et al. (2022), section 3.2, as WebShop's `web_agent_site/engine/goal.py`
(`get_reward`) computes it:

    reward = r_type * (attributes matched + options matched + [price <= limit])
                    / (goal attributes + goal options + 1)

`scoring="upstream"` (the default) counts as that code does:
- an attribute of the goal matches if some attribute of the product is a fuzzy match
  (thefuzz 0.19.0's `token_set_ratio > 85`, `envs.webshop.fuzz`; a product without attributes
  has WebShop's placeholder "DUMMY_ATTR"), or if it appears verbatim in the product's lower-cased
  title, features or description;
- options are counted over the chosen (group, value) pairs, each value reduced by WebShop's
  `normalize_color` (the first of its colour words, in its list's order, found anywhere in the
  value: "navy blue" -> "blue", "dark grey" -> "dark"): a chosen "size" must equal a goal
  option value, any other group's value must be a fuzzy match of one, and a value that matches
  no goal option still counts if it appears in the title, features or description;
- `r_type` in {0, 0.1, 0.5, 1}: 1 if the search queries are equal, or two breadcrumb levels
  are (compared as written), or more than 0.2 of the goal title's words are in the bought
  title; 0.5 otherwise; 0.1 below 0.1 of them and 0 with none.

The one part not reproduced by default: WebShop's title words are the nouns spaCy's
`en_core_web_lg` tags in each title. spaCy is on PyPI, but that model is not (it is published
outside the package registries), so `type_words="content_words"` (default) takes the lower-case
words of two or more letters, stop words and numbers left out; `type_words="spacy"` uses
spaCy's nouns where spaCy and the model are installed. The reward of the goal's own product
with the goal's options is 1 either way.

`scoring="project"` is this project's first variant, kept for comparison: options matched per
goal value against the chosen values, all fuzzily (rapidfuzz), colours reduced to a basic
colour word by position ("navy blue" -> "navy", "grey" read as "gray"), attributes compared
case-insensitively, breadcrumbs lower-cased, and the title words counted as sets.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from rapidfuzz import fuzz, utils

from envs.webshop import fuzz as upstream_fuzz
from envs.webshop.data import Product

__all__ = [
    "COLORS",
    "EXACT_MATCH_GROUPS",
    "FUZZY_THRESHOLD",
    "SCORINGS",
    "TYPE_WORDS",
    "UPSTREAM_COLORS",
    "Score",
    "attribute_matches",
    "normalize_color",
    "option_matches",
    "score",
    "spacy_nouns",
    "title_words",
    "type_reward",
    "upstream_attribute_matches",
    "upstream_normalize_color",
    "upstream_option_matches",
]

SCORINGS = ("upstream", "project")
TYPE_WORDS = ("content_words", "spacy")

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

# WebShop's `COLOR_SET` (web_agent_site/engine/normalize.py), in its order: the first one that
# is a substring of a value is what the value reduces to.
UPSTREAM_COLORS = tuple(
    """
    alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown
    burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee
    cognac copper coral cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold
    granite grape graphite grass gray green grey heather indigo ivory ivy khaki lavender lemon
    leopard light lilac lime magenta maroon mauve merlot midnight mint mocha multicolor mushroom
    mustard natural navy nude olive orange peach pewter pink plum purple rainbow red rose royal
    rust sand sapphire seashell silver skull slate steel stone stonewash sunflower tan taupe teal
    tiger turquoise violet walnut wheat white wine yellow
    """.split()
)

# Option groups whose chosen value must equal a goal value (WebShop's `EXACT_MATCH_OPTS`).
EXACT_MATCH_GROUPS = ("size",)

# What WebShop gives a product with no attributes in the attribute file.
_NO_ATTRIBUTES = ("DUMMY_ATTR",)

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
        reward: In [0, 1] (upstream: above 1 where more option groups are chosen than the goal
            names and the extra ones appear in the product text, as in WebShop).
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
    """The project's colour reduction: the first basic colour word in `value` by position
    ("grey" read as "gray"), else `value` lower-cased (`scoring="project"`)."""
    for word in re.findall(r"[a-z]+", value.lower()):
        if word in COLORS:
            return "gray" if word == "grey" else word
    return value.lower()


def upstream_normalize_color(value: str) -> str:
    """WebShop's `normalize_color`: the first of `UPSTREAM_COLORS` that occurs in `value` (as a
    substring, case-sensitive), else `value` unchanged."""
    return next((color for color in UPSTREAM_COLORS if color in value), value)


def _similar(a: str, b: str) -> bool:
    # rapidfuzz token-set similarity on lower-cased alphanumeric tokens: "x-large" has "large".
    return fuzz.token_set_ratio(a, b, processor=utils.default_process) > FUZZY_THRESHOLD


def _upstream_similar(a: str, b: str) -> bool:
    return upstream_fuzz.token_set_ratio(a, b) > FUZZY_THRESHOLD


def title_words(title: str) -> list[str]:
    """Content words of a title in order, repeats kept (lower case, stop words and numbers
    dropped): `type_words="content_words"`, the stand-in for spaCy's nouns."""
    return [w for w in _WORD_RE.findall(title.lower()) if w not in _STOP_WORDS]


@functools.cache
def spacy_nouns(model: str = "en_core_web_lg") -> Callable[[str], list[str]]:
    """WebShop's title words: the lower-cased tokens spaCy's `model` tags as nouns.

    Raises:
        ValueError: If spaCy or the model is not installed, saying how WebShop installs them.
    """
    try:
        import spacy

        nlp = spacy.load(model)
    except (ImportError, OSError) as error:
        raise ValueError(
            f"type_words='spacy' needs spaCy and its {model} model ({error}); WebShop installs "
            f"them with `pip install spacy==3.3.0 && python -m spacy download {model}`. Without "
            "them use type_words='content_words'."
        ) from error

    def nouns(title: str) -> list[str]:
        return [t.text.lower() for t in nlp(title) if t.pos_ in ("PNOUN", "NOUN", "PROPN")]

    return nouns


def _title_word_function(type_words: str) -> Callable[[str], list[str]]:
    if type_words == "content_words":
        return title_words
    if type_words == "spacy":
        return spacy_nouns()
    raise ValueError(f"Unknown type_words {type_words!r}; expected one of {list(TYPE_WORDS)}.")


def _check_scoring(scoring: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"Unknown scoring {scoring!r}; expected one of {list(SCORINGS)}.")


def type_reward(
    product: Product,
    goal_query: str,
    goal_product_category: str,
    goal_name: str,
    *,
    scoring: str = "upstream",
    type_words: str = "content_words",
) -> tuple[float, bool, bool, float]:
    """(r_type, query_match, category_match, title_score) of buying `product` for a goal.

    `title_score` is the share of the goal title's words (`type_words`) that the bought title has
    (0.2 when the goal title has none); upstream divides the number of distinct shared words by
    the goal title's word count with repeats, the project's variant by its distinct words.
    `r_type` is 1 if the query matches, or two breadcrumb levels match (upstream: levels as
    written; project: lower-cased, empty ones dropped), or `title_score > 0.2`; else 0.5; and it
    drops to 0.1 when `title_score < 0.1` and to 0 when no title word is shared.
    """
    _check_scoring(scoring)
    words = _title_word_function(type_words)
    query_match = product.query == goal_query
    if scoring == "upstream":
        levels = [
            {x.strip() for x in c.split("›")}
            for c in (product.product_category, goal_product_category)
        ]
    else:
        levels = [
            {x.strip().lower() for x in c.split("›") if x.strip()}
            for c in (product.product_category, goal_product_category)
        ]
    category_match = len(levels[0] & levels[1]) >= 2
    want, got = words(goal_name), words(product.name)
    if scoring == "project":
        want = list(dict.fromkeys(want))
    title_score = len(set(want) & set(got)) / len(want) if want else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def _texts(product: Product) -> tuple[str, str, str]:
    return product.name.lower(), " ".join(product.features).lower(), product.description.lower()


def attribute_matches(product: Product, goal_attributes: Iterable[str]) -> int:
    """The project's count of goal attributes the product has (fuzzy in its attributes, or
    verbatim, case-insensitively, in its text)."""
    text = _texts(product)
    count = 0
    for wanted in goal_attributes:
        wanted_l = wanted.lower()
        if any(_similar(have, wanted) for have in product.attributes):
            count += 1
        elif any(wanted_l in t for t in text):
            count += 1
    return count


def upstream_attribute_matches(product: Product, goal_attributes: Iterable[str]) -> int:
    """WebShop's `get_attribute_reward` count: fuzzy in the product's attributes, else the
    attribute as written found in the lower-cased title, features or description."""
    have = product.attributes or _NO_ATTRIBUTES
    text = _texts(product)
    return sum(
        any(_upstream_similar(h, wanted) for h in have) or any(wanted in t for t in text)
        for wanted in goal_attributes
    )


def option_matches(chosen_values: Iterable[str], goal_values: Iterable[str]) -> int:
    """The project's count: goal option values that some chosen value matches (fuzzy, colours
    reduced by `normalize_color`)."""
    chosen = [normalize_color(v) for v in chosen_values]
    count = 0
    for wanted in goal_values:
        wanted_n = normalize_color(wanted)
        if any(_similar(have, wanted_n) for have in chosen):
            count += 1
    return count


def upstream_option_matches(
    product: Product, chosen_options: Mapping[str, str], goal_values: Iterable[str]
) -> int:
    """WebShop's `get_option_reward` count, over the chosen (group, value) pairs.

    Each value is reduced by `upstream_normalize_color`, goal values too. A chosen value counts
    if its group is one of `EXACT_MATCH_GROUPS` and it equals a goal value, or its group is
    another and it is a fuzzy match of one; failing that, if it appears in the product's
    lower-cased title, features or description. The count can exceed the goal's number of
    options (a product with more groups than the goal names), as in WebShop.
    """
    goals = [upstream_normalize_color(v) for v in goal_values]
    text = _texts(product)
    count = 0
    for group, value in chosen_options.items():
        value = upstream_normalize_color(value)
        if group.lower() in EXACT_MATCH_GROUPS:
            matched = value in goals
        else:
            matched = any(_upstream_similar(g, value) for g in goals)
        if matched or any(value in t for t in text):
            count += 1
    return count


def score(
    product: Product,
    chosen_options: Mapping[str, str],
    *,
    goal_attributes: Iterable[str],
    goal_options: Iterable[tuple[str, str]],
    price_upper: float,
    goal_query: str,
    goal_product_category: str,
    goal_name: str,
    scoring: str = "upstream",
    type_words: str = "content_words",
) -> Score:
    """The reward of buying `product` with `chosen_options` ({group: value}) for a goal.

    Args:
        product: The product bought.
        chosen_options: The option values selected on its page, by group.
        goal_attributes: The attributes the instruction asks for.
        goal_options: The (group, value) options it asks for (group "" where the goal names
            values only, as human goals do); upstream compares the values, the chosen groups
            deciding how.
        price_upper: The price limit (the product's `price` is compared to it).
        goal_query, goal_product_category, goal_name: The goal product's search query,
            breadcrumb and title (for the type check).
        scoring: "upstream" (WebShop's code) or "project" (see the module docstring).
        type_words: "content_words" or "spacy" (see the module docstring).

    Raises:
        ValueError: For an unknown `scoring` or `type_words`, or `type_words="spacy"` without
            spaCy's model.
    """
    _check_scoring(scoring)
    attributes = list(goal_attributes)
    values = [v for _, v in goal_options]
    r_type, query_match, category_match, title_score = type_reward(
        product,
        goal_query,
        goal_product_category,
        goal_name,
        scoring=scoring,
        type_words=type_words,
    )
    if scoring == "upstream":
        n_att = upstream_attribute_matches(product, attributes)
        n_opt = upstream_option_matches(product, chosen_options, values)
    else:
        n_att = attribute_matches(product, attributes)
        n_opt = option_matches(chosen_options.values(), values)
    r_price = product.price <= price_upper
    total = (n_att + n_opt + int(r_price)) / (len(attributes) + len(values) + 1)
    return Score(
        reward=total * r_type,
        r_type=r_type,
        r_att=n_att / len(attributes) if attributes else 1.0,
        r_option=n_opt / len(values) if values else None,
        r_price=r_price,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
    )
