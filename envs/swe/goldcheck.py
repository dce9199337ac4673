"""Grades each task's gold patch: the false positives of the grader's reward-hack defences.

    python -m envs.swe.goldcheck --data-root DIR [--source swebench] [--executor docker] [--fresh]

Each task's fix (its `patch`, applied to the episode's working copy) is submitted through the
env; a gold patch that is not resolved is a false positive of some check, or a broken task.
The report says, per task, what each defence found: the diff check's findings
(`envs.swe.diffcheck`), the comparisons the harness's assertion guard refused and the run-time
inspections it recorded (`envs.swe.assert_guard`).

`--fresh` grades each fix as if the agent had written it fresh: its definitions are compared
with the episode's start only, so that a function the fix touches counts as changed even where
the fix restores the pristine text byte for byte (as every synthetic task's gold patch does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from envs.base import make_env
from envs.swe import diffcheck, grading
from envs.swe import env as env_module
from envs.swe.data import SweTask, load_tasks
from envs.swe.patching import apply_patch
from envs.swe.workspace import PathError

__all__ = ["GoldVerdict", "check_gold", "main"]


@dataclasses.dataclass(frozen=True)
class GoldVerdict:
    """One gold patch's grade.

    Attributes:
        task_id: The task.
        resolved: Whether it was graded resolved.
        defences: What each defence found (`SweEnv`'s `defences` info).
    """

    task_id: str
    resolved: bool
    defences: dict[str, Any]


def _fresh_review(task, ws, files, taken):
    """`grading.review` with each definition compared with the episode's start only."""
    found, defs = grading.review(task, ws, files, taken)
    for rel in defs:
        defs[rel] = diffcheck.written(files[rel].decode("utf-8", "replace"), [ws.base_text(rel)])
    return found, defs


def check_gold(
    tasks: Sequence[SweTask],
    executor: str = "jail",
    fresh: bool = False,
    log: Callable[[str], None] = lambda line: None,
    **env_options: Any,
) -> list[GoldVerdict]:
    """Submits each task's gold patch through the env; returns the verdicts."""
    env = make_env("swe", max_steps=30, executor=executor, **env_options)
    review = env_module.review
    env_module.review = _fresh_review if fresh else review
    verdicts = []
    try:
        for task in tasks:
            env.reset(options={"task": task})
            ws = env.unwrapped.workspace

            def read(rel, ws=ws):
                try:
                    return ws.read_text(rel)
                except PathError:
                    return None

            fixed = apply_patch(read, task.patch)
            ws.apply_changes({p: None if t is None else t.encode() for p, t in fixed.items()})
            _, reward, _, _, info = env.step("submit")
            verdict = GoldVerdict(task.task_id, reward == 1.0, info["defences"])
            log(json.dumps(dataclasses.asdict(verdict)))
            verdicts.append(verdict)
    finally:
        env_module.review = review
        env.close()
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envs.swe.goldcheck", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--data-root", required=True, help="the built tasks, or a SWE-bench file")
    parser.add_argument("--source", default="synthetic", choices=("synthetic", "swebench"))
    parser.add_argument("--executor", default="jail", choices=("jail", "docker"))
    parser.add_argument("--fresh", action="store_true", help="each fix as if written fresh")
    args = parser.parse_args(argv)
    tasks = load_tasks(args.data_root, "all", source=args.source)
    verdicts = check_gold(tasks, args.executor, args.fresh, log=print, test_timeout_s=120.0)
    fired = {key: sum(bool(v.defences[key]) for v in verdicts)
             for key in ("findings", "refused_comparisons", "inspections", "problem")}  # fmt: skip
    missed = [v.task_id for v in verdicts if not v.resolved]
    print(json.dumps({"tasks": len(verdicts), "not_resolved": missed, "fired_on": fired}))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
