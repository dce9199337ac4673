"""A sandbox's working copy: a read-only base tree plus the edits, kept in memory.

The base tree (a package's pristine source, shared by every sandbox of every task built from
it) is never written. The working copy is that tree with `files` applied on top: path -> new
bytes, or None for a deleted file. Because the edits are plain Python data inside the worker,
every snapshot backend copies them for free: `os.fork()` (copy-on-write), CRIU (the worker's
memory), deep copy, or replay. Commands see the working copy in a jail (`envs.swe.jail`) that
materialises it, and their own file changes come back into `files`.

Paths are relative to the repository root, POSIX style. Anything that would leave the tree
(absolute paths other than the jail's `/tmp/testbed/...`, `..`, symlinks) raises `PathError`
with the message the agent sees.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import stat
from collections.abc import Iterable, Mapping

from envs.swe.jail import JAIL_ROOT

__all__ = ["PathError", "Workspace", "base_index"]

# Base tree -> (files, folders), relative POSIX paths. Filled once per process (and inherited by
# forked workers); base trees are read-only, so an entry never goes stale.
_INDEX: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


class PathError(ValueError):
    """A tool path that is malformed, leaves the working copy, or names nothing there."""


def base_index(base: str) -> tuple[frozenset[str], frozenset[str]]:
    """(files, folders) of a base tree, relative paths; symlinks and special files are left out."""
    if base not in _INDEX:
        files, folders = set(), {""}
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, base).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir
            kept = []
            for name in dirnames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    kept.append(name)
                    folders.add(posixpath.join(rel_dir, name))
            dirnames[:] = kept
            for name in filenames:
                mode = os.lstat(os.path.join(dirpath, name)).st_mode
                if stat.S_ISREG(mode):
                    files.add(posixpath.join(rel_dir, name))
        _INDEX[base] = (frozenset(files), frozenset(folders))
    return _INDEX[base]


class Workspace:
    """The working copy of one episode; see the module docstring.

    Args:
        base: Folder with the read-only base tree.
        files: The starting overlay (e.g. the injected bug): path -> bytes, or None (deleted).
    """

    def __init__(self, base: str, files: Mapping[str, bytes | None] | None = None):
        if not os.path.isdir(base):
            raise FileNotFoundError(f"The task's base tree {base!r} does not exist.")
        self.base = base
        self.files: dict[str, bytes | None] = dict(files or {})
        self.start: dict[str, bytes | None] = dict(self.files)  # The overlay at reset.
        self._base_files, self._base_folders = base_index(base)

    # Paths ---------------------------------------------------------------------------------------

    def resolve(self, path: str) -> str:
        """The normalised relative path of a tool argument ("" is the root).

        Raises:
            PathError: If the path is empty, absolute outside the jail's tree, or leaves it.
        """
        text = (path or "").strip().strip("'\"")
        if not text:
            raise PathError("No path given. Paths are relative to the repository root.")
        if text.startswith(JAIL_ROOT + "/") or text == JAIL_ROOT:
            text = text[len(JAIL_ROOT) :].lstrip("/") or "."
        if text.startswith("/") or text.startswith("~"):
            raise PathError(
                f"Refused: {path!r} is outside the working copy. Paths are relative to the "
                "repository root (e.g. 'src/pkg/module.py'), or start with " + JAIL_ROOT + "/."
            )
        if "\0" in text:
            raise PathError(f"Refused: {path!r} contains a NUL byte.")
        norm = posixpath.normpath(text)
        if norm == ".." or norm.startswith("../"):
            raise PathError(
                f"Refused: {path!r} is outside the working copy (it climbs above the repository "
                "root)."
            )
        return "" if norm == "." else norm

    def is_file(self, rel: str) -> bool:
        if rel in self.files:
            return self.files[rel] is not None
        return rel in self._base_files

    def is_dir(self, rel: str) -> bool:
        if rel == "":
            return True
        prefix = rel + "/"
        return any(path.startswith(prefix) for path in self.all_files())

    def all_files(self, at_start: bool = False) -> list[str]:
        """Every file of the working copy (or, `at_start`, of the episode's start), sorted."""
        current = set(self._base_files)
        for path, content in (self.start if at_start else self.files).items():
            if content is None:
                current.discard(path)
            else:
                current.add(path)
        return sorted(current)

    def listdir(self, rel: str) -> list[str]:
        """Entries of a folder: files, and folders with a trailing '/'."""
        prefix = rel + "/" if rel else ""
        entries = set()
        for path in self.all_files():
            if path.startswith(prefix):
                head, sep, _ = path[len(prefix) :].partition("/")
                entries.add(head + sep)
        return sorted(entries)

    # Content -------------------------------------------------------------------------------------

    def read(self, rel: str) -> bytes:
        """Bytes of a file of the working copy.

        Raises:
            PathError: If it is not a file there.
        """
        if rel in self.files:
            content = self.files[rel]
            if content is None:
                raise PathError(f"{rel} does not exist (it was deleted).")
            return content
        if rel not in self._base_files:
            if self.is_dir(rel):
                raise PathError(f"{rel or '.'} is a folder, not a file.")
            raise PathError(f"{rel} does not exist. Use 'ls' or 'find' to see the files.")
        with open(os.path.join(self.base, rel), "rb") as f:
            return f.read()

    def read_text(self, rel: str) -> str:
        data = self.read(rel)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PathError(f"{rel} is not a UTF-8 text file; the tools only edit text.") from e

    def write(self, rel: str, data: bytes) -> None:
        if self.is_dir(rel) or rel == "":
            raise PathError(f"{rel or '.'} is a folder, not a file.")
        self.files[rel] = data

    def apply_changes(self, changes: Mapping[str, bytes | None]) -> None:
        """Takes in the file changes a command made."""
        for rel, content in changes.items():
            if content is None and rel not in self._base_files:
                self.files.pop(rel, None)
            else:
                self.files[rel] = content

    def overlay(self, drop: Iterable[str] = ()) -> dict[str, bytes | None]:
        """The edits relative to the base tree, without the paths in `drop`."""
        dropped = set(drop)
        return {p: c for p, c in self.files.items() if p not in dropped}

    def _text(self, overlay: Mapping[str, bytes | None], rel: str) -> str | None:
        if rel in overlay:
            content = overlay[rel]
            return None if content is None else content.decode("utf-8", "replace")
        if rel in self._base_files:
            with open(os.path.join(self.base, rel), "rb") as f:
                return f.read().decode("utf-8", "replace")
        return None

    def base_text(self, rel: str) -> str | None:
        """The file as the episode started (None if it did not exist)."""
        return self._text(self.start, rel)

    def diff(self) -> str:
        """Unified diff of the working copy against the episode's start."""
        out = []
        for rel in sorted(set(self.files) | set(self.start)):
            old, new = self._text(self.start, rel), self._text(self.files, rel)
            if old == new:
                continue
            out.extend(
                difflib.unified_diff(
                    (old or "").splitlines(keepends=True),
                    (new or "").splitlines(keepends=True),
                    fromfile=f"a/{rel}" if old is not None else "/dev/null",
                    tofile=f"b/{rel}" if new is not None else "/dev/null",
                )
            )
        return "".join(line if line.endswith("\n") else line + "\n" for line in out)
