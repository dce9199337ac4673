"""Bug injection: single-line AST mutations inside functions.

`find_mutants(path, source)` lists every mutation site of one module; each `Mutant` changes one
span of one line, so that its fix is a one-line `replace`. Kinds:

- `operator`: arithmetic and bitwise operators (`+`/`-`, `*`/`//`, `<<`/`>>`, ...), boolean
  operators (`and`/`or`) and comparisons (`<`/`<=`, `==`/`!=`, `in`/`not in`, `is`/`is not`);
- `constant`: integers (`n` -> `n + 1`, 1 -> 0) and booleans (`True`/`False`);
- `condition`: the test of an `if`, `elif`, `while` or conditional expression negated
  (`not (...)`), or a `not` removed;
- `off_by_one`: slice bounds and `range()` bounds moved by one, integer subscripts shifted.

Sites are found with `ast` and spliced into the source text by column, so the rest of the file
(formatting, comments) is unchanged. Docstrings and code outside functions are left alone.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import threading

__all__ = ["KINDS", "Mutant", "find_mutants", "is_valid"]

KINDS = ("operator", "constant", "condition", "off_by_one")

_BINOP_SWAP = {
    ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"), ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"),
    ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&"), ast.BitXor: ("^", "&"), ast.Pow: ("**", "*"),
}  # fmt: skip
_CMP_SWAP = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
}  # fmt: skip
_BOOL_SWAP = {ast.And: ("and", "or"), ast.Or: ("or", "and")}


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One mutation: replace `original` at (line, col) of `path` with `replacement`.

    Attributes:
        path: Module path relative to the package root.
        line: 1-based line number.
        col, end_col: Character span of `original` on that line (0-based, end exclusive).
        original, replacement: The text before and after.
        kind: One of `KINDS`.
        function: Qualified name of the enclosing function.
    """

    path: str
    line: int
    col: int
    end_col: int
    original: str
    replacement: str
    kind: str
    function: str

    @property
    def mutant_id(self) -> str:
        """Stable id: path, line, kind and a short hash of the edit."""
        key = (
            f"{self.path}:{self.line}:{self.col}:{self.end_col}:{self.original}->{self.replacement}"
        )
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        return f"{self.path}:{self.line}:{self.kind}:{digest}"

    def apply(self, source: str) -> str:
        """The mutated source. Raises ValueError if `source` is not the one it was found in."""
        lines = source.splitlines(keepends=True)
        text = lines[self.line - 1]
        if text[self.col : self.end_col] != self.original:
            raise ValueError(f"{self.mutant_id} does not match line {self.line} of {self.path}.")
        lines[self.line - 1] = text[: self.col] + self.replacement + text[self.end_col :]
        return "".join(lines)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str]):
        self.path = path
        self.lines = lines
        self.stack: list[str] = []
        self.depth = 0  # Function nesting depth: only code inside functions is mutated.
        self.found: list[Mutant] = []
        self.skip: set[int] = set()
        self.in_slice = 0
        self.in_range = 0

    # Helpers ------------------------------------------------------------------------------------

    def _add(self, line, col, end_col, replacement, kind):
        original = self.lines[line - 1][col:end_col]
        if not original or original == replacement:
            return
        self.found.append(
            Mutant(self.path, line, col, end_col, original, replacement, kind, ".".join(self.stack))
        )

    def _between(self, left: ast.AST, right: ast.AST, token: str, replacement: str, kind: str):
        """Mutates the one `token` between two nodes on the same line."""
        if left.end_lineno != right.lineno:
            return
        line = left.end_lineno
        lo, hi = left.end_col_offset, right.col_offset
        segment = self.lines[line - 1][lo:hi]
        stripped = segment.replace("(", " ").replace(")", " ")
        if stripped.split() != token.split():
            return
        start = segment.find(token.split()[0])
        end = segment.rfind(token.split()[-1]) + len(token.split()[-1])
        if start < 0:
            return
        self._add(line, lo + start, lo + end, replacement, kind)

    def _single_line(self, node: ast.AST) -> bool:
        return getattr(node, "lineno", None) == getattr(node, "end_lineno", -1)

    # Scopes -------------------------------------------------------------------------------------

    def visit_FunctionDef(self, node):
        self.stack.append(node.name)
        self.depth += 1
        for child in node.body:
            self.visit(child)
        self.depth -= 1
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self.stack.append(node.name)
        for child in node.body:
            self.visit(child)
        self.stack.pop()

    # Sites --------------------------------------------------------------------------------------

    def visit_BinOp(self, node):
        if self.depth and type(node.op) in _BINOP_SWAP and not _is_string_format(node):
            token, replacement = _BINOP_SWAP[type(node.op)]
            self._between(node.left, node.right, token, replacement, "operator")
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if self.depth and type(node.op) in _BINOP_SWAP and self._single_line(node):
            token, replacement = _BINOP_SWAP[type(node.op)]
            self._between(node.target, node.value, token + "=", replacement + "=", "operator")
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        if self.depth:
            token, replacement = _BOOL_SWAP[type(node.op)]
            self._between(node.values[0], node.values[1], token, replacement, "operator")
        self.generic_visit(node)

    def visit_Compare(self, node):
        if self.depth and type(node.ops[0]) in _CMP_SWAP:
            token, replacement = _CMP_SWAP[type(node.ops[0])]
            self._between(node.left, node.comparators[0], token, replacement, "operator")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if not self.depth or id(node) in self.skip or not self._single_line(node):
            return
        value = node.value
        kind = "off_by_one" if (self.in_slice or self.in_range) else "constant"
        if isinstance(value, bool):
            self._add(node.lineno, node.col_offset, node.end_col_offset, str(not value), kind)
        elif isinstance(value, int):
            replacement = "0" if value == 1 else str(value + 1)
            text = self.lines[node.lineno - 1][node.col_offset : node.end_col_offset]
            if text.isdigit():  # Plain decimal literals only (not 0x10, 1_000).
                self._add(node.lineno, node.col_offset, node.end_col_offset, replacement, kind)

    def _negate(self, test: ast.expr):
        if not self._single_line(test):
            return
        line = test.lineno
        text = self.lines[line - 1][test.col_offset : test.end_col_offset]
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            operand = self.lines[line - 1][test.operand.col_offset : test.operand.end_col_offset]
            if test.operand.lineno == line and test.operand.end_lineno == line:
                self._add(line, test.col_offset, test.end_col_offset, operand, "condition")
            return
        simple = isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        replacement = f"not {text}" if simple else f"not ({text})"
        self._add(line, test.col_offset, test.end_col_offset, replacement, "condition")

    def visit_If(self, node):
        if self.depth:
            self._negate(node.test)
        self.generic_visit(node)

    visit_While = visit_If

    def visit_IfExp(self, node):
        if self.depth:
            self._negate(node.test)
        self.generic_visit(node)

    def visit_Slice(self, node):
        self.in_slice += 1
        for bound in (node.lower, node.upper):
            if bound is not None and self.depth and self._single_line(bound):
                if not isinstance(bound, ast.Constant):
                    text = self.lines[bound.lineno - 1][bound.col_offset : bound.end_col_offset]
                    wrapped = (
                        text
                        if isinstance(bound, (ast.Name, ast.Attribute, ast.Call))
                        else f"({text})"
                    )
                    self._add(
                        bound.lineno, bound.col_offset, bound.end_col_offset, f"{wrapped} + 1",
                        "off_by_one",
                    )  # fmt: skip
        self.generic_visit(node)
        self.in_slice -= 1

    def visit_Subscript(self, node):
        index = node.slice
        if (
            self.depth
            and isinstance(index, ast.Name)
            and self._single_line(index)
            and isinstance(node.ctx, ast.Load)
        ):
            self._add(index.lineno, index.col_offset, index.end_col_offset, f"{index.id} + 1",
                      "off_by_one")  # fmt: skip
        if isinstance(index, ast.Constant):
            self.in_slice += 1
            self.generic_visit(node)
            self.in_slice -= 1
        else:
            self.generic_visit(node)

    def visit_Call(self, node):
        is_range = isinstance(node.func, ast.Name) and node.func.id == "range"
        if is_range and self.depth and node.args:
            stop = node.args[1] if len(node.args) > 1 else node.args[0]
            if self._single_line(stop) and not isinstance(stop, ast.Constant):
                text = self.lines[stop.lineno - 1][stop.col_offset : stop.end_col_offset]
                wrapped = (
                    text if isinstance(stop, (ast.Name, ast.Attribute, ast.Call)) else f"({text})"
                )
                self._add(stop.lineno, stop.col_offset, stop.end_col_offset, f"{wrapped} - 1",
                          "off_by_one")  # fmt: skip
        if is_range:
            self.in_range += 1
            self.generic_visit(node)
            self.in_range -= 1
        else:
            self.generic_visit(node)


