"""The PyPI packages the task builder mutates: small, pure Python, fast test suites in the sdist.

Each spec pins a version and the sha256 of its source archive, so that a build is reproducible
and a changed archive is noticed. `sources` are the modules whose functions get bugs; `tests`
what pytest runs. Suites were chosen to pass under the jail (no network, an unprivileged uid,
pytest's plugin autoload off) in a few seconds each, with each package's own pytest options, in
its test environment (`envs.swe.testenv`: the plugins those options need, its test extras).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DEFAULT_PACKAGES", "PACKAGES", "PackageSpec"]


@dataclasses.dataclass(frozen=True)
class PackageSpec:
    """One package to build tasks from.

    Attributes:
        name: PyPI project name.
        version: Exact version.
        sha256: sha256 of the source archive ("" skips the check: local test fixtures only).
        repo: Upstream `owner/name`, the instances' `repo` field.
        sources: Files (relative to the archive's top folder) whose functions are mutated.
        tests: Test files or folders pytest runs.
        pythonpath: Folders put on PYTHONPATH (e.g. "src"); the root is always importable.
        pytest_args: Extra pytest arguments.
        archive: A local archive to use instead of downloading (tests, offline builds).
    """

    name: str
    version: str
    sha256: str
    repo: str
    sources: tuple[str, ...]
    tests: tuple[str, ...]
    pythonpath: tuple[str, ...] = (".",)
    pytest_args: tuple[str, ...] = ()
    archive: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackageSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"Unknown package spec field(s) {sorted(unknown)}; known: {fields}.")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)


PACKAGES: dict[str, PackageSpec] = {
    spec.name: spec
    for spec in (
        PackageSpec(
            name="inflection",
            version="0.5.1",
            sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
            repo="jpvanhal/inflection",
            sources=("inflection/__init__.py",),
            tests=("test_inflection.py",),
        ),
        PackageSpec(
            name="parse",
            version="1.22.4",
            sha256="706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
            repo="r1chardj0n3s/parse",
            sources=("parse/__init__.py",),
            tests=("tests",),
        ),
        PackageSpec(
            name="cachetools",
            version="8.0.2",
            sha256="30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
            repo="tkem/cachetools",
            sources=(
                "src/cachetools/__init__.py",
                "src/cachetools/_cached.py",
                "src/cachetools/_cachedmethod.py",
                "src/cachetools/func.py",
                "src/cachetools/keys.py",
            ),
            tests=("tests",),
            pythonpath=("src",),
        ),
        PackageSpec(
            name="toolz",
            version="1.0.0",
            sha256="2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02",
            repo="pytoolz/toolz",
            sources=(
                "toolz/itertoolz.py",
                "toolz/dicttoolz.py",
                "toolz/functoolz.py",
                "toolz/recipes.py",
            ),
            tests=("toolz/tests",),
        ),
        PackageSpec(
            name="six",
            version="1.17.0",
            sha256="ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81",
            repo="benjaminp/six",
            sources=("six.py",),
            tests=("test_six.py",),
        ),
        PackageSpec(
            name="semver",
            version="3.1.2",
            sha256="bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf",
            repo="python-semver/python-semver",
            sources=("src/semver/version.py", "src/semver/_deprecated.py"),
            tests=("tests",),
            pythonpath=("src", "tests"),
            pytest_args=("--import-mode=importlib",),
        ),
    )
}

# What `python -m envs.swe.build` builds without --packages.
DEFAULT_PACKAGES = ("inflection", "parse", "cachetools", "toolz", "semver")
