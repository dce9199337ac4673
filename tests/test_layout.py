"""The package layout: imports run only downward, as each package's docstring declares.

Every package of `bpo_jax` says in its `__init__` docstring which other units it may import
(`May import: a, b.`); the top-level modules (the run) say it in `bpo_jax/__init__.py`. This test
reads those lines, checks that the declared graph has no cycle, and that every import in the
library (module level or inside a function) follows it. `envs/` imports nothing from bpo_jax.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "bpo_jax"
RUN = "run"  # The top-level modules of bpo_jax.
MAX_LINES = 500  # A library file a reader can hold.


def _unit(module: str) -> str:
    """`bpo_jax.rollout.engine` -> `rollout`; `bpo_jax.train` -> `run`."""
    parts = module.split(".")
    if len(parts) >= 2 and (PKG / parts[1]).is_dir():
        return parts[1]
    return RUN


def _declared() -> dict[str, set[str]]:
    """Unit -> the units its docstring says it may import."""
    out = {}
    sources = {RUN: PKG / "__init__.py"}
    sources |= {p.parent.name: p for p in PKG.glob("*/__init__.py")}
    for unit, path in sources.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        pattern = r"may import:(.*?)\.\s*(?:\n\n|$)"
        match = re.search(pattern, doc, re.IGNORECASE | re.DOTALL)
        assert match, f"{path.relative_to(REPO)}: its docstring has no 'May import: ...' line."
        text = " ".join(match.group(1).split())
        out[unit] = (
            set() if text == "nothing from bpo_jax" else {t.strip() for t in text.split(",")}
        )
    return out


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_pkg else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def test_declared_graph_is_acyclic_and_names_real_units():
    declared = _declared()
    units = set(declared)
    for unit, deps in declared.items():
        assert deps <= units, f"{unit} declares unknown units {sorted(deps - units)}"
        assert unit not in deps
    done, active = set(), []

    def visit(u):
        assert u not in active, f"import cycle in the declared layers: {active + [u]}"
        if u in done:
            return
        active.append(u)
        for d in declared[u]:
            visit(d)
        active.pop()
        done.add(u)

    for u in sorted(units):
        visit(u)


def test_imports_follow_the_declared_directions():
    declared = _declared()
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path, PKG)
        src = _unit(module)
        for line, name in _imports(path, module):
            if not (name == "bpo_jax" or name.startswith("bpo_jax.")):
                continue
            dst = _unit(name)
            if dst != src and dst not in declared[src]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {src} imports {dst} ({name})")
    assert not wrong, "imports against the declared directions:\n" + "\n".join(wrong)


def test_envs_import_nothing_from_bpo_jax():
    root = REPO / "envs"
    wrong = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        for line, name in _imports(path, _module_name(path, root))
        if name == "bpo_jax" or name.startswith("bpo_jax.")
    ]
    assert not wrong, "envs/ must not import bpo_jax:\n" + "\n".join(wrong)


@pytest.mark.parametrize("root", ["bpo_jax", "envs"])
def test_library_files_a_reader_can_hold(root):
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted((REPO / root).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"library files over {MAX_LINES} lines (split them by role): {long}"
