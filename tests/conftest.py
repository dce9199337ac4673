"""Shared pytest setup."""

import os
from pathlib import Path

import pytest

# The repo is checked out next to a `shared/` folder that holds the data sets tests play on.
_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _alfworld_data_env():
    """Points ALFWorld at the shared test data unless the caller already chose a data root."""
    os.environ.setdefault("ALFWORLD_DATA", str(_SHARED_DATA / "alfworld"))
    yield
