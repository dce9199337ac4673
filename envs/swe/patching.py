"""Unified diffs in git's format: making them, applying them to a tree, hashing trees.

SWE-bench instances carry their changes as `git diff` text (`patch`, `test_patch`); the builder
writes its bug and fix patches the same way, so one applier serves both. Only text files are
supported (binary hunks raise `PatchError`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
from collections.abc import Callable, Mapping

__all__ = ["PatchError", "apply_patch", "make_patch", "patched_paths", "tree_hash"]

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch does not parse or does not apply; the message names the file and hunk."""


def make_patch(changes: Mapping[str, tuple[str | None, str | None]], context: int = 3) -> str:
    """A git-style unified diff.

    Args:
        changes: path -> (old text or None for a new file, new text or None for a deletion).
        context: Lines of context around each change.
    """
    out = []
    for path in sorted(changes):
        old, new = changes[path]
        if old == new:
            continue
        a = f"a/{path}" if old is not None else "/dev/null"
        b = f"b/{path}" if new is not None else "/dev/null"
        out.append(f"diff --git a/{path} b/{path}\n")
        if old is None:
            out.append("new file mode 100644\n")
        elif new is None:
            out.append("deleted file mode 100644\n")
        lines = difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            fromfile=a,
            tofile=b,
            n=context,
        )
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


@dataclasses.dataclass
class _FilePatch:
    old_path: str | None
    new_path: str | None
    hunks: list[tuple[int, list[str]]]  # (old start line, lines with their ' ', '-', '+' mark)


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def _parse(patch: str) -> list[_FilePatch]:
    files: list[_FilePatch] = []
    lines = patch.splitlines(keepends=True)
    i = 0
    current: _FilePatch | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = _FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]), [])
            files.append(current)
            i += 2
            continue
        if line.startswith("GIT binary patch") or line.startswith("Binary files"):
            raise PatchError(f"binary patches are not supported (line {i + 1}: {line.strip()!r}).")
        match = _HUNK_RE.match(line)
        if match:
            if current is None:
                raise PatchError(f"hunk without a file header at line {i + 1}.")
            old_len = int(match.group(2) or "1")
            new_len = int(match.group(4) or "1")
            body: list[str] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                text = lines[i]
                if text.startswith("\\"):
                    if body:
                        body[-1] = body[-1].rstrip("\n")
                    i += 1
                    continue
                mark = text[:1] if text[:1] in (" ", "-", "+") else " "
                if text in ("\n", "\r\n"):  # Some tools drop the space of empty context lines.
                    mark, text = " ", " " + text
                body.append(mark + text[1:])
                seen_old += mark in (" ", "-")
                seen_new += mark in (" ", "+")
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                if body:
                    body[-1] = body[-1].rstrip("\n")
                i += 1
            current.hunks.append((int(match.group(1)), body))
            continue
        i += 1
    return files


def patched_paths(patch: str) -> list[str]:
    """The paths a patch touches (new names for renames), in order."""
    return [f.new_path or f.old_path or "" for f in _parse(patch)]


def _apply_hunks(path: str, text: str, hunks: list[tuple[int, list[str]]]) -> str:
    lines = text.splitlines(keepends=True)
    offset = 0
    for number, (start, body) in enumerate(hunks, 1):
        old = [line[1:] for line in body if line[:1] in (" ", "-")]
        new = [line[1:] for line in body if line[:1] in (" ", "+")]
        want = max(start - 1, 0) + offset
        found = None
        # Exact position first, then the nearest match (files may have shifted a little).
        for delta in range(0, len(lines) + 1):
            for pos in (want - delta, want + delta) if delta else (want,):
                if 0 <= pos <= len(lines) - len(old) and lines[pos : pos + len(old)] == old:
                    found = pos
                    break
            if found is not None:
                break
        if found is None:
            raise PatchError(f"hunk {number} of {path} (at line {start}) does not apply.")
        lines[found : found + len(old)] = new
        offset = found - max(start - 1, 0) + len(new) - len(old)
    return "".join(lines)


def apply_patch(read: Callable[[str], str | None], patch: str) -> dict[str, str | None]:
    """Applies a unified diff.

    Args:
        read: path -> current text of the file, or None if it does not exist.
        patch: The diff (git or plain unified format, paths with or without a/ b/).

    Returns:
        path -> new text, or None for a deleted file. Only the files the patch touches.

    Raises:
        PatchError: If the patch does not parse or a hunk does not apply.
    """
    result: dict[str, str | None] = {}
    for file in _parse(patch):
        source = file.old_path
        current = None
        if source is not None:
            current = result[source] if source in result else read(source)
            if current is None:
                raise PatchError(f"the patch changes {source}, which does not exist.")
        if file.new_path is None:
            result[source or ""] = None
            continue
        text = _apply_hunks(file.new_path, current or "", file.hunks)
        if source is not None and source != file.new_path:
            result[source] = None
        result[file.new_path] = text
    return result


def tree_hash(root: str) -> str:
    """A content hash of a folder (paths and bytes of its files), used as `base_commit`."""
    digest = hashlib.sha1()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, "rb") as f:
                file_digest = hashlib.sha1(f.read()).hexdigest()
            digest.update(f"{rel}\0{file_digest}\n".encode())
    return digest.hexdigest()
