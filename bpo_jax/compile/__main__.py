"""`python -m bpo_jax.compile`: the compile-only tool's command line (`cli.command_line`)."""

import sys

from bpo_jax.compile.cli import command_line

if __name__ == "__main__":
    sys.exit(command_line())
