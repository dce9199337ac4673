"""WebShop's reward (envs/webshop/scoring.py, fuzz.py) against values worked out by hand.

The upstream cases follow WebShop's own `get_reward` (web_agent_site/engine/goal.py), which is
the default scoring; the project's first variant (`scoring="project"`) is checked beside it.
Products here are written for the tests; nothing here is a WebShop result.
"""

import pytest

from envs.webshop import Product, WebShopEnv, score
from envs.webshop import fuzz as upstream_fuzz
from envs.webshop.scoring import (
    normalize_color,
    option_matches,
    spacy_nouns,
    title_words,
    upstream_normalize_color,
)

# --- Scoring (hand-checked) ----------------------------------------------------------------------

GOAL = dict(
    goal_attributes=["tempered glass", "glass screen"],
    goal_options=[("size", "11 inch")],
    price_upper=20.0,
    goal_query="screen protectors",
    goal_product_category="Electronics › Computers & Accessories › Tablet Accessories › Screen "
    "Protectors",
    goal_name="Tempered Glass Screen Protector for iPad Pro",
)


def product(**changes):
    fields = dict(
        asin="B000000001",
        name="Tempered Glass Protector for iPad Pro, 2 Pack",
        category="electronics",
        query="screen protectors",
        product_category=GOAL["goal_product_category"],
        price=12.78,
        price_tag="$12.78",
        description="Keeps the glass screen clear.",
        features=("9H hardness",),
        options=(("size", ("11 inch", "12.9 inch")),),
        rating="N.A.",
        attributes=("tempered glass",),
        instruction=None,
        instruction_attributes=(),
    )
    fields.update(changes)
    return Product(**fields)


@pytest.mark.parametrize(
    "changes, chosen, expected",
    [
        # 2 attributes ("glass screen" found in the description) + 1 option + price: 4/4.
        ({}, {"size": "11 inch"}, 1.0),
        # Wrong option: (2 + 0 + 1) / 4.
        ({}, {"size": "12.9 inch"}, 0.75),
        # No option chosen: (2 + 0 + 1) / 4.
        ({}, {}, 0.75),
        # Over the price limit: (2 + 1 + 0) / 4.
        ({"price": 25.0}, {"size": "11 inch"}, 0.75),
        # Neither attribute in the attributes or the text: (0 + 1 + 1) / 4.
        (
            {"attributes": (), "description": "", "name": "Screen Protector for iPad Pro"},
            {"size": "11 inch"},
            0.5,
        ),
        # A fuzzy attribute match ("glass screen" is a token subset) instead of the text.
        (
            {
                "attributes": ("glass screen protector", "tempered glass"),
                "description": "",
                "name": "Screen Protector for iPad Pro",
            },
            {"size": "11 inch"},
            1.0,
        ),
        # Another kind of product: no title word shared, so r_type = 0.
        (
            {
                "name": "Torchiere Floor Lamp, Bronze Finish",
                "query": "floor lamps",
                "product_category": "Home & Kitchen › Lighting › Floor Lamps",
            },
            {"size": "11 inch"},
            0.0,
        ),
        # 1 of 6 title words shared, other query, one breadcrumb level shared: r_type = 0.5.
        (
            {
                "name": "Glass Camera Lens Cap",
                "query": "lens caps",
                "product_category": "Electronics › Camera & Photo › Lens Caps",
            },
            {"size": "11 inch"},
            0.5,
        ),
        # Same, but two breadcrumb levels shared: r_type = 1.
        (
            {
                "name": "Glass Camera Lens Cap",
                "query": "lens caps",
                "product_category": "Electronics › Computers & Accessories › Caps",
            },
            {"size": "11 inch"},
            1.0,
        ),
        # Same, but the same search query: r_type = 1.
        (
            {"name": "Glass Camera Lens Cap", "product_category": "Electronics › Caps"},
            {"size": "11 inch"},
            1.0,
        ),
    ],
)
def test_score_hand_checked(changes, chosen, expected):
    # The two scorings agree on every one of these.
    for scoring in ("upstream", "project"):
        result = score(product(**changes), chosen, **GOAL, scoring=scoring)
        assert result.reward == pytest.approx(expected), scoring


def test_score_type_factor_floor_and_parts():
    # 1 of 11 goal title words shared (< 0.1): r_type = 0.1 whatever else matches.
    goal = dict(
        GOAL, goal_name="alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo"
    )
    result = score(product(name="Kilo Widget", query="widgets"), {"size": "11 inch"}, **goal)
    assert result.title_score == pytest.approx(1 / 11) and result.r_type == 0.1
    assert result.reward == pytest.approx(0.1)
    parts = score(product(price=25.0), {"size": "12.9 inch"}, **GOAL)
    assert (parts.r_att, parts.r_option, parts.r_price, parts.r_type) == (1.0, 0.0, False, 1.0)
    assert parts.reward == pytest.approx((2 + 0 + 0) / 4)
    # 5 of the goal title's 6 content words ("screen" is missing).
    assert parts.query_match and parts.category_match and parts.title_score == pytest.approx(5 / 6)


