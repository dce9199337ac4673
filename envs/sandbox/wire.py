"""Length-prefixed pickles over pipes (or a unix socketpair): how trainer and workers talk.

A frame is `MAGIC (4 bytes) | payload length (8 bytes, big-endian) | pickle`. The magic and a
length cap let the reader tell a worker that writes garbage from one that is slow: anything that
does not parse is a `ProtocolError`, never a hang or a giant allocation. Any `str` crosses as it
is, lone surrogates and NUL included (pickle writes str with 'surrogatepass'), so that text an
env cannot take is refused by the env (`envs.base.action_refusal`), not by the pipe.

The trainer side reads incrementally (`FrameReader`, non-blocking fds, many workers polled at
once). The worker side is single-threaded and simply blocks (`recv`, `send`). On a socket, a
frame may carry file descriptors (SCM_RIGHTS); the fork server uses that to hand a new process
its channel.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import time
from typing import Any

__all__ = [
    "MAGIC",
    "MAX_FRAME_BYTES",
    "FrameReader",
    "PeerClosed",
    "ProtocolError",
    "close_channel",
    "encode",
    "recv_blocking",
    "send_blocking",
    "write_all",
]

MAGIC = b"BPO\x01"
_HEADER = struct.Struct(">4sQ")
# Observations are text; a reply larger than this is a bug or garbage, not data.
MAX_FRAME_BYTES = 256 * 1024 * 1024
_READ_CHUNK = 1 << 20


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame."""


class PeerClosed(Exception):
    """The peer closed its end (end of file)."""


def encode(obj: Any) -> bytes:
    """One frame holding `obj`."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(MAGIC, len(payload)) + payload


def write_all(fd: int, data: bytes, deadline: float | None = None) -> None:
    """Writes all of `data` to `fd` (blocking or not), waiting for room until `deadline`.

    Raises:
        TimeoutError: If the peer does not drain the pipe before `deadline`.
        BrokenPipeError: If the peer has closed its end.
    """
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("peer is not reading its channel") from None
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            poller.poll(None if remaining is None else max(1, int(remaining * 1000)))
            continue
        view = view[written:]


def send_blocking(fd: int, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Sends one frame; `fds` (only on a unix socket) ride along with its first byte."""
    data = encode(obj)
    if fds:
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sent = socket.send_fds(sock, [data], list(fds))
        finally:
            sock.close()
        data = data[sent:]
    write_all(fd, data)


class FrameReader:
    """Accumulates bytes from one fd and yields complete frames.

    Args:
        fd: The fd to read (the caller sets blocking mode).
        want_fds: Read with recvmsg and keep SCM_RIGHTS fds (unix sockets only); they are
            returned, in arrival order, by `take_fds`.
    """

    def __init__(self, fd: int, want_fds: bool = False):
        self.fd = fd
        self._buf = bytearray()
        self._want_fds = want_fds
        self._fds: list[int] = []
        self._sock = socket.socket(fileno=os.dup(fd)) if want_fds else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def take_fds(self, n: int) -> list[int]:
        """The next `n` received fds (the caller now owns them)."""
        if len(self._fds) < n:
            raise ProtocolError(f"expected {n} file descriptor(s), got {len(self._fds)}")
        taken, self._fds = self._fds[:n], self._fds[n:]
        return taken

    def fill(self) -> bool:
        """Reads what is available (one read); returns False at end of file.

        Raises:
            BlockingIOError: If the fd is non-blocking and nothing is available.
        """
        if self._sock is not None:
            data, fds, _, _ = socket.recv_fds(self._sock, _READ_CHUNK, 16)
            self._fds.extend(fds)
        else:
            data = os.read(self.fd, _READ_CHUNK)
        if not data:
            return False
        self._buf += data
        return True

    def pop(self) -> tuple[bool, Any]:
        """Returns `(True, obj)` for a complete buffered frame, else `(False, None)`.

        Raises:
            ProtocolError: If the buffered bytes are not a valid frame.
        """
        if len(self._buf) < _HEADER.size:
            if self._buf and not MAGIC.startswith(bytes(self._buf[: len(MAGIC)])):
                raise ProtocolError(f"bad frame header {bytes(self._buf[:16])!r}")
            return False, None
        magic, length = _HEADER.unpack_from(self._buf)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame header {bytes(self._buf[:16])!r}")
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame length {length} exceeds {MAX_FRAME_BYTES}")
        end = _HEADER.size + length
        if len(self._buf) < end:
            return False, None
        payload = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        try:
            return True, pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means garbage.
            raise ProtocolError(f"frame does not unpickle: {type(e).__name__}: {e}") from e

    def has_partial(self) -> bool:
        return bool(self._buf)


def close_channel(reader: FrameReader, rfd: int, wfd: int) -> None:
    """Closes one end of a channel: its reader, then its fds (one fd where they are equal, as on
    a socket); an fd that is closed already is passed over."""
    reader.close()
    for fd in {rfd, wfd}:
        try:
            os.close(fd)
        except OSError:
            pass


def recv_blocking(reader: FrameReader) -> Any:
    """Blocks until one frame arrives on `reader`'s (blocking) fd.

    Raises:
        PeerClosed: At end of file.
        ProtocolError: On garbage.
    """
    while True:
        ok, obj = reader.pop()
        if ok:
            return obj
        if not reader.fill():
            raise PeerClosed("peer closed the channel")
