"""Builds repository-repair tasks from PyPI packages: `python -m envs.swe.build --out DIR`.

For each package (`envs.swe.packages`): download its source archive with pip (checked against
the pinned sha256), extract the pristine tree, make its test environment (`envs.swe.testenv`: a
venv with what its own test configuration needs, from the registry), run its test suite in a
jail, then inject bugs one at a time (`envs.swe.mutate`) and run the suite again. A mutant is
kept when it breaks at least one test that passed and at most `--max-fail` of them; the broken
tests become FAIL_TO_PASS, the other tests of the same files PASS_TO_PASS. Each kept mutant
becomes one SWE-bench-schema instance (`envs.swe.instances`).

Layout of DIR:
    archives/              source archives as downloaded
    trees/<name>-<ver>/    pristine trees (the tasks' base trees; read-only)
    envs/<name>-<ver>-<h>/ test environments (venvs), by their requirements
    work/<name>-<ver>/     baseline.json and mutants/<id>.json: every test run's verdict
    instances.jsonl        the tasks (what `envs.swe.load_tasks` reads)
    manifest.json          counts per package, build time, settings

Incremental: archives, trees, environments and every mutant's verdict are cached, so a second
run only tests what is new (e.g. a larger --per-package), and `instances.jsonl` is rewritten from
the cache. A package that cannot be built (its download, environment or pristine suite fails)
is reported and skipped: the other packages' tasks are still written (with exit status 1), and a
later run resumes from what was cached.
Parallel: `--jobs` test runs at once (default: the number of CPUs).
Only the download needs the network; `--offline` refuses to download.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from envs.swe.env import jail_pythonpath, pytest_command
from envs.swe.instances import make_instance
from envs.swe.jail import Limits, run_in_jail
from envs.swe.mutate import Mutant, find_mutants, is_valid
from envs.swe.packages import DEFAULT_PACKAGES, PACKAGES, PackageSpec
from envs.swe.patching import tree_hash
from envs.swe.results import TestOutcomes
from envs.swe.testenv import TestEnv, ensure, requirements

__all__ = ["BuildError", "build", "main"]

_FORMAT_VERSION = 1  # Bumped when cached verdicts must be recomputed.


class BuildError(RuntimeError):
    """A package could not be fetched, extracted or tested; the message says why."""


@dataclasses.dataclass
class _Package:
    spec: PackageSpec
    tree: Path
    work: Path
    env: TestEnv
    passing: list[str]
    baseline_s: float


def _log(message: str) -> None:
    print(f"[swe-build] {message}", flush=True)


# Fetching ----------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _archive_candidates(folder: Path, spec: PackageSpec) -> list[Path]:
    stems = {f"{spec.name}-{spec.version}", f"{spec.name.replace('-', '_')}-{spec.version}"}
    return sorted(
        p
        for p in folder.glob("*")
        if any(p.name.lower().startswith(s.lower() + ".") for s in stems)
        and p.name.endswith((".tar.gz", ".zip", ".tgz"))
    )


def fetch(spec: PackageSpec, archives: Path, offline: bool = False) -> Path:
    """The package's source archive in `archives`, downloaded with pip if not there yet."""
    archives.mkdir(parents=True, exist_ok=True)
    if spec.archive:
        source = Path(spec.archive)
        if not source.is_file():
            raise BuildError(f"{spec.key}: the local archive {source} does not exist.")
        target = archives / source.name
        if not target.exists() or _sha256(target) != _sha256(source):
            shutil.copyfile(source, target)
        found = [target]
    else:
        found = _archive_candidates(archives, spec)
    if not found:
        if offline:
            raise BuildError(
                f"{spec.key}: no source archive in {archives} and --offline forbids downloading "
                f"it. Put {spec.name}-{spec.version}.tar.gz there, or drop --offline."
            )
        _log(f"{spec.key}: downloading the source archive with pip")
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-d", str(archives), f"{spec.name}=={spec.version}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        found = _archive_candidates(archives, spec)
        if result.returncode != 0 and not found:
            raise BuildError(
                f"{spec.key}: `pip download` failed (exit status {result.returncode}):\n"
                f"{(result.stdout + result.stderr).strip()[-1500:]}"
            )
        if not found:
            raise BuildError(f"{spec.key}: pip downloaded no source archive into {archives}.")
    archive = found[0]
    if spec.sha256 and _sha256(archive) != spec.sha256:
        raise BuildError(
            f"{spec.key}: {archive} has sha256 {_sha256(archive)}, not the pinned {spec.sha256}. "
            "Delete it to download it again, or update the pin in envs/swe/packages.py."
        )
    return archive