def test_colors_and_option_matching():
    assert normalize_color("Navy Blue") == "navy"
    assert normalize_color("heather gray") == normalize_color("Grey") == "gray"
    assert normalize_color("light blue") == "blue"
    assert normalize_color("32") == "32"
    assert option_matches(["navy blue"], ["navy"]) == 1
    assert option_matches(["black", "x-large"], ["large", "black"]) == 2  # fuzzywuzzy-style tokens.
    assert option_matches(["medium"], ["large"]) == 0
    assert option_matches(["18 inch"], ["22 inch"]) == 0  # token_set_ratio 72.7
    # WebShop's fuzzy rule lets short values that differ in one number pass (87.5 > 85).
    assert option_matches(["12 piece"], ["24 piece"]) == 1
    assert title_words("The Men's 2 Pack T-Shirt, Size Large") == ["men's", "shirt", "large"]


# --- Scoring as WebShop's goal.py computes it (hand-checked) -------------------------------------
# Each expected value is worked out by hand from `get_reward` in WebShop's
# web_agent_site/engine/goal.py: (attributes matched + options matched + [price <= limit]) /
# (goal attributes + goal options + 1), times r_type. Options are counted over the chosen
# (group, value) pairs after `normalize_color` (the first of COLOR_SET, in its order, that is a
# substring); a chosen "size" must equal a goal value, other groups match at token_set_ratio > 85,
# and an unmatched chosen value still counts if it is in the title, features or description.
# The project's variant is worked out beside it where the two differ.

COFFEE = dict(
    asin="B000000002",
    name="Organic Ground Coffee, Medium Roast",
    category="food",
    query="ground coffee",
    product_category="Grocery & Gourmet Food › Beverages › Coffee › Ground Coffee",
    price=15.0,
    price_tag="$15.00",
    description="Smooth and rich.",
    features=("Fair trade",),
    options=(("flavor name", ("french roast", "medium roast")), ("size", ("1 pound", "2 pound"))),
    rating="N.A.",
    attributes=("fair trade",),
    instruction=None,
    instruction_attributes=(),
)
# Attributes: "fair trade" is one of the product's (fuzzy 100), "organic" is in its title: 2 of 2.
COFFEE_GOAL = dict(
    goal_attributes=["fair trade", "organic"],
    goal_options=[("flavor name", "french roast"), ("size", "1 pound")],
    price_upper=20.0,
    goal_query="ground coffee",
    goal_product_category=COFFEE["product_category"],
    goal_name=COFFEE["name"],
)
TEE = dict(
    COFFEE,
    asin="B000000003",
    name="Men's Crew Neck T-Shirt",
    category="fashion",
    query="men t shirts",
    product_category="Clothing, Shoes & Jewelry › Men › Clothing › Shirts",
    price=9.99,
    price_tag="$9.99",
    description="Soft cotton tee.",
    features=("Machine wash",),
    options=(("color", ("navy blue", "sky blue", "dark grey")), ("size", ("large", "x-large"))),
    attributes=("machine wash",),
)
# One attribute ("machine wash", fuzzy 100), price within the limit.
TEE_GOAL = dict(
    goal_attributes=["machine wash"],
    price_upper=20.0,
    goal_query="men t shirts",
    goal_product_category=TEE["product_category"],
    goal_name=TEE["name"],
)


def _tee(goal_options, chosen, upstream, project, item=TEE, **goal):
    """A case of `test_upstream_scoring_hand_checked`: `item` (the tee) bought with `chosen` for
    TEE_GOAL with `goal_options` (and `goal`'s other changes), and the two expected rewards."""
    return item, dict(TEE_GOAL, goal_options=goal_options, **goal), chosen, upstream, project


