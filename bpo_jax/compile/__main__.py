"""`python -m bpo_jax.compile`: the compile-only tool's command line (`cli.main`)."""

import sys

from bpo_jax.compile.cli import main

if __name__ == "__main__":
    sys.exit(main())