def extract(archive: Path, tree: Path) -> None:
    """Extracts the archive's single top folder into `tree` (atomically; kept if present)."""
    if tree.is_dir():
        return
    tree.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".extract-", dir=tree.parent))
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                for name in z.namelist():
                    if name.startswith("/") or ".." in Path(name).parts:
                        raise BuildError(f"{archive}: unsafe member path {name!r}.")
                z.extractall(scratch)
        else:
            with tarfile.open(archive) as t:
                t.extractall(scratch, filter="data")
        tops = [p for p in scratch.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise BuildError(f"{archive}: expected one top folder, found {[p.name for p in tops]}.")
        for path in tops[0].rglob("*"):  # The trees are read by jails only: no links.
            if path.is_symlink():
                path.unlink()
        tops[0].rename(tree)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Test runs ---------------------------------------------------------------------------------------


def run_suite(
    spec: PackageSpec,
    tree: Path,
    files: dict[str, bytes | None],
    timeout_s: float,
    env: TestEnv,
) -> tuple[TestOutcomes, bool, float, str]:
    """Runs the package's tests on `tree` + `files` in its test environment: (outcomes, timed
    out, seconds, output)."""
    result = run_in_jail(
        str(tree),
        files,
        pytest_command(env.python, (*spec.pytest_args, *env.plugin_args), spec.tests),
        limits=Limits(timeout_s=timeout_s),
        env={"PYTHONPATH": jail_pythonpath(spec.pythonpath)},
        pytest_report=True,
        python=env.python,
    )
    if result.error:
        raise BuildError(f"{spec.key}: the jail failed: {result.error}")
    return TestOutcomes(result.report), result.timed_out, result.elapsed_s, result.output


def _baseline(spec: PackageSpec, tree: Path, work: Path, env: TestEnv) -> _Package:
    path = work / "baseline.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("format") == _FORMAT_VERSION:
            return _Package(spec, tree, work, env, data["passing"], data["seconds"])
    outcomes, timed_out, seconds, output = run_suite(spec, tree, {}, 300, env)
    passing = sorted(outcomes.passing())
    if timed_out or len(passing) < 5:
        raise BuildError(
            f"{spec.key}: the pristine test suite {'timed out' if timed_out else 'passed only '}"
            f"{'' if timed_out else f'{len(passing)} tests'}; cannot build tasks from it. "
            f"Output:\n{output[-1500:]}"
        )
    work.mkdir(parents=True, exist_ok=True)
    record = {"format": _FORMAT_VERSION, "passing": passing, "seconds": seconds,
              "counts": outcomes.counts()}  # fmt: skip
    path.write_text(json.dumps(record, indent=1))
    _log(f"{spec.key}: baseline {outcomes.counts()} in {seconds:.1f} s")
    return _Package(spec, tree, work, env, passing, seconds)


def _prepare(spec: PackageSpec, root: Path, offline: bool, log: Callable[[str], None]) -> _Package:
    """Fetches, extracts and baselines one package in its test environment.

    Raises:
        BuildError: If any step fails.
    """
    try:
        archive = fetch(spec, root / "archives", offline=offline)
        tree = root / "trees" / spec.key
        extract(archive, tree)
    except (OSError, subprocess.SubprocessError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise BuildError(f"{spec.key}: fetching or extracting it failed: {e}") from e
    try:
        env = ensure(root, spec.key, requirements(tree, spec.name, spec.pytest_args),
                     offline=offline, log=log)  # fmt: skip
    except RuntimeError as e:
        raise BuildError(f"{spec.key}: its test environment could not be made: {e}") from e
    return _baseline(spec, tree, root / "work" / spec.key, env)


def _candidates(pkg: _Package, seed: int, per_function: int) -> list[tuple[Mutant, str]]:
    """Mutants of the package's sources, shuffled, at most `per_function` per function, one
    function after another so that the first picks are spread over the code."""
    by_function: dict[str, list[tuple[Mutant, str]]] = {}
    for pattern in pkg.spec.sources:
        matches = sorted(glob.glob(str(pkg.tree / pattern)))
        if not matches:
            raise BuildError(f"{pkg.spec.key}: source {pattern!r} matches no file in the tree.")
        for path in matches:
            rel = os.path.relpath(path, pkg.tree).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                source = f.read()
            for mutant in find_mutants(rel, source, check=False):
                by_function.setdefault(f"{rel}:{mutant.function}", []).append((mutant, source))
    rng = random.Random(f"{seed}:{pkg.spec.key}")
    groups = [by_function[k] for k in sorted(by_function)]
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    ordered = []
    for rank in range(per_function):
        ordered.extend(group[rank] for group in groups if rank < len(group))
    return ordered


def _verdict(pkg: _Package, mutant: Mutant, source: str) -> dict[str, Any]:
    """Tests one mutant (or reads its cached verdict): which passing tests it breaks."""
    cache = pkg.work / "mutants" / (mutant.mutant_id.replace("/", "_").replace(":", "_") + ".json")
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("format") == _FORMAT_VERSION:
            return data
    verdict: dict[str, Any] = {"format": _FORMAT_VERSION, "mutant": dataclasses.asdict(mutant)}
    if not is_valid(mutant, source):
        verdict.update(invalid=True, timed_out=False, seconds=0.0, broken=[], messages={})
    else:
        timeout = max(20.0, 5 * pkg.baseline_s + 10)
        files = {mutant.path: mutant.apply(source).encode()}
        outcomes, timed_out, seconds, _ = run_suite(pkg.spec, pkg.tree, files, timeout, pkg.env)
        broken = sorted(set(pkg.passing) - outcomes.passing())
        verdict.update(
            timed_out=timed_out,
            seconds=seconds,
            broken=broken,
            messages={n: outcomes.messages.get(n, "")[:500] for n in broken[:200]},
        )
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(verdict))
    tmp.replace(cache)
    return verdict


def _status(verdict: dict[str, Any], max_fail: int) -> str:
    """kept | survived (breaks nothing) | too_broad (breaks > max_fail) | timeout | invalid."""
    if verdict.get("invalid"):
        return "invalid"
    if verdict["timed_out"]:
        return "timeout"
    if not verdict["broken"]:
        return "survived"
    return "too_broad" if len(verdict["broken"]) > max_fail else "kept"


def _build_package(
    pkg: _Package,
    pool: concurrent.futures.Executor,
    jobs: int,
    *,
    per_package: int,
    max_candidates: int,
    max_fail: int,
    per_function: int,
    seed: int,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    candidates = _candidates(pkg, seed, per_function)[:max_candidates]
    kept: list[tuple[int, dict[str, Any]]] = []
    statuses: dict[str, int] = {}
    pending: dict[concurrent.futures.Future, int] = {}
    next_index = 0
    while (next_index < len(candidates) or pending) and len(kept) < per_package:
        while next_index < len(candidates) and len(pending) < jobs:
            mutant, source = candidates[next_index]
            pending[pool.submit(_verdict, pkg, mutant, source)] = next_index
            next_index += 1
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
            index = pending.pop(future)
            verdict = future.result()
            status = _status(verdict, max_fail)
            statuses[status] = statuses.get(status, 0) + 1
            if status == "kept":
                kept.append((index, verdict))
    # Finish what is in flight: the tested mutants then form a prefix of `candidates`, and the
    # first `per_package` kept ones of it do not depend on the order the runs finished in.
    for future, index in pending.items():
        verdict = future.result()
        status = _status(verdict, max_fail)
        statuses[status] = statuses.get(status, 0) + 1
        if status == "kept":
            kept.append((index, verdict))
    kept.sort(key=lambda item: item[0])
    instances = []
    base_commit = tree_hash(str(pkg.tree))
    for _, verdict in kept[:per_package]:
        mutant = Mutant(**verdict["mutant"])
        source = (pkg.tree / mutant.path).read_text(encoding="utf-8")
        f2p = verdict["broken"]
        files = {n.split("::", 1)[0] for n in f2p}
        p2p = [n for n in pkg.passing if n.split("::", 1)[0] in files and n not in set(f2p)]
        instances.append(
            make_instance(
                pkg.spec,
                tree=os.path.relpath(pkg.tree, pkg.work.parent.parent),
                base_commit=base_commit,
                mutant=mutant,
                original_source=source,
                fail_to_pass=f2p,
                pass_to_pass=p2p,
                messages=verdict["messages"],
                pytest_args=(*pkg.spec.pytest_args, *pkg.env.plugin_args),
                test_env=os.path.relpath(pkg.env.folder, pkg.work.parent.parent)
                if pkg.env.folder
                else "",
                test_requirements=pkg.env.requirements,
            )
        )
    statuses["evaluated"] = sum(v for k, v in statuses.items())
    return instances, statuses


def build(
    out: str | os.PathLike[str],
    packages: Sequence[PackageSpec],
    *,
    per_package: int = 30,
    jobs: int | None = None,
    max_candidates: int = 150,
    max_fail: int = 40,
    per_function: int = 3,
    seed: int = 0,
    offline: bool = False,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Builds (or updates) the tasks in `out`; returns the manifest (also in manifest.json).

    Args:
        out: Output folder (see the module docstring for its layout).
        packages: What to build from.
        per_package: Tasks to keep per package (fewer if the candidates run out).
        jobs: Test runs at once (default: CPUs).
        max_candidates: Most mutants tested per package.
        max_fail: Most tests a kept mutant may break (more is a bug too blunt to be a task).
        per_function: Most mutants tried per function.
        seed: Seeds which mutants are tried first.
        offline: Never download; archives must be in `out/archives` (or given by the spec).
    """
    started = time.monotonic()
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    all_instances: list[dict[str, Any]] = []
    per_pkg: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for spec in packages:
            t0 = time.monotonic()
            try:
                pkg = _prepare(spec, root, offline, log)
                instances, statuses = _build_package(
                    pkg, pool, jobs, per_package=per_package, max_candidates=max_candidates,
                    max_fail=max_fail, per_function=per_function, seed=seed,
                )  # fmt: skip
            except BuildError as e:
                skipped[spec.name] = str(e)
                log(f"{spec.key}: skipped, it cannot be built: {e}")
                continue
            seconds = time.monotonic() - t0
            log(f"{spec.key}: {len(instances)} tasks ({statuses}) in {seconds:.0f} s")
            per_pkg[spec.name] = {
                "version": spec.version,
                "tasks": len(instances),
                "verdicts": statuses,
                "baseline_tests": len(pkg.passing),
                "test_requirements": list(pkg.env.requirements),
                "seconds": round(seconds, 1),
            }
            all_instances.extend(instances)
    tmp = root / "instances.jsonl.tmp"
    with open(tmp, "w") as f:
        for instance in all_instances:
            f.write(json.dumps(instance) + "\n")
    tmp.replace(root / "instances.jsonl")
    manifest = {
        "tasks": len(all_instances),
        "packages": per_pkg,
        "skipped": skipped,
        "seconds": round(time.monotonic() - started, 1),
        "settings": {"per_package": per_package, "jobs": jobs, "max_candidates": max_candidates,
                     "max_fail": max_fail, "per_function": per_function, "seed": seed},
    }  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(f"{len(all_instances)} tasks from {len(per_pkg)} packages in {manifest['seconds']} s "
        f"-> {root / 'instances.jsonl'}")  # fmt: skip
    if skipped:
        log(
            f"skipped {len(skipped)} package(s) that could not be built: {', '.join(skipped)} "
            "(the reasons are above and in manifest.json; a rerun resumes from the cache)"
        )
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envs.swe.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="output folder (then SWE_TASKS_DIR=OUT)")
    parser.add_argument(
        "--packages",
        default=",".join(DEFAULT_PACKAGES),
        help=f"comma-separated names from {sorted(PACKAGES)} (default: %(default)s)",
    )
    parser.add_argument("--spec", help="JSON file with a list of package specs (PackageSpec)")
    parser.add_argument("--per-package", type=int, default=30, help="tasks per package")
    parser.add_argument("--jobs", type=int, default=None, help="test runs at once (CPUs)")
    parser.add_argument("--max-candidates", type=int, default=150, help="mutants per package")
    parser.add_argument("--max-fail", type=int, default=40, help="most tests a bug may break")
    parser.add_argument("--per-function", type=int, default=3, help="mutants per function")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true", help="never download")
    args = parser.parse_args(argv)
    if args.spec:
        specs = [PackageSpec.from_dict(d) for d in json.loads(Path(args.spec).read_text())]
    else:
        names = [n.strip() for n in args.packages.split(",") if n.strip()]
        unknown = [n for n in names if n not in PACKAGES]
        if unknown:
            parser.error(f"unknown package(s) {unknown}; known: {sorted(PACKAGES)}")
        specs = [PACKAGES[n] for n in names]
    try:
        manifest = build(
            args.out, specs, per_package=args.per_package, jobs=args.jobs,
            max_candidates=args.max_candidates, max_fail=args.max_fail,
            per_function=args.per_function, seed=args.seed, offline=args.offline,
        )  # fmt: skip
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if manifest["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
