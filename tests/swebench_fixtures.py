"""SWE-bench records in the official schema, on small repositories that the tests write.

Each record reproduces one way in which a real SWE-bench instance was graded differently from
upstream's harness (github.com/swe-bench/SWE-bench, `swebench/harness`); none is downloaded.
The trees are the repositories at `base_commit` (the bug is in them, as in SWE-bench), `patch`
is the gold fix and `test_patch` the test change, both unified diffs against the tree, and
FAIL_TO_PASS / PASS_TO_PASS are JSON-encoded strings, as on Hugging Face. The ids are written
by hand the way the dataset writes them (upstream's log parsers made them).

- `textvec` (after scikit-learn-15100, `strip_accents_unicode` and NFKD strings): two
  PASS_TO_PASS ids are parametrised by messages with spaces, and the dataset has them cut at
  the first space (`...[file-AttributeError-'str'`).
- `miniwrap` (after pytest-dev/pytest): its pyproject's addopts load a plugin with `-p
  pytester`, and its tests use the `pytester` fixture.
- `minidj` (django/django): tests run by `tests/runtests.py` (unittest's runner at verbosity 2,
  as django's is), ids `test_x (module.Class.test_x)` as Python 3.11 prints them.
- A sympy record graded from a `bin/test --verbose` log excerpt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from envs.swe.patching import make_patch

# textvec ------------------------------------------------------------------------------------

TEXTVEC_BUGGY = '''\
"""textvec: text helpers (a bpo_jax test fixture, after scikit-learn's feature_extraction)."""

import unicodedata


def strip_accents_unicode(s):
    normalized = unicodedata.normalize("NFKD", s)
    if normalized == s:
        return s
    return "".join([c for c in normalized if not unicodedata.combining(c)])


def analyze(doc, input_type):
    if input_type == "file":
        return doc.read().split()
    if input_type == "filename":
        with open(doc) as f:
            return f.read().split()
    return doc.split()
'''
TEXTVEC_FIXED = TEXTVEC_BUGGY.replace(
    """    normalized = unicodedata.normalize("NFKD", s)
    if normalized == s:
        return s
    return""",
    """    normalized = unicodedata.normalize("NFKD", s)
    return""",
)
_TEXTVEC_TESTS = """\
import pytest

from textvec.text import analyze, strip_accents_unicode


def test_strip_accents():
    assert strip_accents_unicode("àáâãäåçèéêë") == "aaaaaaceeee"
    assert strip_accents_unicode("this is à test") == "this is a test"


def test_analyze_text():
    assert analyze("a b", "content") == ["a", "b"]


@pytest.mark.parametrize(
    "input_type, exception, message",
    [
        ("file", AttributeError, "'str' object has no attribute 'read'"),
        ("filename", FileNotFoundError, "No such file or directory"),
    ],
)
def test_callable_analyzer_error(input_type, exception, message):
    with pytest.raises(exception, match=message):
        analyze("/no/such/file", input_type)
"""
_TEXTVEC_TESTS_NEW = _TEXTVEC_TESTS.replace(
    """    assert strip_accents_unicode("this is à test") == "this is a test"
""",
    """    assert strip_accents_unicode("this is à test") == "this is a test"
    # Already in NFKD form ("n" followed by a combining tilde).
    assert strip_accents_unicode("n\\u0303") == "n"
""",
)
TEXTVEC_FILES = {
    "textvec/__init__.py": "",
    "textvec/text.py": TEXTVEC_BUGGY,
    "textvec/tests/__init__.py": "",
    "textvec/tests/test_text.py": _TEXTVEC_TESTS,
    "setup.cfg": "[tool:pytest]\naddopts = --strict-markers\n",
}
_TV = "textvec/tests/test_text.py::"
# The dataset's ids: the two parametrised ones cut at the first space.
TEXTVEC_TRUNCATED = (
    f"{_TV}test_callable_analyzer_error[file-AttributeError-'str'",
    f"{_TV}test_callable_analyzer_error[filename-FileNotFoundError-No",
)

# miniwrap -----------------------------------------------------------------------------------

MINIWRAP_BUGGY = '''\
"""miniwrap: greedy line wrapping (a bpo_jax test fixture)."""


def wrap(text, width):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) >= width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
'''
MINIWRAP_FIXED = MINIWRAP_BUGGY.replace(">= width", "> width")
_MINIWRAP_TESTS = """\
from miniwrap.text import wrap


def test_wrap_short():
    assert wrap("a b", 10) == ["a b"]


def test_wrap_in_a_generated_test(pytester):
    pytester.makepyfile(
        "from miniwrap.text import wrap\\n"
        "def test_it():\\n"
        "    assert wrap('ab cd ef', 5) == ['ab cd', 'ef']\\n"
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
"""
_MINIWRAP_TESTS_NEW = (
    _MINIWRAP_TESTS
    + """

def test_wrap_exact_width():
    assert wrap("ab cd ef", 5) == ["ab cd", "ef"]
"""
)
MINIWRAP_FILES = {
    "miniwrap/__init__.py": "",
    "miniwrap/text.py": MINIWRAP_BUGGY,
    "testing/test_wrap.py": _MINIWRAP_TESTS,
    # As pytest-dev/pytest's own pyproject.toml: its tests need the pytester plugin.
    "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-rfEX -p pytester --strict-markers"\n',
}

# minidj (django-style) ----------------------------------------------------------------------

MINIDJ_BUGGY = '''\
"""minidj.utils.text (a bpo_jax test fixture, after django.utils.text)."""

