"""libtpu for the tests that build TPU topologies (the compile tool's extra, `tpu-compile`).

`bash scripts/test.sh` installs it (`scripts/setup.sh test`); a bare runtime install does not.
Where it is missing these tests skip, naming the install command, unless they run under CI
(`CI=true`, or `BPO_REQUIRE_LIBTPU` set, as `.ci/run` does after installing it): there they
fail, so that a broken install cannot pass as a skip.
"""

import importlib.util
import os

import pytest

INSTALL = "pip install -r requirements-tpu-compile.txt (or bash scripts/setup.sh tpu-compile)"


def require_libtpu() -> None:
    """Skips the calling test where libtpu is not installed; fails it under CI."""
    if importlib.util.find_spec("libtpu") is not None:
        return
    reason = f"libtpu is not installed (the compile tool's extra): {INSTALL}"
    if os.environ.get("CI") == "true" or os.environ.get("BPO_REQUIRE_LIBTPU"):
        pytest.fail(f"under CI libtpu must be installed: {reason}")
    pytest.skip(reason)
