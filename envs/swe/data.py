"""Repository-repair tasks in the SWE-bench instance schema, and the loaders that list them.

Two sources:
- `synthetic` (default): the instances `python -m envs.swe.build --out DIR` writes to
  `DIR/instances.jsonl`, with the packages' pristine trees under `DIR/trees/`. The data root is
  the loader's argument, else `$SWE_TASKS_DIR`, else `~/.cache/bpo_jax/swe`.
- `swebench`: SWE-bench (Verified) instances from a JSON or JSONL file in the official schema
  (`FAIL_TO_PASS` and `PASS_TO_PASS` as lists or as JSON-encoded strings, as on Hugging Face).
  They run in the Docker executor (`executor="docker"`), which needs Docker.

An instance's SWE-bench fields: `instance_id`, `repo`, `base_commit`, `problem_statement`,
`hints_text`, `created_at`, `version`, `environment_setup_commit`, `FAIL_TO_PASS`,
`PASS_TO_PASS`, `test_patch` and `patch` (the gold fix); fields of neither list (SWE-bench
Verified's `difficulty`, ...) are kept in `SweTask.extra`, and `task_to_instance` gives them all
back. An instance without FAIL_TO_PASS tests is refused. The builder adds: `bug_patch` (turns
the pristine tree into the buggy one; the reverse of `patch`), `package`, `tree` (relative to
the data root), `pythonpath`, `pytest_args`, `test_env` (the package's test environment, a venv
relative to the data root, `envs.swe.testenv`) and `test_requirements` (what it holds besides
pytest), `walkthrough` (expert actions: apply `patch` with the tools and submit) and `mutation`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
from typing import Any

from envs import base
from envs.base import Task
from envs.swe.patching import patched_paths
from envs.swe.swebench import runner

__all__ = [
    "DATA_ENV_VAR",
    "DEFAULT_DATA_ROOT",
    "SPLITS",
    "SweTask",
    "instance_to_task",
    "load_swebench",
    "load_tasks",
    "resolve_data_root",
    "task_to_instance",
]

DATA_ENV_VAR = "SWE_TASKS_DIR"
DEFAULT_DATA_ROOT = "~/.cache/bpo_jax/swe"
INSTANCES_FILE = "instances.jsonl"
# "train" and "test" split the synthetic tasks 80/20 by a hash of the instance id (stable when
# tasks are added); "all" is every task.
SPLITS = ("train", "test", "all")
_BUILD_HINT = (
    "Build the tasks with `python -m envs.swe.build --out DIR` (downloads a few small packages "
    f"from PyPI, then runs offline; a few minutes on 2 cores) and set {DATA_ENV_VAR}=DIR, or "
    "pass the folder as the data root (config: --config.env.data_root=DIR)."
)


@dataclasses.dataclass(frozen=True)
class SweTask(Task):
    """One repository-repair task.

    Attributes:
        task_id: The SWE-bench `instance_id`.
        repo: `owner/name` of the repository.
        base_commit: The commit (or, for synthetic tasks, the content hash of the pristine tree).
        problem_statement: The issue text the agent gets.
        fail_to_pass: Test node ids the fix must make pass.
        pass_to_pass: Test node ids that must keep passing.
        test_patch: Applied to the test files before grading (may be empty).
        patch: The gold fix, as a unified diff against the buggy tree.
        bug_patch: Applied to `tree` at reset to make the buggy tree (synthetic tasks).
        tree: Absolute path of the pristine tree ("" when the executor provides the repository).
        task_type: The package (synthetic) or repository (SWE-bench) name; task types filter on
            it.
        version: The package or SWE-bench version.
        pythonpath: Folders, relative to the tree, put on PYTHONPATH for tests.
        pytest_args: Extra pytest arguments for this repository.
        python: The interpreter of the task's test environment, which jailed commands use
            ("": the env's own).
        test_requirements: What the test environment holds besides pytest (the Docker
            executor's local image installs the same).
        walkthrough: Expert actions that fix the bug and submit.
        source: "synthetic" or "swebench".
        image: Docker image that holds the repository (SWE-bench tasks).
        hints: SWE-bench `hints_text`.
        created_at: SWE-bench `created_at` (when the fix's pull request was opened).
        environment_setup_commit: SWE-bench `environment_setup_commit` (the commit whose
            dependencies the instance's environment was built from).
        extra: The instance's other fields, as they came (kept for `task_to_instance`).
    """

    repo: str = ""
    base_commit: str = ""
    problem_statement: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_patch: str = ""
    patch: str = ""
    bug_patch: str = ""
    tree: str = ""
    task_type: str = ""
    version: str = ""
    pythonpath: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()
    python: str = ""
    test_requirements: tuple[str, ...] = ()
    walkthrough: tuple[str, ...] = ()
    source: str = "synthetic"
    image: str = ""
    hints: str = ""
    created_at: str = ""
    environment_setup_commit: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def test_files(self) -> list[str]:
        """The files holding the FAIL_TO_PASS and PASS_TO_PASS tests, sorted.

        For django and sympy, whose ids name no file, the test files `test_patch` touches.
        """
        if runner(self.repo) != "pytest":
            return sorted(p for p in patched_paths(self.test_patch) if p.endswith(".py"))
        return sorted({n.split("::", 1)[0] for n in (*self.fail_to_pass, *self.pass_to_pass)})


def _as_list(value: Any, field: str, instance_id: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as e:
            raise ValueError(
                f"Instance {instance_id}: {field} is a string but not a JSON list: {value[:80]!r}"
            ) from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"Instance {instance_id}: {field} must be a list of test ids.")
    return tuple(value)


# The fields `instance_to_task` reads; any other is kept in `SweTask.extra`.
_FIELDS = frozenset({
    "instance_id", "repo", "base_commit", "problem_statement", "hints_text", "created_at",
    "version", "environment_setup_commit", "FAIL_TO_PASS", "PASS_TO_PASS", "test_patch", "patch",
    "bug_patch", "tree", "source", "namespace", "image", "package", "pythonpath", "pytest_args",
    "walkthrough", "test_env", "test_requirements",
})  # fmt: skip


def instance_to_task(instance: dict[str, Any], root: pathlib.Path | None = None) -> SweTask:
    """A task from one instance dict (SWE-bench schema plus the builder's fields).

    Raises:
        ValueError: If a required field is missing, a test list is malformed, or FAIL_TO_PASS
            is empty (with no test that the fix must make pass, any patch would grade as
            resolved without a test being run).
    """
    for key in ("instance_id", "repo", "problem_statement", "FAIL_TO_PASS"):
        if key not in instance:
            raise ValueError(
                f"Instance {instance.get('instance_id', '?')!r} has no {key!r} field; expected "
                "the SWE-bench instance schema."
            )
    iid = str(instance["instance_id"])
    fail_to_pass = _as_list(instance.get("FAIL_TO_PASS"), "FAIL_TO_PASS", iid)
    if not fail_to_pass:
        raise ValueError(
            f"Instance {iid}: FAIL_TO_PASS is empty. An instance needs at least one test that "
            "fails before the fix and passes after it; without one every patch, even an empty "
            "one, would grade as resolved."
        )
    tree, test_env = instance.get("tree") or "", instance.get("test_env") or ""
    if tree and root is not None and not os.path.isabs(tree):
        tree = str(root / tree)
    if test_env and root is not None and not os.path.isabs(test_env):
        test_env = str(root / test_env)
    source = str(instance.get("source") or ("synthetic" if tree else "swebench"))
    image = instance.get("image") or (
        "" if source == "synthetic" else swebench_image(iid, instance.get("namespace"))
    )
    return SweTask(
        task_id=iid,
        repo=str(instance["repo"]),
        base_commit=str(instance.get("base_commit", "")),
        problem_statement=str(instance["problem_statement"]),
        fail_to_pass=fail_to_pass,
        pass_to_pass=_as_list(instance.get("PASS_TO_PASS"), "PASS_TO_PASS", iid),
        test_patch=str(instance.get("test_patch") or ""),
        patch=str(instance.get("patch") or ""),
        bug_patch=str(instance.get("bug_patch") or ""),
        tree=tree,
        task_type=str(instance.get("package") or instance["repo"].split("/")[-1]),
        version=str(instance.get("version", "")),
        pythonpath=tuple(instance.get("pythonpath") or ()),
        pytest_args=tuple(instance.get("pytest_args") or ()),
        python=os.path.join(test_env, "bin", "python") if test_env else "",
        test_requirements=tuple(instance.get("test_requirements") or ()),
        walkthrough=tuple(instance.get("walkthrough") or ()),
        source=source,
        image=image,
        hints=str(instance.get("hints_text") or ""),
        created_at=str(instance.get("created_at") or ""),
        environment_setup_commit=str(instance.get("environment_setup_commit") or ""),
        extra={k: v for k, v in instance.items() if k not in _FIELDS},
    )


def swebench_image(instance_id: str, namespace: str | None = None) -> str:
    """The official SWE-bench evaluation image of an instance (Docker Hub naming)."""
    name = instance_id.lower().replace("__", "_1776_")
    return f"{namespace or 'swebench'}/sweb.eval.x86_64.{name}:latest"


def task_to_instance(task: SweTask) -> dict[str, Any]:
    """The SWE-bench fields of a task, and the other fields it was loaded with (`extra`).

    FAIL_TO_PASS and PASS_TO_PASS are lists (SWE-bench's harness reads lists and JSON strings).
    """
    return {
        "instance_id": task.task_id,
        "repo": task.repo,
        "base_commit": task.base_commit,
        "problem_statement": task.problem_statement,
        "hints_text": task.hints,
        "created_at": task.created_at,
        "version": task.version,
        "environment_setup_commit": task.environment_setup_commit,
        "FAIL_TO_PASS": list(task.fail_to_pass),
        "PASS_TO_PASS": list(task.pass_to_pass),
        "test_patch": task.test_patch,
        "patch": task.patch,
        **task.extra,
    }


def resolve_data_root(root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The folder with the built tasks: `root`, else `$SWE_TASKS_DIR`, else the default.

    Raises:
        FileNotFoundError: If it or its instances file is missing (the message says how to
            build them).
    """
    return base.resolve_data_root(
        root,
        env_var=DATA_ENV_VAR,
        default=DEFAULT_DATA_ROOT,
        label="SWE tasks folder",
        hint=_BUILD_HINT,
        marker=INSTANCES_FILE,
    )


def _split_of(instance_id: str) -> str:
    bucket = int(hashlib.sha1(instance_id.encode()).hexdigest()[:8], 16) % 5
    return "test" if bucket == 0 else "train"


def _select(tasks, split, task_types, limit, seed):
    if split not in SPLITS:
        raise ValueError(f"Unknown SWE split {split!r}; expected one of {list(SPLITS)}.")
    if isinstance(task_types, str):
        raise ValueError(
            f"task_types must be a list of package names, got the string {task_types!r}; wrap "
            f"it in a list: [{task_types!r}]."
        )
    if task_types:
        known = sorted({t.task_type for t in tasks})
        unknown = [t for t in task_types if t not in known]
        if unknown:
            raise ValueError(f"Unknown SWE task type(s) {unknown}; the tasks have {known}.")
        tasks = [t for t in tasks if t.task_type in task_types]
    if split != "all":
        tasks = [t for t in tasks if _split_of(t.task_id) == split]
    tasks.sort(key=lambda t: t.task_id)
    if seed is not None:
        random.Random(seed).shuffle(tasks)
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be non-negative or None, got {limit}.")
        tasks = tasks[:limit]
    return tasks


def _read_instances(path: pathlib.Path) -> list[dict[str, Any]]:
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith("["):
        data = json.loads(text)
        if isinstance(data, dict):
            data = [data]
        return list(data)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_tasks(
    root: str | os.PathLike[str] | None,
    split: str = "all",
    task_types: tuple[str, ...] | list[str] | None = None,
    limit: int | None = None,
    seed: int | None = None,
    source: str = "synthetic",
) -> list[SweTask]:
    """Lists tasks.

    Args:
        root: Synthetic: the build folder (None: `$SWE_TASKS_DIR` or the default). SWE-bench:
            the JSON/JSONL file of instances (or a folder holding one `*.jsonl`/`*.json`).
        split: "train", "test" (80/20 by instance-id hash) or "all".
        task_types: Keep only these packages (SWE-bench: repository names, e.g. "django").
        limit: Keep at most this many (after filtering).
        seed: Shuffle with this seed before `limit`; without it tasks are in id order.
        source: "synthetic" or "swebench".

    Raises:
        FileNotFoundError: If the tasks are missing (the message says how to get them).
        ValueError: For a bad split, task type, limit or source.
    """
    if source == "synthetic":
        data_root = resolve_data_root(root)
        instances = _read_instances(data_root / INSTANCES_FILE)
        if not instances:
            raise FileNotFoundError(
                f"no tasks found under {str(data_root)!r}: its {INSTANCES_FILE} lists no "
                f"instance. {_BUILD_HINT}"
            )
        tasks = [instance_to_task(i, data_root) for i in instances]
        missing = sorted({t.tree for t in tasks if not os.path.isdir(t.tree)})
        if missing:
            raise FileNotFoundError(
                f"{INSTANCES_FILE} in {str(data_root)!r} names trees that are not there "
                f"({missing[:3]}); the build folder is incomplete. {_BUILD_HINT}"
            )
    elif source == "swebench":
        tasks = load_swebench(root)
    else:
        raise ValueError(f"Unknown SWE task source {source!r}; expected 'synthetic' or 'swebench'.")
    return _select(tasks, split, task_types, limit, seed)


def load_swebench(path: str | os.PathLike[str] | None) -> list[SweTask]:
    """SWE-bench (Verified) instances from a JSON/JSONL file in the official schema.

    Get the file with `datasets` (`load_dataset("princeton-nlp/SWE-bench_Verified",
    split="test").to_json("verified.jsonl")`) on a machine with internet access.
    """
    if not path:
        raise FileNotFoundError(
            "source='swebench' needs the path of a SWE-bench JSON/JSONL file as the data root "
            "(e.g. --config.env.data_root=/data/swebench_verified.jsonl)."
        )
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        found = sorted([*p.glob("*.jsonl"), *p.glob("*.json")])
        if len(found) != 1:
            raise FileNotFoundError(
                f"{str(p)!r} should hold exactly one *.jsonl or *.json file of SWE-bench "
                f"instances; found {[f.name for f in found]}."
            )
        p = found[0]
    if not p.is_file():
        raise FileNotFoundError(f"SWE-bench instances file {str(p)!r} does not exist.")
    instances = _read_instances(p)
    if not instances:
        raise FileNotFoundError(f"no SWE-bench instances found in {str(p)!r}: the file is empty.")
    return [instance_to_task(i) for i in instances]
