"""Shared pytest setup."""

import os
from pathlib import Path

import gguf_fixtures
import pytest

# The repo is checked out next to a `shared/` folder that holds the data sets tests play on.
_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


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
