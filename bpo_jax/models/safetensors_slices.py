"""Reading parts of tensors from safetensors files, local or in a bucket, without the rest.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (per tensor:
`dtype`, `shape`, `data_offsets` [begin, end) counted from the end of the header), then the
tensors' bytes, each in C order. So the rows `r0:r1` of a tensor are one contiguous range, and a
block of rows and columns narrower than a row is one range per row. `SafetensorsFile` reads
exactly those ranges and counts the bytes: from a local file with seek and read, from an object
in a bucket (`gs://`) with fsspec's `cat_ranges` (concurrent ranged GETs, and no read-ahead that
would fetch the gaps between the rows: FSDP splits the embedding dimension, which is the minor
axis of every HF matrix, so most blocks a device holds are narrow).

`read_region` builds any rectangular piece of a parameter that is a concatenation of
(transposed and) reshaped tensors, as `bpo_jax.models.hf_import` describes each parameter,
reading from each tensor only the block the piece covers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import threading
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from bpo_jax.io import files

# safetensors dtype names -> numpy (all little-endian, as the format stores them).
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# A headers this large is not a safetensors file (the format caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in its file."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # Absolute byte offset of element 0.


class SafetensorsFile:
    """One safetensors file, opened for ranged reads; `bytes_read` counts the tensor bytes read.

    Thread-safe: `jax.make_array_from_callback` may ask for several devices' slices at once,
    and one seek-then-read must not interleave with another.

    Raises:
      ValueError: if the file is not a safetensors file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = files.as_path(path)
        self._lock = threading.Lock()
        self.bytes_read = 0
        if files.is_remote(self.path):
            from etils.epath import backend  # epath's own fsspec filesystems (gcsfs for gs://).

            self._fs, self._file = backend.fsspec_backend.fs(os.fspath(self.path)), None
            self._size = self._fs.size(os.fspath(self.path))
        else:
            self._fs, self._file = None, open(self.path, "rb")  # noqa: SIM115 (closed in close)
            self._size = os.fstat(self._file.fileno()).st_size
        if self._size < 8:
            raise ValueError(f"{self.path} is not a safetensors file: shorter than 8 bytes.")
        (length,) = struct.unpack("<Q", self._read([(0, 8)])[0])
        if length > min(_MAX_HEADER, self._size - 8):
            raise ValueError(f"{self.path} is not a safetensors file: header of {length} bytes.")
        header = json.loads(self._read([(8, length)])[0])
        self.bytes_read = 0  # Tensor bytes only.
        header.pop("__metadata__", None)
        self.tensors: dict[str, TensorInfo] = {}
        for name, meta in header.items():
            if meta["dtype"] not in _DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {meta['dtype']!r}.")
            dtype, shape = _DTYPES[meta["dtype"]], tuple(int(n) for n in meta["shape"])
            begin, end = meta["data_offsets"]
            if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(
                    f"{self.path}: tensor {name!r} of shape {shape} and dtype {meta['dtype']} "
                    f"has {end - begin} bytes."
                )
            self.tensors[name] = TensorInfo(dtype, shape, 8 + length + int(begin))

    def _read(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, size) range."""
        if self._fs is not None:
            path = os.fspath(self.path)
            starts = [o for o, _ in ranges]
            ends = [o + n for o, n in ranges]
            out = self._fs.cat_ranges([path] * len(ranges), starts, ends)
        else:
            out = []
            with self._lock:  # One seek-then-read must not interleave with another.
                for offset, size in ranges:
                    self._file.seek(offset)
                    out.append(self._file.read(size))
        for (offset, size), data in zip(ranges, out):
            if len(data) != size:
                raise ValueError(f"{self.path} is truncated: wanted {size} bytes at {offset}.")
        with self._lock:
            self.bytes_read += sum(len(d) for d in out)
        return out

    def read_block(self, name: str, rows: slice, cols: slice | None = None) -> np.ndarray:
        """`tensor[rows]` of a 1-D tensor, or `tensor[rows, cols]` of a 2-D one (step 1)."""
        info = self.tensors[name]
        item = info.dtype.itemsize
        r0, r1 = rows.start, rows.stop
        if len(info.shape) == 1:
            (data,) = self._read([(info.start + r0 * item, (r1 - r0) * item)])
            return np.frombuffer(data, info.dtype)
        width = info.shape[1]
        c0, c1 = cols.start, cols.stop
        if c1 - c0 == width:  # Whole rows: one range.
            (data,) = self._read([(info.start + r0 * width * item, (r1 - r0) * width * item)])
            return np.frombuffer(data, info.dtype).reshape(r1 - r0, width)
        ranges = [(info.start + (r * width + c0) * item, (c1 - c0) * item) for r in range(r0, r1)]
        data = b"".join(self._read(ranges))
        return np.frombuffer(data, info.dtype).reshape(r1 - r0, c1 - c0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclasses.dataclass(frozen=True)
class Piece:
    """A tensor's part of a parameter: `(tensor.T if transposed else tensor).reshape(shape)`."""

    name: str
    transposed: bool
    shape: tuple[int, ...]


