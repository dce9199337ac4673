"""Run files on a local disk or in a bucket (`gs://bucket/run`): one path type, one writer.

Every path under a run's workdir is an `etils.epath.Path`. A local path is made absolute (so a
run behaves the same whatever the caller's working directory); a URL (`gs://`, `s3://`) is kept
as it is, and epath reads and writes it through fsspec (gcsfs for `gs://`). Orbax takes the
same paths for checkpoints (its array data goes through TensorStore's own GCS driver).

Atomic writes: a local file is written to a temporary name and renamed over the target, so a
reader (or a resumed run) never sees half a file. A bucket has no atomic rename (gcsfs renames
by copy and delete), but it needs none: an object upload is all or nothing, and a reader sees
the old object or the new one, never part of one. So a remote file is written in place, in one
upload.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from etils import epath

# The URL schemes epath serves through fsspec; anything else is a local path.
REMOTE_SCHEMES = ("gs://", "s3://", "az://", "hf://")

_C = TypeVar("_C", bound="Closeable")


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` names an object store (`gs://...`) rather than the local disk."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def as_path(path: str | os.PathLike) -> epath.Path:
    """`path` as an `epath.Path`: a URL as it is, a local path expanded and made absolute.

    `pathlib.Path("gs://b/run")` would be the local folder `gs:/b/run`; this never is.
    """
    if isinstance(path, epath.Path) and is_remote(path):
        return path
    text = os.fspath(path)
    if is_remote(text):
        return epath.Path(text)
    return epath.Path(Path(text).expanduser().absolute())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` so that no reader sees part of it (see the module docstring)."""
    path = as_path(path)
    if is_remote(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`write_bytes` of `text` encoded as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copies one file between any two places (local or remote), atomically at the target."""
    write_bytes(target, as_path(source).read_bytes())


def iter_files(root: str | os.PathLike):
    """Every file under `root`, recursively, in sorted order.

    `iterdir` rather than epath's `rglob` (which a bucket refuses) or `walk` (whose fsspec
    backend yields folders without their `gs://` scheme).
    """
    root = as_path(root)
    for child in sorted(root.iterdir()):
        if child.is_dir():
            yield from iter_files(child)
        else:
            yield child


class Closeable:
    """Base of an object that holds files open until `close()`: `with` closes it on the way out
    (the checkpointer, the metric writer)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
