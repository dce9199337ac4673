"""Repository repair in the SWE-bench instance schema: gymnasium id `bpo_jax/RepoRepair-v0`, short
name "swe".

- Tasks: `python -m envs.swe.build --out DIR` builds them from PyPI packages (bugs injected into
  their functions, checked against their own test suites, each in its test environment from
  `envs.swe.testenv`); `load_tasks(DIR, split)` lists them. SWE-bench Verified instances load
  with `source="swebench"` and run in Docker (`envs.swe.docker`, their history after
  `base_commit` removed by `envs.swe.history`; the synthetic tasks can too, in local images
  from `envs.swe.images`).
- Environment: `make_env("swe", max_steps=30)`; the tool grammar is in `envs.swe.tools`, the
  sandboxing in `envs.swe.jail`, what a submission is graded on and which results the grader
  believes in `envs.swe.grading`, `envs.swe.harness`, `envs.swe.assert_guard` and
  `envs.swe.diffcheck` (`python -m envs.swe.goldcheck` measures their false positives).
- Used as in the example in `envs`: `load_tasks(None, "train")` (data root from
  $SWE_TASKS_DIR), `make_env("swe", max_steps=30)`; each task's `walkthrough` solves it.
"""

from envs.swe.data import (
    DATA_ENV_VAR,
    DEFAULT_DATA_ROOT,
    SPLITS,
    SweTask,
    load_swebench,
    load_tasks,
    resolve_data_root,
)
from envs.swe.env import SweEnv
from envs.swe.jail import JailUnavailableError, Limits, run_harness, run_in_jail
from envs.swe.tools import HELP

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_ROOT",
    "HELP",
    "SPLITS",
    "JailUnavailableError",
    "Limits",
    "SweEnv",
    "SweTask",
    "load_swebench",
    "load_tasks",
    "resolve_data_root",
    "run_harness",
    "run_in_jail",
]