def _normalise(index: Sequence[slice], shape: Sequence[int]) -> list[range]:
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"only contiguous slices are read, got {s} of an axis of {n}.")
        out.append(range(start, stop))
    return out


def _read_piece(
    piece: Piece, ranges: list[range], read: Callable[[str, slice, slice | None], np.ndarray], src
) -> np.ndarray:
    """`ranges` of one piece: the source block it covers, read once, then gathered."""
    shape = tuple(len(r) for r in ranges)
    if 0 in shape:
        return np.empty(shape, src.dtype)
    # Flat C-order position of each wanted element in the (transposed) tensor's reshaped view.
    flat = np.zeros(shape, np.int64)
    stride = 1
    for axis in reversed(range(len(piece.shape))):
        coord = np.arange(ranges[axis].start, ranges[axis].stop, dtype=np.int64)
        flat += coord.reshape([-1 if a == axis else 1 for a in range(len(shape))]) * stride
        stride *= piece.shape[axis]
    if len(src.shape) == 1:
        lo, hi = int(flat.min()), int(flat.max()) + 1
        return read(piece.name, slice(lo, hi), None)[flat - lo]
    view_cols = src.shape[0] if piece.transposed else src.shape[1]
    a, b = np.divmod(flat, view_cols)  # Coordinates in the view `tensor.T` or `tensor`.
    r, c = (b, a) if piece.transposed else (a, b)
    r0, c0 = int(r.min()), int(c.min())
    block = read(piece.name, slice(r0, int(r.max()) + 1), slice(c0, int(c.max()) + 1))
    return block[r - r0, c - c0]


def read_region(
    pieces: Sequence[Piece],
    axis: int,
    index: Sequence[slice],
    tensors: dict[str, TensorInfo],
    read: Callable[[str, slice, slice | None], np.ndarray],
) -> np.ndarray:
    """`np.concatenate([piece views], axis)[index]`, reading only the blocks it covers.

    Args:
      pieces: The parameter's parts along `axis`, in order.
      axis: The axis they are concatenated along.
      index: A tuple of step-1 slices into the parameter (what `make_array_from_callback` asks).
      tensors: Every piece's `TensorInfo` (for its shape and dtype).
      read: `(name, rows, cols) -> block`, e.g. `SafetensorsFile.read_block`.
    """
    full = list(pieces[0].shape)
    full[axis] = sum(p.shape[axis] for p in pieces)
    ranges = _normalise(tuple(index) + (slice(None),) * (len(full) - len(index)), full)
    parts, offset = [], 0
    want = ranges[axis]
    for piece in pieces:
        size = piece.shape[axis]
        lo, hi = max(want.start, offset), min(want.stop, offset + size)
        if lo < hi or len(pieces) == 1:
            local = list(ranges)
            local[axis] = range(lo - offset, max(lo, hi) - offset)
            parts.append(_read_piece(piece, local, read, tensors[piece.name]))
        offset += size
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
