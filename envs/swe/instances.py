"""Turning a kept mutant into a SWE-bench-schema instance: statement, patches, walkthrough."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from envs.swe.mutate import Mutant
from envs.swe.packages import PackageSpec
from envs.swe.patching import make_patch
from envs.swe.tools import parse_action, replace_in_line

__all__ = ["fix_action", "make_instance", "problem_statement", "walkthrough"]


def problem_statement(
    spec: PackageSpec, fail_to_pass: Sequence[str], messages: Mapping[str, str], limit: int = 5
) -> str:
    """An issue-style report built from the failing tests alone (it never names the fix)."""
    files = sorted({n.split("::", 1)[0] for n in fail_to_pass})
    count = len(fail_to_pass)
    lines = [
        f"{spec.name} {spec.version}: {count} test{'s' if count != 1 else ''} "
        f"fail{'' if count != 1 else 's'} in {', '.join(files)}",
        "",
        f"After a recent change to the library code of {spec.name}, these tests fail:",
    ]
    for nodeid in list(fail_to_pass)[:limit]:
        message = " ".join(messages.get(nodeid, "").split())
        if len(message) > 160:
            message = message[:159] + "…"
        lines.append(f"- {nodeid}" + (f": {message}" if message else ""))
    if count > limit:
        lines.append(f"- ... and {count - limit} more")
    lines += [
        "",
        "Find the bug in the library (not in the tests) and fix it, so that these tests pass "
        "and the others keep passing.",
    ]
    return "\n".join(lines)


def fix_action(path: str, line_number: int, buggy: str, fixed: str) -> str:
    """The shortest `replace` action that turns line `buggy` into `fixed` (else an `edit`).

    The span is widened to whole whitespace-separated words, then until it is the first match
    on the line, so the action is unambiguous; it is checked by applying it.
    """
    body, want = buggy.rstrip("\r\n"), fixed.rstrip("\r\n")
    prefix = 0
    while prefix < min(len(body), len(want)) and body[prefix] == want[prefix]:
        prefix += 1
    suffix = 0
    while (
        suffix < min(len(body), len(want)) - prefix
        and body[len(body) - 1 - suffix] == want[len(want) - 1 - suffix]
    ):
        suffix += 1
    start, end = prefix, len(body) - suffix
    while start > 0 and not body[start - 1].isspace():
        start -= 1
    while end < len(body) and not body[end].isspace():
        end += 1
    for _ in range(len(body)):
        old = body[start:end].strip()
        new = want[start : len(want) - (len(body) - end)].strip()
        action = f"replace {path}:{line_number} {old} => {new}".rstrip()
        if " ".join(action.split()) == action and not action.endswith("."):
            call = parse_action(action)
            if old and replace_in_line(buggy, call.text, call.new) == fixed:
                return action
        if not body[:start].strip() and not body[end:].strip():
            break
        # Widen by one word on the left (on the right once the left is exhausted); retry.
        if body[:start].strip():
            while body[start - 1].isspace():
                start -= 1
            while start > 0 and not body[start - 1].isspace():
                start -= 1
        else:
            start = len(body) - len(body.lstrip())
            while end < len(body) and body[end].isspace():
                end += 1
            while end < len(body) and not body[end].isspace():
                end += 1
    text = want.strip().replace("\\", "\\\\")
    return f"edit {path} {line_number}-{line_number} {text}"


def walkthrough(mutant: Mutant, buggy_source: str, fixed_source: str) -> list[str]:
    """Expert actions: look at the buggy line in context, fix it, submit."""
    buggy_lines = buggy_source.splitlines(keepends=True)
    fixed_lines = fixed_source.splitlines(keepends=True)
    line = mutant.line
    lo, hi = max(1, line - 4), min(len(buggy_lines), line + 4)
    return [
        f"view {mutant.path} {lo}-{hi}",
        fix_action(mutant.path, line, buggy_lines[line - 1], fixed_lines[line - 1]),
        "submit",
    ]


def make_instance(
    spec: PackageSpec,
    *,
    tree: str,
    base_commit: str,
    mutant: Mutant,
    original_source: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    messages: Mapping[str, str],
    pytest_args: Sequence[str] | None = None,
    test_env: str = "",
    test_requirements: Sequence[str] = (),
) -> dict[str, Any]:
    """One instance dict (the SWE-bench fields plus the builder's; see `envs.swe.data`).

    `pytest_args` default to the spec's; `test_env` is the package's test environment (a venv
    folder, relative to the data root) and `test_requirements` what was installed in it.
    """
    buggy_source = mutant.apply(original_source)
    owner_repo = spec.repo.replace("/", "__")
    digest = mutant.mutant_id.rsplit(":", 1)[-1]
    return {
        "instance_id": f"{owner_repo}-{spec.version}-{digest}",
        "repo": spec.repo,
        "base_commit": base_commit,
        "problem_statement": problem_statement(spec, fail_to_pass, messages),
        "hints_text": "",
        "created_at": "",
        "version": spec.version,
        "environment_setup_commit": base_commit,
        "FAIL_TO_PASS": list(fail_to_pass),
        "PASS_TO_PASS": list(pass_to_pass),
        "test_patch": "",
        "patch": make_patch({mutant.path: (buggy_source, original_source)}),
        "bug_patch": make_patch({mutant.path: (original_source, buggy_source)}),
        "source": "synthetic",
        "package": spec.name,
        "tree": tree,
        "pythonpath": list(spec.pythonpath),
        "pytest_args": list(spec.pytest_args if pytest_args is None else pytest_args),
        "test_env": test_env,
        "test_requirements": list(test_requirements),
        "walkthrough": walkthrough(mutant, buggy_source, original_source),
        "mutation": {
            "path": mutant.path,
            "line": mutant.line,
            "kind": mutant.kind,
            "function": mutant.function,
            "original": mutant.original,
            "replacement": mutant.replacement,
        },
    }
