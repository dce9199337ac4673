"""What the command lines share: one-line errors for mistakes in their arguments.

A wrong flag, config field, value or path is the user's to fix, and a traceback of the
library's frames hides the one line that says what to fix. `run` is `absl.app.run` whose flag
parsing ends such a mistake in one line on stderr and exit status 2 (argparse's convention for
usage errors); inside `main`, the checks made at start-up (config validation, paths) run under
`start_up_errors()`, which does the same for their `ValueError`s and `OSError`s. Errors after
start-up keep their tracebacks. `BPO_TRACEBACK=1` or `--verbosity=1` (absl's `-v 1`) shows the
traceback of a start-up error too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence

from absl import app, flags

EXIT_USAGE = 2
TRACEBACK_ENV = "BPO_TRACEBACK"
_VERBOSITY = re.compile(r"^--?(?:verbosity|v)(?:=|$)")


def wants_traceback(argv: Sequence[str] | None = None, environ=os.environ) -> bool:
    """Whether a start-up error should show its traceback: `BPO_TRACEBACK` set (not 0) or a
    `--verbosity`/`-v` of 1 or more on the command line."""
    if environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
        return True
    argv = list(sys.argv if argv is None else argv)
    for i, item in enumerate(argv):
        if not _VERBOSITY.match(item):
            continue
        if "=" in item:
            value = item.partition("=")[2]
        else:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            return int(value) >= 1
        except ValueError:
            return False
    return False


def one_line(error: BaseException) -> str:
    """The error's message on one line (whitespace runs collapsed)."""
    text = str(error)
    if isinstance(error, (KeyError, AttributeError)) and len(error.args) == 1:
        text = str(error.args[0])  # Not KeyError's repr of its key.
    return " ".join(text.split()) or type(error).__name__


def fail(message: str, prog: str | None = None) -> None:
    """Prints `prog: error: message` on stderr and exits with status 2."""
    prog = prog or os.path.basename(sys.argv[0] or "bpo_jax")
    print(
        f"{prog}: error: {message} [{TRACEBACK_ENV}=1 shows the traceback]",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(EXIT_USAGE)


@contextlib.contextmanager
def start_up_errors(prog: str | None = None) -> Iterator[None]:
    """Ends a `ValueError`, `TypeError` or `OSError` raised inside in one line and exit status
    2 (unless `wants_traceback`). Wrap only the start-up checks: later errors are not the
    arguments' and keep their tracebacks."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        if wants_traceback():
            raise
        fail(one_line(e), prog)


def parse_flags(
    argv: Sequence[str],
    flag_values: flags.FlagValues = flags.FLAGS,
    prog: str | None = None,
    explain: Callable[[flags.FlagValues, Sequence[str]], str | None] | None = None,
) -> list[str]:
    """Parses `argv` into `flag_values`; a mistake ends in one line and exit status 2.

    Args:
      argv: the command line, program name first.
      flag_values: the flags to parse into.
      prog: the program's name in the message.
      explain: called on a failure other than absl's own flag errors, it may return a better
        message (e.g. `bpo_jax.experiment.unknown_field` names the override with no field).

    Returns:
      The arguments that are not flags, program name first.
    """
    try:
        return flag_values(list(argv))
    except Exception as e:  # Every failure to parse the command line is a usage error.
        if wants_traceback(argv):
            raise
        message = None
        if explain is not None and not isinstance(e, flags.Error):
            message = explain(flag_values, argv)
        fail(message or one_line(e), prog)
        raise  # Unreachable: fail exits.


def run(main: Callable[[list[str]], object], prog: str, explain=None) -> None:
    """`absl.app.run(main)` with `parse_flags` as its flag parser."""
    app.run(main, flags_parser=lambda argv: parse_flags(argv, flags.FLAGS, prog, explain))
