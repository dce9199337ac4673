"""Metric logging to a JSON-lines file and TensorBoard, and a progress bar for long loops.

`metrics.jsonl` is the record of truth: one line per `MetricWriter.write`, flushed at once, so a
killed run keeps everything it logged and plotting scripts need nothing but `read_metrics`.
TensorBoard is a convenience view of the same scalars.

The workdir may be a bucket (`gs://`, see `bpo_jax.io.files`). An object cannot be appended to, so
there both files are kept in memory and each write uploads them whole (one upload: a reader sees
the file before or after the write, never part of it). Metrics are small (kilobytes a step);
tensorboardX's own GCS writer works the same way.
"""

from __future__ import annotations

import io
import json
import numbers
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import tqdm
from etils import epath

from bpo_jax.io import files

# Per RL iteration, `<BRANCH_STEP_PREFIX><t>` counts the batch's branch points at step t
# (written by `bpo_jax.rl`, read by `bpo_jax.study.records`).
BRANCH_STEP_PREFIX = "train/branch_step/"

METRICS_FILE = "metrics.jsonl"
# Per RL iteration of a tree algorithm, the batch's branch points summed per (task, depth)
# (`bpo_jax.estimators.task_depth_parts`), as columns (`MetricWriter.append`).
BRANCH_PARTS_FILE = "branch_parts.jsonl"
TB_DIR = "tb"
_RESERVED = ("step", "time")

T = TypeVar("T")