import re
import unicodedata


def slugify(value):
    value = unicodedata.normalize("NFKD", str(value)).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\\w\\s-]", "", value.lower())
    return re.sub(r"[-\\s]+", "-", value)
'''
MINIDJ_FIXED = MINIDJ_BUGGY.replace('"-", value)', '"-", value).strip("-_")')
# runtests.py takes django's options and labels and runs unittest's runner at the verbosity
# given, which is what django's runner prints at --verbosity 2.
_RUNTESTS = '''\
#!/usr/bin/env python
"""Runs minidj's tests as django's tests/runtests.py does (a bpo_jax test fixture)."""
import argparse
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
parser = argparse.ArgumentParser()
parser.add_argument("modules", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings", default="test_sqlite")
parser.add_argument("--parallel", type=int, default=0)
args = parser.parse_args()
os.environ["DJANGO_SETTINGS_MODULE"] = args.settings
print(f"Testing against Django installed in '{os.path.dirname(HERE)}/minidj'", flush=True)
suite = unittest.defaultTestLoader.loadTestsFromNames(args.modules or ["utils_tests"])
result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
sys.exit(not result.wasSuccessful())
'''
_MINIDJ_TESTS = """\
import sys
import unittest

from minidj.utils.text import slugify


class TestUtilsText(unittest.TestCase):
    def test_slugify_words(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_slugify_unicode(self):
        self.assertEqual(slugify("Ünïcode"), "unicode")

    def test_noisy(self):
        # Output between the test's name and its "ok", as django's request logging makes.
        sys.stderr.write("Internal Server Error: /admin/\\nTraceback: (logged, not raised)\\n")
        self.assertTrue(slugify("a"))

    @unittest.skip("needs a database")
    def test_skipped(self):
        pass
"""
_MINIDJ_TESTS_NEW = _MINIDJ_TESTS.replace(
    """    def test_noisy(self):""",
    """    def test_slugify_strips_dashes(self):
        self.assertEqual(slugify("  -Hello, World!- "), "hello-world")

    def test_noisy(self):""",
)
MINIDJ_FILES = {
    "minidj/__init__.py": "",
    "minidj/utils/__init__.py": "",
    "minidj/utils/text.py": MINIDJ_BUGGY,
    "tests/runtests.py": _RUNTESTS,
    "tests/test_sqlite.py": 'DATABASES = {"default": {"ENGINE": "minidj.db.backends.sqlite3"}}\n',
    "tests/utils_tests/__init__.py": "",
    "tests/utils_tests/test_text.py": _MINIDJ_TESTS,
}
_DJ = "utils_tests.test_text.TestUtilsText"


def _dj(name: str) -> str:
    return f"{name} ({_DJ}.{name})"  # Python 3.11's unittest names.


# Records ------------------------------------------------------------------------------------


def _record(iid: str, repo: str, version: str, f2p, p2p, patch: str, test_patch: str, **kw):
    return {
        "repo": repo,
        "instance_id": iid,
        "base_commit": kw.get("base_commit", "0" * 40),
        "patch": patch,
        "test_patch": test_patch,
        "problem_statement": kw.get("problem_statement", f"{iid}: a bpo_jax test fixture."),
        "hints_text": kw.get("hints_text", ""),
        "created_at": kw.get("created_at", "2019-09-26T19:21:38Z"),
        "version": version,
        "FAIL_TO_PASS": json.dumps(list(f2p)),
        "PASS_TO_PASS": json.dumps(list(p2p)),
        "environment_setup_commit": kw.get("environment_setup_commit", "1" * 40),
        "difficulty": kw.get("difficulty", "<15 min fix"),
    }


def records() -> dict[str, dict[str, Any]]:
    """The records by name: "textvec", "miniwrap", "minidj", "sympy" and "no_fail_to_pass"."""
    textvec = _record(
        "scikit-learn__scikit-learn-90001", "scikit-learn/scikit-learn", "0.22",
        [f"{_TV}test_strip_accents"],
        [f"{_TV}test_analyze_text", *TEXTVEC_TRUNCATED],
        make_patch({"textvec/text.py": (TEXTVEC_BUGGY, TEXTVEC_FIXED)}),
        make_patch({"textvec/tests/test_text.py": (_TEXTVEC_TESTS, _TEXTVEC_TESTS_NEW)}),
        problem_statement="strip_accents_unicode fails to strip accents from strings that are "
        "already in NFKD form",
        base_commit="af8a6e592a1a15d92d77011856d5aa0ec4db4c6c",
        environment_setup_commit="7e85a6d1f038bbb932b36f18d75df6be937ed00d",
    )  # fmt: skip
    miniwrap = _record(
        "pytest-dev__pytest-90002", "pytest-dev/pytest", "5.4",
        ["testing/test_wrap.py::test_wrap_exact_width",
         "testing/test_wrap.py::test_wrap_in_a_generated_test"],
        ["testing/test_wrap.py::test_wrap_short"],
        make_patch({"miniwrap/text.py": (MINIWRAP_BUGGY, MINIWRAP_FIXED)}),
        make_patch({"testing/test_wrap.py": (_MINIWRAP_TESTS, _MINIWRAP_TESTS_NEW)}),
    )  # fmt: skip
    minidj = _record(
        "django__django-90003", "django/django", "5.0",
        [_dj("test_slugify_strips_dashes")],
        [_dj("test_slugify_words"), _dj("test_slugify_unicode"), _dj("test_noisy")],
        make_patch({"minidj/utils/text.py": (MINIDJ_BUGGY, MINIDJ_FIXED)}),
        make_patch({"tests/utils_tests/test_text.py": (_MINIDJ_TESTS, _MINIDJ_TESTS_NEW)}),
    )  # fmt: skip
    sympy = _record(
        "sympy__sympy-90004", "sympy/sympy", "1.5",
        ["test_latex_subs"], ["test_printmethod", "test_latex_basic"],
        make_patch({"sympy/printing/latex.py": ("subs = None\n", "subs = 'fixed'\n")}),
        make_patch({"sympy/printing/tests/test_latex.py": ("x = 1\n", "x = 2\n"),
                    "sympy/printing/tests/data.json": ("{}\n", "[]\n")}),
    )  # fmt: skip
    empty = dict(textvec, instance_id="scikit-learn__scikit-learn-90005", FAIL_TO_PASS="[]")
    return {"textvec": textvec, "miniwrap": miniwrap, "minidj": minidj, "sympy": sympy,
            "no_fail_to_pass": empty}  # fmt: skip


for _buggy, _fixed in (
    (TEXTVEC_BUGGY, TEXTVEC_FIXED),
    (MINIWRAP_BUGGY, MINIWRAP_FIXED),
    (MINIDJ_BUGGY, MINIDJ_FIXED),
    (_TEXTVEC_TESTS, _TEXTVEC_TESTS_NEW),
    (_MINIWRAP_TESTS, _MINIWRAP_TESTS_NEW),
    (_MINIDJ_TESTS, _MINIDJ_TESTS_NEW),
):
    assert _buggy != _fixed  # fmt: skip
TREES = {"textvec": TEXTVEC_FILES, "miniwrap": MINIWRAP_FILES, "minidj": MINIDJ_FILES}


def write_tree(name: str, top: Path) -> Path:
    """Writes repository `name` at its base commit under `top`; returns `top`."""
    for rel, text in TREES[name].items():
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith("runtests.py"):
            path.chmod(0o755)
    return top


def record_task(tmp_path: Path, name: str):
    """The record `name` loaded from a JSONL file, its task pointed at a tree written for it."""
    from envs.swe.data import load_swebench

    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(records()[name]) + "\n")
    (task,) = load_swebench(path)
    return dataclasses.replace(task, tree=str(write_tree(name, tmp_path / name)))


def patched_files(task, patch: str) -> dict[str, str]:
    """{path: new text} of `patch` applied to the task's tree."""
    from envs.swe.patching import apply_patch
    from envs.swe.workspace import PathError, Workspace

    ws = Workspace(task.tree)

    def read(rel):
        try:
            return ws.read_text(rel)
        except PathError:
            return None

    return apply_patch(read, patch)


# sympy's `bin/test -C --verbose` output (written for the tests, in sympy's format): the last
# test of each file carries the file's [OK]/[FAIL] mark on its line, which upstream's parser
# (and so the dataset) does not read.
SYMPY_LOG_GOLD = """\
============================= test process starts ==============================
executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]
architecture:       64-bit
cache:              no
ground types:       python
numpy:              None
random seed:        61223480
hash randomization: on (PYTHONHASHSEED=2934571235)

sympy/printing/tests/test_latex.py[4]
test_printmethod ok
test_latex_basic ok
test_latex_subs ok
test_latex_symbols ok                                                       [OK]


================== tests finished: 4 passed, in 1.82 seconds ===================
"""
SYMPY_LOG_BUGGY = """\
============================= test process starts ==============================
executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.19-final-0) [CPython]
random seed:        61223480

sympy/printing/tests/test_latex.py[4]
test_printmethod ok
test_latex_basic ok
test_latex_subs F
test_latex_symbols ok                                                     [FAIL]


________________________________________________________________________________
____________ sympy/printing/tests/test_latex.py:test_latex_subs ________________
Traceback (most recent call last):
  File "/testbed/sympy/printing/tests/test_latex.py", line 42, in test_latex_subs
    assert latex(Subs(x*y, (x, y), (1, 2))) == r'\\left. x y \\right|_{\\substack{ x=1\\\\ y=2 }}'
AssertionError

============ tests finished: 3 passed, 1 failed, in 1.95 seconds =============
DO *NOT* COMMIT!
"""
