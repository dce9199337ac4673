"""The agent's tool grammar for repository repair: one action per line, parsed into a `ToolCall`.

Actions are single lines because the agent's action is the model's text up to its first newline
(`bpo_jax.agent.parse_action`, which also collapses runs of whitespace and drops trailing
periods). Multi-line text is written with `\\n`.

    view PATH [START[-END]]       show a file with line numbers (40 lines unless a range is given,
                                  at most 100), or list a folder; `view PATH:START-END` works too
    ls [PATH]                     list a folder (default: the repository root)
    find NAME                     files whose path contains NAME
    search TEXT [PATH]            lines that contain TEXT (literal, case-sensitive), in PATH if its
                                  last word names a file or folder, else everywhere
    replace PATH:LINE OLD => NEW  replace the first OLD on line LINE with NEW (runs of whitespace
                                  in OLD match any run of whitespace; NEW may be empty)
    edit PATH START-END TEXT      replace lines START..END with TEXT; `\\n` starts a new line and
                                  `\\\\` is one backslash; TEXT without leading spaces is indented
                                  like line START (empty TEXT deletes the lines)
    insert PATH LINE TEXT         insert TEXT after line LINE (0: before the first line), indented
                                  like the line below it
    test [TESTS]                  run pytest on TESTS (node ids or files), by default on the tests
                                  the task says fail
    run COMMAND                   run a bash command in the repository root, jailed: no network,
                                  time, memory, process and output limits; the files it changes
                                  are kept
    diff                          show your changes so far
    submit                        finish: the task's tests decide the reward
    help                          show this list
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

__all__ = [
    "HELP",
    "SHORT_HELP",
    "ToolCall",
    "ToolSyntaxError",
    "parse_action",
    "replace_in_line",
    "shell_words",
    "unescape",
]

HELP = textwrap.dedent(__doc__.split("\n\n", 2)[2]).rstrip()
SHORT_HELP = (
    "Tools: view PATH [START-END] | ls [PATH] | find NAME | search TEXT [PATH] | "
    "replace PATH:LINE OLD => NEW | edit PATH START-END TEXT | insert PATH LINE TEXT | "
    "test [TESTS] | run COMMAND | diff | submit | help"
)
TOOLS = ("view", "ls", "find", "search", "replace", "edit", "insert", "test", "run", "diff",
         "submit", "help")  # fmt: skip
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_PATH_LINE_RE = re.compile(r"^(.+?):(\d+(?:-\d+)?)$")


class ToolSyntaxError(ValueError):
    """An action that is not a well-formed tool call; the message is the agent's observation."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed action.

    Attributes:
        tool: One of `TOOLS`.
        path: The PATH argument, as written ("" if none).
        start, end: Line numbers (1-based, inclusive); 0 when not given.
        text: The rest: search text, OLD, edit text, command, test arguments.
        new: NEW of `replace`.
        args: Test arguments of `test`.
    """

    tool: str
    path: str = ""
    start: int = 0
    end: int = 0
    text: str = ""
    new: str = ""
    args: tuple[str, ...] = ()


def unescape(text: str) -> str:
    """`\\n` -> newline and `\\\\` -> backslash; other backslashes stay as they are."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "n\\":
            out.append("\n" if text[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# One piece of a shell word per match: whitespace, '...', "..." (backslash escapes inside), a
# backslash-escaped character, or a run of plain characters. Each pattern is linear in its
# match, so splitting is linear in the text (shlex.split, char by char, took 26 s on 1 MB).
_SHELL_PIECE = re.compile(
    r"""(?P<space>\s+)|'(?P<single>[^']*)'|"(?P<double>[^"\\]*(?:\\.[^"\\]*)*)"|\\(?P<escaped>.)"""
    r"""|(?P<plain>[^\s'"\\]+)""",
    re.DOTALL,
)
_DOUBLE_QUOTE_ESCAPE = re.compile(r"""\\([\\"])""")


def shell_words(text: str) -> list[str]:
    """`shlex.split(text)` (POSIX rules, no comments) in time linear in `len(text)`.

    Raises:
        ValueError: For an unclosed quote or a trailing backslash, as `shlex.split` does.
    """
    words: list[str] = []
    word: list[str] | None = None  # The word being read; None between words.
    pos = 0
    while pos < len(text):
        m = _SHELL_PIECE.match(text, pos)
        if m is None:
            raise ValueError(f"unclosed quote or trailing backslash at {pos} of the arguments")
        pos = m.end()
        if m.lastgroup == "space":
            if word is not None:
                words.append("".join(word))
                word = None
            continue
        piece = m.group(m.lastgroup)
        if m.lastgroup == "double":
            # Inside double quotes a backslash escapes only a double quote or a backslash.
            piece = _DOUBLE_QUOTE_ESCAPE.sub(r"\1", piece)
        word = [] if word is None else word
        word.append(piece)
    if word is not None:
        words.append("".join(word))
    return words


def replace_in_line(line: str, old: str, new: str) -> str | None:
    """`replace` on one line: the first match of OLD (whitespace runs match any whitespace run)
    becomes NEW; the line ending is kept. None if OLD is not on the line."""
    body = line.rstrip("\r\n")
    pattern = r"\s+".join(re.escape(word) for word in old.split())
    match = re.search(pattern, body) if pattern else None
    if match is None:
        return None
    return body[: match.start()] + new + body[match.end() :] + line[len(body) :]


def _split_path_range(words: list[str], tool: str, required: bool) -> tuple[str, int, int, int]:
    """(path, start, end, words used) from `PATH[:RANGE] [RANGE]`."""
    if not words:
        raise ToolSyntaxError(f"'{tool}' needs a path. Usage: {_usage(tool)}")
    path, start, end, used = words[0], 0, 0, 1
    match = _PATH_LINE_RE.match(path)
    spec = None
    if match:
        path, spec = match.group(1), match.group(2)
    elif len(words) > 1 and _RANGE_RE.match(words[1]):
        spec, used = words[1], 2
    if spec is None:
        if required:
            raise ToolSyntaxError(f"'{tool}' needs line numbers. Usage: {_usage(tool)}")
        return path, 0, 0, used
    m = _RANGE_RE.match(spec)
    assert m is not None
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else start
    return path, start, end, used


def _usage(tool: str) -> str:
    for line in HELP.splitlines():
        if line.strip().startswith(tool + " ") or line.strip() == tool:
            return line.strip().split("  ")[0]
    return tool


def parse_action(action: str | None) -> ToolCall:
    """Parses one action line.

    Raises:
        ToolSyntaxError: With a message that says what was wrong and how to write it.
    """
    text = (action or "").strip()
    if not text:
        raise ToolSyntaxError(f"Empty action. {SHORT_HELP}")
    if "\n" in text:
        text = text.split("\n", 1)[0].strip()
    tool, _, rest = text.partition(" ")
    tool = tool.lower()
    rest = rest.strip()
    if tool not in TOOLS:
        raise ToolSyntaxError(f"Unknown tool {tool[:40]!r}. {SHORT_HELP}")
    if tool in ("diff", "submit", "help"):
        return ToolCall(tool)
    if tool == "ls":
        return ToolCall(tool, path=rest or ".")
    if tool in ("find", "run"):
        if not rest:
            raise ToolSyntaxError(f"'{tool}' needs an argument. Usage: {_usage(tool)}")
        return ToolCall(tool, text=rest)
    if tool == "search":
        if not rest:
            raise ToolSyntaxError(f"'search' needs the text to look for. Usage: {_usage(tool)}")
        return ToolCall(tool, text=rest)
    if tool == "test":
        try:
            args = tuple(shell_words(rest))
        except ValueError:
            args = tuple(rest.split())
        return ToolCall(tool, args=args)
    words = rest.split(" ") if rest else []
    if tool == "view":
        path, start, end, used = _split_path_range(words, tool, required=False)
        if used < len(words):
            raise ToolSyntaxError(
                f"Unexpected text after the range: {' '.join(words[used:])[:60]!r}. "
                f"Usage: {_usage(tool)}"
            )
        return ToolCall(tool, path=path, start=start, end=end)
    if tool == "replace":
        path, start, end, used = _split_path_range(words, tool, required=True)
        if end != start:
            raise ToolSyntaxError("'replace' works on one line; use 'edit' for a range.")
        body = " ".join(words[used:])
        if " => " in body:
            old, new = body.split(" => ", 1)
        elif body.endswith(" =>"):
            old, new = body[:-3], ""
        else:
            raise ToolSyntaxError(f"'replace' needs 'OLD => NEW'. Usage: {_usage(tool)}")
        if not old.strip():
            raise ToolSyntaxError(f"'replace' needs a non-empty OLD. Usage: {_usage(tool)}")
        return ToolCall(tool, path=path, start=start, end=end, text=old.strip(), new=new.strip())
    # edit, insert
    if tool == "insert":
        if len(words) < 2 or not words[1].isdigit():
            raise ToolSyntaxError(f"'insert' needs a path and a line number. Usage: {_usage(tool)}")
        body = " ".join(words[2:])
        return ToolCall(tool, path=words[0], start=int(words[1]), end=int(words[1]), text=body)
    path, start, end, used = _split_path_range(words, tool, required=True)
    return ToolCall(tool, path=path, start=start, end=end, text=" ".join(words[used:]))
