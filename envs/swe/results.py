"""Test outcomes from the pytest report plugin, and the text agents see about them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from envs.swe.swebench import combine_outcomes, pytest_key

__all__ = ["PASSING", "TestOutcomes", "normalize_text", "summarize"]

# Outcomes that count as a pass when grading (SWE-bench counts PASSED and XFAIL).
PASSING = ("passed", "xfailed")
_ADDRESS_RE = re.compile(r"0x[0-9a-fA-F]{6,}")
_DURATION_RE = re.compile(r"\bin \d+\.\d+s\b")


def normalize_text(text: str) -> str:
    """Drops what differs between two identical runs (object addresses, durations)."""
    return _DURATION_RE.sub("in N s", _ADDRESS_RE.sub("0x…", text))


class TestOutcomes:
    """One outcome per test node id, folded from the plugin's per-phase records.

    A test is "failed" if its call phase (or a subtest) failed, "error" if its setup or
    teardown failed, else the call's outcome ("passed", "skipped", "xfailed", "xpassed").
    `collect_errors` maps a file that could not be collected to its error message.

    An id is looked up as SWE-bench's harness looks it up (`envs.swe.swebench`): the node id
    itself and every node id whose `key` is that id (by default the node id cut at its first
    space, as upstream's log parsers cut it), their outcomes combined as upstream's log would
    record them (a failure or error of any of them decides).
    """

    __test__ = False  # Not a pytest test class, despite the name.

    def __init__(
        self,
        records: Iterable[dict[str, Any]] | None,
        key: Callable[[str], str] = pytest_key,
    ):
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self.collect_errors: dict[str, str] = {}
        for record in records or ():
            nodeid = str(record.get("nodeid", ""))
            when, outcome = record.get("when"), record.get("outcome")
            message = normalize_text(str(record.get("message") or ""))
            if when == "collect":
                self.collect_errors[nodeid] = message
                continue
            previous = self.outcomes.get(nodeid)
            if outcome == "failed":
                new = "failed" if when == "call" else "error"
                if previous not in ("failed", "error"):
                    self.outcomes[nodeid] = new
                    self.messages[nodeid] = message
            elif when == "call" or (when == "setup" and outcome == "skipped"):
                if previous not in ("failed", "error"):
                    self.outcomes[nodeid] = outcome
                    if message:
                        self.messages[nodeid] = message
            elif previous is None and when == "setup":
                self.outcomes[nodeid] = "pending"  # Set up, but its call never reported.
        for nodeid, outcome in list(self.outcomes.items()):
            if outcome == "pending":
                self.outcomes[nodeid] = "error"
                self.messages.setdefault(nodeid, "the test did not finish (timeout or crash)")
        self._by_key: dict[str, list[str]] = {}
        for nodeid in self.outcomes:
            self._by_key.setdefault(key(nodeid), []).append(nodeid)

    def outcome(self, test_id: str) -> str | None:
        """The outcome of a node id or of a dataset id (see the class docstring); None: not run."""
        nodeids = set(self._by_key.get(test_id, ()))
        if test_id in self.outcomes:
            nodeids.add(test_id)
        return combine_outcomes(self.outcomes[n] for n in nodeids)

    def passed(self, test_id: str) -> bool:
        return self.outcome(test_id) in PASSING

    def passing(self) -> set[str]:
        return {n for n, o in self.outcomes.items() if o in PASSING}

    def failing(self) -> list[str]:
        return sorted(n for n, o in self.outcomes.items() if o in ("failed", "error", "xpassed"))

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    def describe(self, max_failures: int = 8, max_message: int = 300) -> str:
        """A deterministic summary: counts, then each failure with its message."""
        counts = self.counts()
        if not counts and not self.collect_errors:
            return "No tests ran."
        order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
        parts = [f"{counts[k]} {k}" for k in order if counts.get(k)]
        lines = [f"{len(self.outcomes)} tests: " + ", ".join(parts) + "."]
        for path, message in sorted(self.collect_errors.items()):
            lines.append(f"ERROR collecting {path}: {_shorten(message, max_message)}")
        failing = self.failing()
        for nodeid in failing[:max_failures]:
            label = self.outcomes[nodeid].upper()
            message = self.messages.get(nodeid, "")
            lines.append(
                f"{label} {nodeid}" + (f" - {_shorten(message, max_message)}" if message else "")
            )
        if len(failing) > max_failures:
            lines.append(f"... and {len(failing) - max_failures} more failing tests.")
        return "\n".join(lines)


def summarize(records: Sequence[dict[str, Any]] | None) -> TestOutcomes:
    """Folds plugin records into a `TestOutcomes`."""
    return TestOutcomes(records)


def _shorten(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
