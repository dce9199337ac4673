"""The file tools of `SweEnv` (view, ls, find, search, replace, edit, insert, diff, help).

They act on the episode's `Workspace` in the worker process, never on the host's files: every
path goes through `Workspace.resolve`, which refuses anything outside the working copy. A call
with bad arguments raises `ToolError`, whose message is the agent's observation (and makes the
action invalid).
"""

from __future__ import annotations

from envs.swe import tools
from envs.swe.workspace import PathError, Workspace

__all__ = ["FileTools", "ToolError"]

_MAX_SEARCH_FILE = 1 << 20  # Larger files are skipped by `search`.


class ToolError(Exception):
    """A tool call with bad arguments; the message is the observation."""


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


class FileTools:
    """Mixin of `SweEnv`: needs `_ws`, `view_lines`, `max_view_lines` and `max_hits`."""

    _ws: Workspace | None
    view_lines: int
    max_view_lines: int
    max_hits: int

    def _tool_help(self, call: tools.ToolCall) -> str:
        return tools.HELP

    def _tool_diff(self, call: tools.ToolCall) -> str:
        assert self._ws is not None
        return self._ws.diff() or "No changes yet."

    def _tool_ls(self, call: tools.ToolCall) -> str:
        ws = self._ws
        assert ws is not None
        rel = ws.resolve(call.path)
        if ws.is_file(rel):
            return rel
        if not ws.is_dir(rel):
            raise PathError(f"{rel} does not exist.")
        entries = ws.listdir(rel)
        shown = entries[:200]
        more = f"\n... and {len(entries) - 200} more" if len(entries) > 200 else ""
        return f"{rel or '.'}/:\n" + "\n".join(shown) + more

    def _tool_find(self, call: tools.ToolCall) -> str:
        assert self._ws is not None
        needle = call.text.strip()
        hits = [p for p in self._ws.all_files() if needle in p]
        limit = 2 * self.max_hits
        if not hits:
            return f"No file path contains {needle!r}."
        more = f"\n... and {len(hits) - limit} more" if len(hits) > limit else ""
        return "\n".join(hits[:limit]) + more

    def _lines(self, rel: str) -> list[str]:
        assert self._ws is not None
        return self._ws.read_text(rel).splitlines(keepends=True)

    def _numbered(self, lines: list[str], start: int, end: int) -> str:
        return "\n".join(f"{i:>5} {lines[i - 1].rstrip(chr(10))}" for i in range(start, end + 1))

    def _tool_view(self, call: tools.ToolCall) -> str:
        ws = self._ws
        assert ws is not None
        rel = ws.resolve(call.path)
        if not ws.is_file(rel) and ws.is_dir(rel):
            if call.start:
                raise ToolError(f"{rel or '.'} is a folder; line numbers only apply to files.")
            return self._tool_ls(tools.ToolCall("ls", path=call.path))
        lines = self._lines(rel)
        n = len(lines)
        if n == 0:
            return f"{rel} is empty."
        start = call.start or 1
        end = call.end if call.start else start + self.view_lines - 1
        if start < 1 or start > n:
            raise ToolError(f"line {start} is outside {rel}, which has {n} lines.")
        if end < start:
            raise ToolError(f"the range {start}-{end} is empty.")
        end = min(end, n, start + self.max_view_lines - 1)
        return f"{rel} (lines {start}-{end} of {n})\n{self._numbered(lines, start, end)}"

    def _tool_search(self, call: tools.ToolCall) -> str:
        ws = self._ws
        assert ws is not None
        text, scope = call.text, ""
        words = text.split(" ")
        if len(words) > 1:
            try:
                candidate = ws.resolve(words[-1])
            except PathError:
                candidate = None
            if candidate is not None and (ws.is_file(candidate) or ws.is_dir(candidate)):
                text, scope = " ".join(words[:-1]), candidate
        if scope and ws.is_file(scope):
            paths = [scope]
        else:
            prefix = scope + "/" if scope else ""
            paths = [p for p in ws.all_files() if p.startswith(prefix)]
        hits, total = [], 0
        for path in paths:
            try:
                data = ws.read(path)
            except PathError:
                continue
            if len(data) > _MAX_SEARCH_FILE or b"\0" in data[:1024]:
                continue
            if text.encode() not in data:
                continue
            for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if text in line:
                    total += 1
                    if len(hits) < self.max_hits:
                        hits.append(f"{path}:{number}: {line.strip()[:200]}")
        where = f" in {scope}" if scope else ""
        if not hits:
            return f"No line contains {text!r}{where}."
        more = f"\n... {total - len(hits)} more matches" if total > len(hits) else ""
        return f"{total} matches for {text!r}{where}:\n" + "\n".join(hits) + more

    def _window(self, rel: str, lines: list[str], first: int, last: int) -> str:
        n = len(lines)
        lo, hi = max(1, first - 2), min(n, max(last, first) + 2)
        if n == 0:
            return f"{rel} is now empty."
        return f"{rel} (lines {lo}-{hi} of {n} after the edit)\n{self._numbered(lines, lo, hi)}"

    def _check_line(self, rel: str, lines: list[str], number: int, allow_zero: bool = False):
        low = 0 if allow_zero else 1
        if number < low or number > len(lines):
            raise ToolError(f"line {number} is outside {rel}, which has {len(lines)} lines.")

    def _edit_target(
        self, call: tools.ToolCall, allow_zero: bool = False
    ) -> tuple[Workspace, str, list[str]]:
        """(workspace, resolved path, its lines) for an editing call, its start line checked."""
        ws = self._ws
        assert ws is not None
        rel = ws.resolve(call.path)
        lines = self._lines(rel)
        self._check_line(rel, lines, call.start, allow_zero=allow_zero)
        return ws, rel, lines

    def _tool_replace(self, call: tools.ToolCall) -> str:
        ws, rel, lines = self._edit_target(call)
        line = lines[call.start - 1]
        replaced = tools.replace_in_line(line, call.text, call.new)
        if replaced is None:
            raise ToolError(
                f"{call.text!r} is not on line {call.start} of {rel}: {line.strip()[:200]!r}"
            )
        lines[call.start - 1] = replaced
        ws.write(rel, "".join(lines).encode())
        return "Replaced. " + self._window(rel, lines, call.start, call.start)

    def _new_lines(self, text: str, reference: str) -> list[str]:
        if text == "":
            return []
        text = tools.unescape(text)
        indent = "" if text[:1].isspace() else _indent_of(reference)
        return [(indent + piece if piece.strip() else piece) + "\n" for piece in text.split("\n")]

    def _tool_edit(self, call: tools.ToolCall) -> str:
        ws, rel, lines = self._edit_target(call)
        self._check_line(rel, lines, call.end)
        if call.end < call.start:
            raise ToolError(f"the range {call.start}-{call.end} is empty; use 'insert' to add.")
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        new = self._new_lines(call.text, lines[call.start - 1])
        lines[call.start - 1 : call.end] = new
        ws.write(rel, "".join(lines).encode())
        last = call.start + len(new) - 1
        return "Edited. " + self._window(rel, lines, call.start, last)

    def _tool_insert(self, call: tools.ToolCall) -> str:
        ws, rel, lines = self._edit_target(call, allow_zero=True)
        if not call.text:
            raise ToolError("'insert' needs the text to insert.")
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        below = lines[call.start] if call.start < len(lines) else (lines[-1] if lines else "")
        new = self._new_lines(call.text, below)
        lines[call.start : call.start] = new
        ws.write(rel, "".join(lines).encode())
        return "Inserted. " + self._window(rel, lines, call.start + 1, call.start + len(new))