@pytest.mark.parametrize(
    "item, goal, chosen, upstream, project",
    [
        # The goal's own options: 2 attributes + 2 options + price = 5 of 5 for both.
        (COFFEE, COFFEE_GOAL, {"flavor name": "french roast", "size": "1 pound"}, 1.0, 1.0),
        # "2 pound" for "1 pound": size must be equal upstream, and "2 pound" is not in the text:
        # (2 + 1 + 1) / 5 = 0.8. The project matches it fuzzily (token_set_ratio 86 > 85): 1.0.
        (COFFEE, COFFEE_GOAL, {"flavor name": "french roast", "size": "2 pound"}, 0.8, 1.0),
        # The wrong roast: "medium roast" is no fuzzy match of "french roast", but it is in the
        # title ("... medium roast"), so upstream counts it: 5 / 5. Project: (2 + 1 + 1) / 5.
        (COFFEE, COFFEE_GOAL, {"flavor name": "medium roast", "size": "1 pound"}, 1.0, 0.8),
        # Only the size chosen: upstream counts the chosen pairs, 1 of them: (2 + 1 + 1) / 5.
        (COFFEE, COFFEE_GOAL, {"size": "1 pound"}, 0.8, 0.8),
        # "navy blue" reduces to "blue" upstream ('blue' precedes 'navy' in COLOR_SET), which is
        # no match of the goal's "navy"; "large" is an exact size: (1 + 1 + 1) / 4 = 0.75.
        # Project: "navy blue" -> "navy" matches: 4 / 4.
        _tee(
            [("color", "navy"), ("size", "large")],
            {"color": "navy blue", "size": "large"},
            0.75,
            1.0,
        ),
        # "sky blue" and the goal's "navy blue" both reduce to "blue" upstream: 4 / 4.
        # Project: "sky blue" -> "blue" is not "navy": (1 + 1 + 1) / 4.
        _tee(
            [("color", "navy blue"), ("size", "large")],
            {"color": "sky blue", "size": "large"},
            1.0,
            0.75,
        ),
        # "x-large" is not the size "large" upstream (exact), and not in the text:
        # (1 + 1 + 1) / 4. Project: token_set_ratio("x-large", "large") = 100: 4 / 4.
        _tee(
            [("color", "navy blue"), ("size", "large")],
            {"color": "navy blue", "size": "x-large"},
            0.75,
            1.0,
        ),
        # "dark grey" reduces to "dark" upstream ('dark' precedes 'grey'), the goal's "grey" to
        # itself: no match, "dark" not in the text: (1 + 0 + 1) / 3. Project: both "gray": 3 / 3.
        _tee([("color", "grey")], {"color": "dark grey"}, 2 / 3, 1.0),
        # Another query, breadcrumb levels written in lower case (no level equal as written),
        # and 1 of the goal title's 7 words ("cotton"): r_type 0.5 upstream, so 3 / 3 * 0.5.
        # Project: lower-cased levels share 4, r_type 1.
        _tee(
            [("size", "large")],
            {"size": "large"},
            0.5,
            1.0,
            item=dict(
                TEE,
                name="Cotton Polo",
                query="polo shirts",
                product_category="clothing, shoes & jewelry › men › clothing › shirts",
            ),
            goal_name="Men's Cotton Crew Neck Short Sleeve T-Shirt",
        ),
        # Title words counted with repeats upstream: the goal title has 6 ("tea tree shampoo
        # tea tree conditioner"), 1 shared ("shampoo"): 1/6 <= 0.2, r_type 0.5, so 3 / 3 * 0.5.
        # Project: 1 of 4 distinct words = 0.25 > 0.2, r_type 1.
        _tee(
            [("size", "large")],
            {"size": "large"},
            0.5,
            1.0,
            item=dict(TEE, name="Argan Shampoo", query="shampoo", product_category="Beauty › Hair"),
            goal_name="Tea Tree Shampoo and Tea Tree Conditioner",
        ),
    ],
)
def test_upstream_scoring_hand_checked(item, goal, chosen, upstream, project):
    bought = Product(**item)
    assert score(bought, chosen, **goal).reward == pytest.approx(upstream)  # The default.
    assert score(bought, chosen, **goal, scoring="project").reward == pytest.approx(project)


def test_upstream_fuzz_and_colors_by_hand():
    # thefuzz 0.19.0 (difflib): "pound 2" vs "pound 1" share 6 of 14 characters -> 86;
    # "pound" vs "pound 2": 10 of 12 -> 83; the best is 86.
    assert upstream_fuzz.token_set_ratio("2 pound", "1 pound") == 86
    assert upstream_fuzz.ratio("pound", "pound 2") == 83
    # Processing: punctuation to spaces, lower case; one side's tokens a subset: 100.
    assert upstream_fuzz.token_set_ratio("Tempered-Glass", "tempered glass screen") == 100
    assert upstream_fuzz.token_set_ratio("", "x") == upstream_fuzz.token_set_ratio("!", "x") == 0
    # Latin-1 letters are dropped before comparing (thefuzz's force_ascii): "crème" -> "crme".
    assert upstream_fuzz.full_process("Crème Brûlée") == "crme brle"
    # WebShop's colour reduction: substring, list order, case-sensitive.
    assert upstream_normalize_color("stonewash") == "ash"
    assert upstream_normalize_color("light blue") == "blue"
    assert upstream_normalize_color("Navy Blue") == "Navy Blue"
    assert upstream_normalize_color("32") == "32"


def test_scoring_options_are_checked():
    bought = Product(**COFFEE)
    with pytest.raises(ValueError, match="'webshop'.*upstream"):
        score(bought, {}, **COFFEE_GOAL, scoring="webshop")
    with pytest.raises(ValueError, match="'nouns'.*content_words"):
        score(bought, {}, **COFFEE_GOAL, type_words="nouns")


def test_spacy_type_words_need_spacy_and_its_model():
    """WebShop's own title nouns: used where spaCy and en_core_web_lg are installed; elsewhere
    asking for them fails at construction, saying how WebShop installs them."""
    try:
        nouns = spacy_nouns()
    except ValueError as error:
        assert "pip install spacy==3.3.0" in str(error) and "en_core_web_lg" in str(error)
        with pytest.raises(ValueError, match="type_words='content_words'"):
            WebShopEnv(type_words="spacy")
        return
    bought = Product(**COFFEE)
    assert "coffee" in nouns(COFFEE["name"])
    own = {"flavor name": "french roast", "size": "1 pound"}
    assert score(bought, own, **COFFEE_GOAL, type_words="spacy").reward == pytest.approx(1.0)
