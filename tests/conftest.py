"""Shared pytest setup."""

import atexit
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


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's `--dist loadgroup` (scripts/test.sh): a module's tests in one
    worker (its module fixtures built once), and the Docker modules' tests all in one."""
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        group = "docker" if module in _DOCKER_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