def _to_python_scalar(name: str, value: Any) -> int | float:
    """Returns a Python int (integers, bools) or float for a Python/NumPy/JAX scalar."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is None:
        raise TypeError(
            f"metric {name!r} must be a number or a scalar array, got {type(value).__name__} "
            f"{value!r}."
        )
    if tuple(shape) != ():
        raise ValueError(
            f"metric {name!r} must be a scalar, got an array of shape {tuple(shape)}; reduce it "
            "(e.g. .mean()) or log its elements under separate names."
        )
    # Works for NumPy and JAX scalars alike (a JAX value is fetched from the device here).
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer):
        return int(arr)
    if np.issubdtype(arr.dtype, np.floating):
        return float(arr)
    raise TypeError(f"metric {name!r} has non-numeric dtype {arr.dtype}; log numbers only.")


class MetricWriter(files.Closeable):
    """Appends metrics to `<workdir>/metrics.jsonl` and, optionally, TensorBoard.

    Resuming a run appends to the same file, so steps after the restored checkpoint can appear
    twice; readers that want one value per step should keep the last line for each step.

    Args:
      workdir: Run directory; created if missing.
      use_tensorboard: Also write scalars to `<workdir>/tb` with tensorboardX.
      enabled: When False, every call is a no-op. Pass `jax.process_index() == 0` in
        multi-host runs so only one process writes.

    Example:
      with MetricWriter(workdir) as writer:
        writer.write(step, {"loss": loss, "reward/mean": reward.mean()})
    """

    def __init__(
        self, workdir: str | os.PathLike, use_tensorboard: bool = True, *, enabled: bool = True
    ):
        self.workdir = files.as_path(workdir)
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._records: dict[str, Any] = {}  # `append`'s files, opened on first use.
        if not enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / METRICS_FILE
        if files.is_remote(path):
            self._file = _RewrittenObject(path, keep=True)
        else:
            self._file = path.open("a", encoding="utf-8")
        if use_tensorboard:
            # Imported here so runs without TensorBoard do not pay for protobuf at import time.
            from tensorboardX import SummaryWriter

            if files.is_remote(self.workdir):
                _register_tensorboard_scheme(os.fspath(self.workdir).split(":")[0])

            self._tb = SummaryWriter(str(self.workdir / TB_DIR))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs scalar metrics for one step.

        Args:
          step: The training step (any integer-like, including a JAX scalar).
          metrics: Name -> Python/NumPy/JAX scalar. Integers stay integers, the rest become
            floats; NaN/inf are written as JSON `NaN`/`Infinity`, which Python reads back.

        Raises:
          ValueError: If a value is not a scalar, or a name is "step" or "time".
          TypeError: If a value is not numeric or a name is not a string.
          RuntimeError: If the writer is closed.
        """
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricWriter for {self.workdir} is closed; make a new one.")
        step_value = _to_python_scalar("step", step)
        if not isinstance(step_value, int):
            raise TypeError(f"step must be an integer, got {step!r}.")
        record: dict[str, int | float] = {"step": step_value, "time": time.time()}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"metric names must be strings, got {name!r}.")
            if name in _RESERVED:
                raise ValueError(f"metric name {name!r} is reserved ({_RESERVED}); rename it.")
            record[name] = _to_python_scalar(name, value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in record.items():
                if name not in _RESERVED:
                    self._tb.add_scalar(name, value, global_step=step_value)
            self._tb.flush()

    def append(self, name: str, record: Mapping[str, Any]) -> None:
        """Appends one JSON-able record (lists allowed) as a line of `<workdir>/<name>`.

        For what is no scalar: per-iteration columns a reader re-pools (`BRANCH_PARTS_FILE`).
        Like `metrics.jsonl` the file is appended to across resumes (`read_json_lines`).

        Raises:
          RuntimeError: If the writer is closed.
          ValueError: If `name` is not a plain file name or is the metrics file.
        """
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricWriter for {self.workdir} is closed; make a new one.")
        if name == METRICS_FILE or not name or "/" in name or name.startswith("."):
            raise ValueError(f"append needs a plain file name other than {METRICS_FILE}: {name!r}")
        out = self._records.get(name)
        if out is None:
            path = self.workdir / name
            if files.is_remote(path):
                out = _RewrittenObject(path, keep=True)
            else:
                out = path.open("a", encoding="utf-8")
            self._records[name] = out
        out.write(json.dumps(dict(record)) + "\n")
        out.flush()

    def close(self) -> None:
        """Flushes and closes the files; further writes raise."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for out in self._records.values():
            out.close()
        self._records = {}
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads every record from `<workdir>/metrics.jsonl`, in file order.

    A last line cut short by a kill mid-write is dropped; a malformed line anywhere else raises.

    Args:
      workdir: The run directory given to `MetricWriter`.

    Returns:
      One dict per logged step, each with "step" and "time" keys.

    Raises:
      FileNotFoundError: If there is no metrics file.
      ValueError: If a line other than the last is not valid JSON.
    """
    path = files.as_path(workdir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}; was MetricWriter given {workdir}?")
    return read_json_lines(path)


def read_json_lines(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (`read_metrics`' rules: a cut last line is dropped).

    Raises:
      ValueError: If a line other than the last is not valid JSON.
    """
    path = files.as_path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path} line {i + 1} is not valid JSON ({e}): {line[:200]!r}") from e
    return records


class _RewrittenObject:
    """A text file in a bucket that is written as a whole: `write` adds to memory, `flush`
    uploads everything written so far (with `keep`, after what the object already held)."""

    def __init__(self, path: epath.Path, keep: bool = False):
        self.path = path
        self._data = io.BytesIO()
        if keep and path.exists():
            self._data.write(path.read_bytes())

    def write(self, data: str | bytes) -> None:
        self._data.write(data.encode("utf-8") if isinstance(data, str) else data)

    def flush(self) -> None:
        files.write_bytes(self.path, self._data.getvalue())

    def close(self) -> None:
        self.flush()


class _TensorBoardObjects:
    """tensorboardX's writer factory for a bucket scheme, through epath (its own needs the
    google-cloud-storage client): each events file is a `_RewrittenObject`."""

    def open(self, path: str) -> _RewrittenObject:
        return _RewrittenObject(epath.Path(path))

    def directory_check(self, path: str) -> None:
        del path  # A bucket has no folders to make.


def _register_tensorboard_scheme(scheme: str) -> None:
    from tensorboardX import record_writer

    record_writer.register_writer_factory(scheme, _TensorBoardObjects())


def progress(
    iterable_or_total: Iterable[T] | int,
    desc: str | None = None,
    *,
    force: bool = False,
    **tqdm_kwargs: Any,
) -> tqdm.tqdm:
    """A tqdm progress bar on stderr, silent when stderr is not a terminal.

    Log files and CI output stay free of carriage-return spam unless `force=True`.

    Args:
      iterable_or_total: What to iterate over, or the total count for a bar advanced by hand
        with `.update(n)`.
      desc: Label shown before the bar.
      force: Show the bar even when stderr is not a TTY.
      **tqdm_kwargs: Passed on to `tqdm.tqdm` (e.g. `unit="episode"`).

    Returns:
      The tqdm bar; iterate over it, or call `.update()` and `.close()` (or use `with`).
    """
    disable = not (force or sys.stderr.isatty())
    kwargs: dict[str, Any] = {"desc": desc, "file": sys.stderr, "disable": disable}
    kwargs.update(tqdm_kwargs)
    if isinstance(iterable_or_total, numbers.Integral):
        total = int(iterable_or_total)
        if total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}.")
        return tqdm.tqdm(total=total, **kwargs)
    return tqdm.tqdm(iterable_or_total, **kwargs)