# CPython 3.11 tracks the AST constructor's recursion depth per interpreter, not per thread:
# parsing in two threads at once (the builder tests mutants in a thread pool) can fail with
# "SystemError: AST constructor recursion depth mismatch". Parse one module at a time.
_AST_LOCK = threading.Lock()


def _parse(source: str) -> ast.Module:
    with _AST_LOCK:
        return ast.parse(source)


def is_valid(mutant: Mutant, source: str, original_dump: str | None = None) -> bool:
    """Whether the mutated module parses and differs from the original in its AST."""
    try:
        mutated = _parse(mutant.apply(source))
    except (SyntaxError, ValueError):
        return False
    if original_dump is None:
        original_dump = ast.dump(_parse(source))
    return ast.dump(mutated) != original_dump


def _is_string_format(node: ast.BinOp) -> bool:
    """`"..." % x` and string concatenation are formatting, not arithmetic worth mutating."""
    return isinstance(node.left, ast.Constant) and isinstance(node.left.value, (str, bytes))


def find_mutants(path: str, source: str, check: bool = True) -> list[Mutant]:
    """Every mutation site inside the functions of one module, in source order.

    Args:
        path: The module's path (recorded in each mutant).
        source: The module's text.
        check: Keep only mutants whose result parses to a different AST (parses the module once
            per mutant; the builder skips it and checks the mutants it actually tests with
            `is_valid`).

    Returns:
        The mutants.
    """
    tree = _parse(source)
    finder = _Finder(path, source.splitlines(keepends=True))
    finder.skip = _docstring_nodes(tree)
    finder.visit(tree)
    original_dump = ast.dump(tree) if check else ""
    out, seen = [], set()
    for mutant in finder.found:
        key = (mutant.line, mutant.col, mutant.end_col, mutant.replacement)
        if key in seen:
            continue
        seen.add(key)
        if check and not is_valid(mutant, source, original_dump):
            continue
        out.append(mutant)
    out.sort(key=lambda m: (m.line, m.col, m.kind))
    return out
