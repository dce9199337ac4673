"""Shared pytest setup."""

import atexit
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import gguf_fixtures
import jax
import pytest

# The repo is checked out next to a `shared/` folder that holds the data sets tests play on.
_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Compiled XLA programs shared by the tests of a session and the processes they start: many
# compile the same tiny programs (the main job's update and sampler, the learner's). JAX's
# persistent compilation cache, in a fresh folder removed at the end (unless the caller names
# one with JAX_COMPILATION_CACHE_DIR).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bpo_jax_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


@pytest.fixture(scope="session", autouse=True)
def _alfworld_data_env():
    """Points ALFWorld at the shared test data unless the caller already chose a data root."""
    os.environ.setdefault("ALFWORLD_DATA", str(_SHARED_DATA / "alfworld"))
    yield


# The real SmolLM2 GGUF file's path, model and tokenizer, ours and transformers' (see
# tests/gguf_fixtures.py), as session fixtures of the same names: each loaded once a session,
# whichever test module asks first.
for _name in (
    "smollm_path",
    "our_smollm",
    "our_smollm_tokenizer",
    "hf_smollm",
    "hf_smollm_float64",
    "hf_smollm_tokenizer",
):
    globals()[_name] = pytest.fixture(scope="session", name=_name)(getattr(gguf_fixtures, _name))


# Modules whose tests drive the one Docker daemon: they build and remove the same images and
# check that no container or image is left, so they must not run beside each other.
_DOCKER_MODULES = {"test_swe_docker.py", "test_swe_hacks.py", "test_swe_history.py"}


@pytest.fixture(scope="module", autouse=True)
def _one_docker_module_at_a_time(request):
    """Under pytest-xdist (scripts/test.sh runs a module per worker, `--dist loadscope`) a
    Docker module waits for the lock while another one runs, in this or another pytest process.
    (`--dist loadgroup` would group them, but with pytest 9.2 xdist 3.8's groups do not apply:
    it renames `item._nodeid`, which pytest no longer reads.)"""
    if Path(str(request.path)).name not in _DOCKER_MODULES:
        yield
        return
    lock = Path(tempfile.gettempdir()) / "bpo_jax_docker_tests.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
