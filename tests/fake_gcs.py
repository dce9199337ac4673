"""A stand-in Google Cloud Storage for tests: `gs://` URLs served from a local folder.

A run whose workdir is `gs://bucket/run` reaches the bucket two ways, and both are served from
the same folder (`<store>/<bucket>/<object name>`), so each sees what the other wrote:
- epath (config, metrics, evaluations, demos, tokenizer; Orbax's own metadata and step
  folders) goes through fsspec's `gs` protocol; here that protocol is an fsspec directory
  filesystem over the folder (gcsfs, the real one, is not installed).
- TensorStore (the arrays Orbax writes) speaks the GCS JSON API over HTTP; its GCS driver is
  pointed at a small server here (`TENSORSTORE_GCS_HTTP_URL`, TensorStore's switch for the
  GCS test bench) that implements the calls it makes: media upload with generation
  preconditions, ranged media download, object metadata, listing and deletion.
- google-cloud-storage (Orbax asks it whether a bucket has a hierarchical namespace before
  listing steps) reaches the same server through `STORAGE_EMULATOR_HOST`, its emulator switch.

Nothing in the code under test is replaced: epath, Orbax and TensorStore run their own `gs://`
code paths (Orbax, for one, marks a finished step with a commit file instead of renaming it).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
import urllib.parse
from pathlib import Path

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_implementations


class _Objects(http.server.BaseHTTPRequestHandler):
    """The GCS JSON API calls TensorStore's `gcs` driver makes, on `server.store`."""

    protocol_version = "HTTP/1.1"  # Keep-alive: every reply carries a Content-Length.

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        del format, args  # Quiet: pytest shows stderr of failing tests only anyway.

    def _file(self, bucket: str, name: str) -> Path:
        return Path(self.server.store) / bucket / name

    @staticmethod
    def _generation(path: Path) -> int:
        return path.stat().st_mtime_ns

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, value) -> None:
        self._reply(code, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _metadata(self, bucket: str, name: str, path: Path) -> dict:
        gen = str(self._generation(path))
        size = str(path.stat().st_size)
        return {
            "bucket": bucket,
            "name": name,
            "size": size,
            "generation": gen,
            "metageneration": "1",
        }

    def _route(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.split("/")
        # /storage/v1/b/<bucket>/o[/<object>] or /upload/storage/v1/b/<bucket>/o
        upload = parts[1] == "upload"
        rest = parts[2:] if upload else parts[1:]
        if rest[:3] != ["storage", "v1", "b"] or len(rest) < 4:
            return None
        bucket = rest[3]
        if len(rest) == 4:  # The bucket itself.
            return upload, bucket, None, {**query, "bucket": True}
        if rest[4] != "o":
            return None
        name = urllib.parse.unquote("/".join(rest[5:])) if len(rest) > 5 else None
        return upload, bucket, name, query

    def _precondition_failed(self, path: Path, query: dict) -> bool:
        if "ifGenerationMatch" not in query:
            return False
        want = int(query["ifGenerationMatch"])
        have = self._generation(path) if path.is_file() else 0
        return want != have

    def do_GET(self):
        route = self._route()
        if route is None:
            return self._reply(400)
        _, bucket, name, query = route
        if query.get("bucket"):  # google-cloud-storage's get_bucket (Orbax asks for HNS).
            return self._json(200, {"kind": "storage#bucket", "name": bucket, "id": bucket})
        if name is None:
            return self._list(bucket, query)
        path = self._file(bucket, name)
        if not path.is_file():
            return self._json(404, {"error": {"code": 404, "message": f"no object {name}"}})
        if self._precondition_failed(path, query):
            return self._reply(412)
        gen = self._generation(path)
        if query.get("ifGenerationNotMatch") == str(gen):
            return self._reply(304, headers={"x-goog-generation": gen})
        if query.get("alt") != "media":
            return self._json(200, self._metadata(bucket, name, path))
        data = path.read_bytes()
        headers = {"x-goog-generation": gen, "Content-Type": "application/octet-stream"}
        spec = self.headers.get("Range")
        if not spec:
            return self._reply(200, data, headers)
        first, _, last = spec.removeprefix("bytes=").partition("-")
        if first == "":  # The last `last` bytes.
            start, stop = max(0, len(data) - int(last)), len(data)
        else:
            start, stop = int(first), (int(last) + 1 if last else len(data))
        stop = min(stop, len(data))
        if start >= len(data) and len(data) > 0:
            return self._reply(416, headers={"Content-Range": f"bytes */{len(data)}"})
        headers["Content-Range"] = f"bytes {start}-{max(start, stop - 1)}/{len(data)}"
        return self._reply(206, data[start:stop], headers)

    def _list(self, bucket: str, query: dict) -> None:
        root = Path(self.server.store) / bucket
        names = (
            sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
            if root.is_dir()
            else []
        )
        prefix = query.get("prefix", "")
        start, end = query.get("startOffset"), query.get("endOffset")
        names = [
            n
            for n in names
            if n.startswith(prefix) and (start is None or n >= start) and (end is None or n < end)
        ]
        items = [self._metadata(bucket, n, root / n) for n in names]
        return self._json(200, {"kind": "storage#objects", "items": items})

    def do_POST(self):
        route = self._route()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if route is None or not route[0] or "name" not in route[3]:
            return self._reply(400)
        _, bucket, _, query = route
        name = query["name"]
        path = self._file(bucket, name)
        with self.server.lock:
            if self._precondition_failed(path, query):
                return self._reply(412)
            old = self._generation(path) if path.is_file() else 0
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.upload{threading.get_ident()}")
            tmp.write_bytes(body)
            gen = max(time.time_ns(), old + 1)  # Generations only grow.
            os.utime(tmp, ns=(gen, gen))
            os.replace(tmp, path)
            return self._json(200, self._metadata(bucket, name, path))

    def do_DELETE(self):
        route = self._route()
        if route is None or route[2] is None:
            return self._reply(400)
        _, bucket, name, query = route
        path = self._file(bucket, name)
        with self.server.lock:
            if not path.is_file():
                return self._reply(404)
            if self._precondition_failed(path, query):
                return self._reply(412)
            path.unlink()
            return self._reply(204)


class _BucketFileSystem(DirFileSystem):
    """fsspec's `gs` protocol over the store folder: `gs://b/x` is `<store>/b/x`."""

    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
        del args, kwargs  # gcsfs options (epath passes `finalize_on_close`).
        # An object store has no folders: writing `a/b` needs no `a` first.
        local = LocalFileSystem(auto_mkdir=True)
        super().__init__(path=os.environ["BPO_FAKE_GCS_STORE"], fs=local)


@contextlib.contextmanager
def fake_gcs(store: Path):
    """Serves `gs://<bucket>/...` from `store/<bucket>/...` while the context lasts.

    TensorStore reads its GCS switches once per process, so the server's address must stay
    the same for the process's lifetime: use one `store` (and fresh bucket names) per session.
    """
    from etils.epath import backend as epath_backend

    store.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Objects)
    server.daemon_threads = True
    server.store, server.lock = str(store), threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(
        TENSORSTORE_GCS_HTTP_URL=f"http://127.0.0.1:{server.server_port}",
        GOOGLE_AUTH_TOKEN_FOR_TESTING="fake-gcs",
        STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{server.server_port}",
        GOOGLE_CLOUD_PROJECT="fake-gcs",
        BPO_FAKE_GCS_STORE=str(store),
    )
    previous = {p: fsspec.registry.get(p) for p in _BucketFileSystem.protocol}
    for p in _BucketFileSystem.protocol:
        fsspec.register_implementation(p, _BucketFileSystem, clobber=True)
    _clear_fs_caches(epath_backend)
    try:
        yield server
    finally:
        for p, cls in previous.items():
            if cls is None:
                fsspec_implementations.pop(p, None)  # fsspec has no unregister.
            else:
                fsspec.register_implementation(p, cls, clobber=True)
        _clear_fs_caches(epath_backend)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.shutdown()
        server.server_close()


_ENV = (
    "TENSORSTORE_GCS_HTTP_URL",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_PROJECT",
    "BPO_FAKE_GCS_STORE",
)


def _clear_fs_caches(epath_backend) -> None:
    # epath and fsspec both cache filesystem instances; a stale one would be the previous class.
    type(epath_backend.fsspec_backend)._get_filesystem.cache_clear()
    _BucketFileSystem.clear_instance_cache()
