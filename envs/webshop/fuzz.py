"""Fuzzy string similarity exactly as WebShop's reward computes it (thefuzz 0.19.0, pure Python).

WebShop pins `thefuzz==0.19.0` and does not install python-Levenshtein, so its `token_set_ratio`
runs on `difflib.SequenceMatcher` (Ratcliff-Obershelp matching, with difflib's default
`autojunk` for strings of 200 characters or more) and rounds each ratio to an int. rapidfuzz's
`token_set_ratio` (the project's own variant, `scoring="project"`) measures Indel similarity
instead, and unrounded: the two disagree on some pairs near the threshold of 85. This module
reimplements thefuzz 0.19.0's functions from its documented behaviour with the standard library.
"""

from __future__ import annotations

import difflib
import re

__all__ = ["full_process", "ratio", "token_set_ratio"]

# thefuzz's `asciidammit` on a str drops the code points 128-255 (Latin-1), nothing else.
_LATIN1 = dict.fromkeys(range(128, 256))
# thefuzz's `(?ui)\W`: not a Unicode letter, digit or underscore.
_NON_WORD = re.compile(r"\W", re.UNICODE)


def full_process(text: str, force_ascii: bool = True) -> str:
    """thefuzz's `utils.full_process`: drop Latin-1 (if `force_ascii`), non-word characters to
    spaces, lower case, strip."""
    if force_ascii:
        text = text.translate(_LATIN1)
    return _NON_WORD.sub(" ", text).lower().strip()


def ratio(a: str, b: str) -> int:
    """thefuzz's `fuzz.ratio` without python-Levenshtein: 100 for equal strings, 0 if either is
    empty, else `round(100 * SequenceMatcher(None, a, b).ratio())`."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def token_set_ratio(a: str, b: str) -> int:
    """thefuzz's `fuzz.token_set_ratio(a, b)` (force_ascii and full_process on, as WebShop calls
    it): the best ratio among the sorted shared tokens and each side's sorted tokens."""
    p1, p2 = full_process(a), full_process(b)
    if not p1 or not p2:
        return 0
    tokens1, tokens2 = set(p1.split()), set(p2.split())
    shared = " ".join(sorted(tokens1 & tokens2))
    only1 = " ".join(sorted(tokens1 - tokens2))
    only2 = " ".join(sorted(tokens2 - tokens1))
    with1 = (shared + " " + only1).strip()
    with2 = (shared + " " + only2).strip()
    shared = shared.strip()
    return max(ratio(shared, with1), ratio(shared, with2), ratio(with1, with2))
