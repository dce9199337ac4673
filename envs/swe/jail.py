"""Runs one command in a throw-away jail built from a base tree plus in-memory edits.

A jail is `unshare --mount --net --pid --fork --kill-child` around `jail_init.py` (process 1 of
the new PID namespace, see there): a chroot on a private tmpfs that shows the system folders and
the interpreter read-only and a copy of the tree at `/tmp/testbed`, loopback-only networking, a
fresh unprivileged uid, per-process rlimits and (where cgroup v1 is writable) per-jail memory
and task cgroups, and a wall-clock timeout. Everything the command starts or writes lives in
the namespaces and is gone when the call returns; the files it created or changed come back as
`JailResult.changes`, so the caller can keep them (in memory) if it wants. `setpriv
--pdeathsig` ties the jail to the calling process: if that dies, the jail dies with it.

Nothing of a jail outlives the call, which is what makes the sandboxes that use it snapshottable
by plain `os.fork()` (the fork backend) as well as by CRIU: between steps there is no process
and no file to copy, only the Python object that holds the edits.

Needs root (to create the namespaces and switch uid) and util-linux's `unshare` and `setpriv`.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "JAIL_ROOT",
    "Limits",
    "JailResult",
    "JailUnavailableError",
    "check_jail",
    "run_harness",
    "run_in_jail",
]

JAIL_ROOT = "/tmp/testbed"  # Where the tree is inside a jail (the command's working folder).
_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail_init.py")
# The report plugin and the grading harness: one file in two roles (see harness.py).
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
_PLUGIN_NAME = "bpo_swe_report"
# Loaded by the harness from its own folder (see assert_guard.py).
GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assert_guard.py")
_HARNESS_IN_ROOT = "/.bpo_harness/harness.py"  # Root-owned in the jail (see jail_init).
# Unprivileged uids for jails: one drawn at random per command, far above any real account, so
# that the per-uid process limit (RLIMIT_NPROC) counts that command's processes alone.
_UID_BASE, _UID_SPAN = 1 << 30, 1 << 29
# Grace for the jail's own set-up and clean-up on top of the command's timeout.
_SLACK_S = 30.0


class JailUnavailableError(RuntimeError):
    """Jails cannot run on this machine (not root, or `unshare` missing); the message says why."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one jailed command.

    Attributes:
        timeout_s: Wall-clock seconds before every process of the command is killed.
        cpu_s: CPU seconds per process (RLIMIT_CPU).
        memory_mb: Address space per process (RLIMIT_AS), in MiB.
        processes: Processes and threads the command's uid may have at once (RLIMIT_NPROC).
        file_mb: Largest file the command may write, its output included (RLIMIT_FSIZE), MiB.
        tmpfs_mb: Size of the jail's /tmp (the tree, temporary files, the output), MiB.
        open_files: Open file descriptors per process (RLIMIT_NOFILE).
        output_chars: Output returned to the caller: this many characters, head and tail.
        capture_kb: Largest changed file brought back, KiB (larger ones are listed in
            `JailResult.ignored`).
        capture_mb: Most bytes of changed files in all (and of the pytest report) brought back.
    """

    timeout_s: float = 30.0
    cpu_s: int = 60
    memory_mb: int = 2048
    processes: int = 64
    file_mb: int = 16
    tmpfs_mb: int = 256
    open_files: int = 1024
    output_chars: int = 20000
    capture_kb: int = 1024
    capture_mb: int = 16

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"Limits.{field.name} must be positive, got {value!r}.")
        if self.file_mb >= self.tmpfs_mb:
            raise ValueError(
                f"Limits.file_mb ({self.file_mb}) must be below tmpfs_mb ({self.tmpfs_mb}): the "
                "output file lives on the jail's tmpfs."
            )

    def to_request(self) -> dict[str, Any]:
        return {
            "timeout_s": self.timeout_s,
            "cpu_s": self.cpu_s,
            "memory_bytes": self.memory_mb << 20,
            "processes": self.processes,
            "file_bytes": self.file_mb << 20,
            "tmpfs_bytes": self.tmpfs_mb << 20,
            "open_files": self.open_files,
            "output_chars": self.output_chars,
            "capture_file_bytes": self.capture_kb << 10,
            "capture_bytes": self.capture_mb << 20,
        }


@dataclasses.dataclass
class JailResult:
    """What a jailed command did.

    Attributes:
        exit_code: Its exit status, or None if it was killed by a signal or timed out.
        signal: Name of the signal that killed it (e.g. "SIGXFSZ" past the file-size limit).
        timed_out: It ran past `Limits.timeout_s` and was killed with everything it started.
        elapsed_s: Wall-clock seconds it ran.
        output: Its stdout and stderr together (head and tail if long).
        output_bytes: Total bytes it wrote to stdout and stderr.
        changes: Files it created or changed (relative path -> bytes) or deleted (-> None),
            caches (`__pycache__`, `.pytest_cache`) left out. Empty unless asked for.
        ignored: Changed paths not brought back (too large, not a regular file).
        report: The pytest report lines (see `harness.py`, the report plugin), or None.
        cgroups: Controllers ("memory", "pids") whose per-jail cgroup capped the command's
            processes together; empty where no writable cgroup v1 hierarchy exists (then only
            the per-process rlimits apply).
        refused: Overlay paths that were not written into the jail's tree, with the reason
            (a path through a symlink of the base tree).
        harness_end: The grading harness's verified end record (`run_harness` only): its
            `exitstatus`, `changed` (tampered objects) and `late_plugins`. None when the
            harness did not finish or its report could not be verified; then `report` may lack
            tests.
        error: Set when the jail itself could not be built; the other fields are then empty.
    """

    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool = False
    elapsed_s: float = 0.0
    output: str = ""
    output_bytes: int = 0
    changes: dict[str, bytes | None] = dataclasses.field(default_factory=dict)
    ignored: list[str] = dataclasses.field(default_factory=list)
    report: list[dict[str, Any]] | None = None
    cgroups: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    harness_end: dict[str, Any] | None = None
    error: str | None = None


_checked: dict[str, str] = {}
_prefixes: dict[str, tuple[str, ...]] = {}


def interpreter_paths(python: str) -> tuple[str, ...]:
    """Folders a jail must show for `python` to run: its venv and its base installation."""
    if python not in _prefixes:
        # Not by the real path: every venv of one base interpreter links to the same binary.
        if os.path.abspath(python) == os.path.abspath(sys.executable):
            found = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        else:
            out = subprocess.run(
                [python, "-c", "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix)"],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout  # fmt: skip
            found = out.split()
        found.append(os.path.dirname(os.path.abspath(python)))
        paths = {os.path.abspath(p) for p in found} | {os.path.realpath(p) for p in found}
        # Keep the outermost folders: one inside another (or inside /usr, which every jail
        # shows) is shown with it.
        outer = [
            p for p in paths
            if not any(p.startswith(q.rstrip("/") + "/") for q in paths | {"/usr"} if q != p)
        ]  # fmt: skip
        _prefixes[python] = tuple(sorted(p for p in outer if p != "/usr"))
    return _prefixes[python]


def check_jail() -> None:
    """Raises `JailUnavailableError` unless jails can run here (cached per process)."""
    if "reason" not in _checked:
        reason = ""
        if os.geteuid() != 0:
            reason = (
                f"The SWE sandbox jails need root (mount, network and PID namespaces and a "
                f"switch to an unprivileged uid); this process runs as uid {os.geteuid()}. Run "
                "as root, or use executor='docker' on a machine with Docker."
            )
        else:
            missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
            if missing:
                reason = (
                    f"The SWE sandbox jails need util-linux's {' and '.join(missing)} on PATH "
                    "(apt-get install util-linux)."
                )
        _checked["reason"] = reason
    if _checked["reason"]:
        raise JailUnavailableError(_checked["reason"])


def run_in_jail(
    base: str,
    files: Mapping[str, bytes | None],
    argv: Sequence[str],
    *,
    limits: Limits,
    env: Mapping[str, str] | None = None,
    cwd: str = ".",
    capture: bool = False,
    pytest_report: bool = False,
    python: str | None = None,
    read_only: Sequence[str] = (),
) -> JailResult:
    """Runs `argv` in a jail holding a copy of `base` with `files` applied on top.

    Args:
        base: Folder with the read-only base tree.
        files: Overlay: relative path -> new content, or None to delete the file.
        argv: The command and its arguments (run as is, no shell).
        limits: Resource limits and timeout.
        env: Extra environment variables (PATH, HOME, TMPDIR, ... are set already).
        cwd: Working folder relative to the tree's root.
        capture: Bring back the files the command created, changed or deleted.
        pytest_report: Put the report plugin on PYTHONPATH (load it with `-p bpo_swe_report`)
            and bring back its report.
        python: Interpreter that runs `jail_init.py` and comes first on the command's PATH
            (default: this one). Its installation is shown read-only inside the jail.
        read_only: More host folders to show read-only at their own paths (the jail shows only
            /usr, /etc, the /bin and /lib links, and the interpreter's installation).

    Returns:
        The result; `result.error` says why if the jail could not be built.

    Raises:
        JailUnavailableError: If jails cannot run here.
    """
    check_jail()
    python = python or sys.executable
    environ = _environment(python, env)
    request = _request(base, files, argv, limits, environ, cwd, capture, python, read_only)
    if pytest_report:
        with open(_HARNESS) as f:
            request["plugin"] = (f"{_PLUGIN_NAME}.py", f.read())
        environ["BPO_SWE_REPORT"] = "/tmp/.report/report.jsonl"
        environ["PYTHONPATH"] = ":".join(
            p for p in ("/tmp/.plugin", environ.get("PYTHONPATH", "")) if p
        )
    return _result(_run(request, limits, python))


def run_harness(
    base: str,
    files: Mapping[str, bytes | None],
    pytest_args: Sequence[str],
    *,
    limits: Limits,
    pythonpath: Sequence[str] = (),
    agent_files: Sequence[str] = (),
    agent_defs: Sequence[str] = (),
    python: str | None = None,
) -> JailResult:
    """Runs pytest under the grading harness (`harness.py`) in a jail; see there for why.

    Args:
        base, files, limits, python: As for `run_in_jail`.
        pytest_args: pytest's arguments (options and targets; no plugin to load).
        pythonpath: Folders inside the jail put first on `sys.path` after the harness and pytest
            are imported (e.g. `/tmp/testbed`).
        agent_files: Jail paths of the files the agent changed (an imperative `pytest.xfail()`
            raised from one of them does not count as xfailed).
        agent_defs: `PATH::QUALNAME` (jail paths) of the definitions the agent wrote or changed
            (`envs.swe.diffcheck.written`), for the harness's assertion guard.

    Returns:
        The result: `report` holds only records whose MAC checks out, `harness_end` the
        harness's end record (None if it is missing or the records do not add up).
    """
    check_jail()
    python = python or sys.executable
    environ = _environment(python, {})
    environ.pop("PYTHONPATH", None)
    key = secrets.token_hex(32)
    report_fd = 100 + secrets.randbelow(800)  # Below the jail's RLIMIT_NOFILE.
    argv = [python, "-P", "-s", "-B", _HARNESS_IN_ROOT]
    argv += harness_args(report_fd, pytest_args, pythonpath, agent_files, agent_defs)
    request = _request(base, files, argv, limits, environ, ".", False, python, ())
    with open(_HARNESS) as f, open(GUARD) as g:
        request["harness"] = {"source": f.read(), "key": key, "report_fd": report_fd,
                              "beside": {os.path.basename(GUARD): g.read()}}  # fmt: skip
    reply = _run(request, limits, python)
    result = _result(reply)
    if not result.error:
        result.report, result.harness_end = verify_harness_report(
            reply.get("harness_report") or [], key
        )
    return result


def harness_args(
    report_fd: int,
    pytest_args: Sequence[str],
    pythonpath: Sequence[str] = (),
    agent_files: Sequence[str] = (),
    agent_defs: Sequence[str] = (),
) -> list[str]:
    """`harness.py`'s command-line arguments (after the script), as `run_harness` takes them."""
    args = ["--report-fd", str(report_fd)]
    for folder in pythonpath:
        args += ["--path", folder]
    for path in agent_files:
        args += ["--agent-file", path]
    for definition in agent_defs:
        args += ["--agent-def", definition]
    return [*args, "--", *pytest_args]


def verify_harness_report(
    lines: Sequence[str], key: str
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(records, end record) from the harness's signed lines; see `harness.py`.

    Lines whose MAC is wrong are dropped. The end record is returned only when it is the last
    valid line, and every record it counts came through, in order.
    """
    records, end = [], None
    for line in lines:
        mac, _, text = line.partition(" ")
        expected = hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, expected):
            continue
        try:
            record = json.loads(text)
        except ValueError:
            continue
        if end is not None or not isinstance(record, dict) or record.get("seq") != len(records):
            end = None  # A record lost, or one after the end: not a complete run.
            break
        if record.get("when") == "end":
            end = record
        else:
            records.append(record)
    if end is not None and end.get("records") != len(records):
        end = None
    return records, end


def _environment(python: str, env: Mapping[str, str] | None) -> dict[str, str]:
    environ = {
        "PATH": f"{os.path.dirname(python)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/bin",
        "HOME": "/tmp/home",
        "TMPDIR": "/tmp",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    environ.update(env or {})
    return environ


def _request(base, files, argv, limits, environ, cwd, capture, python, read_only):
    return {
        "base": os.path.abspath(base),
        "files": {
            path: None if content is None else base64.b64encode(content).decode()
            for path, content in files.items()
        },
        "argv": list(argv),
        "cwd": cwd,
        "env": environ,
        "uid": _UID_BASE + secrets.randbelow(_UID_SPAN),
        "limits": limits.to_request(),
        "capture": capture,
        "read_only": sorted(set(interpreter_paths(python)) | set(read_only)),
    }


def _run(request: dict[str, Any], limits: Limits, python: str) -> dict[str, Any]:
    """Runs one request through `jail_init.py`; its JSON reply (or {"error": ...})."""
    command = [
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child",
        "--propagation", "private",
        python, "-I", "-S", _INIT,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(
            json.dumps(request).encode(), timeout=limits.timeout_s + _SLACK_S
        )
    except subprocess.TimeoutExpired:
        proc.kill()  # --kill-child then kills the jail's process 1, and with it the namespace.
        proc.communicate()
        return {
            "error": f"the jail did not finish within {limits.timeout_s + _SLACK_S:.0f} s and "
            "was killed"
        }
    try:
        return json.loads(out)
    except ValueError:
        detail = (err or out).decode("utf-8", "replace").strip()[-1500:]
        return {"error": f"the jail exited with status {proc.returncode} without a reply: {detail}"}


def _result(reply: dict[str, Any]) -> JailResult:
    if reply.get("error"):
        return JailResult(error=reply["error"])
    changes = {
        path: None if content is None else base64.b64decode(content)
        for path, content in (reply.get("changes") or {}).items()
    }
    return JailResult(
        exit_code=reply.get("exit_code"),
        signal=reply.get("signal"),
        timed_out=bool(reply.get("timed_out")),
        elapsed_s=float(reply.get("elapsed_s", 0.0)),
        output=reply.get("output", ""),
        output_bytes=int(reply.get("output_bytes", 0)),
        changes=changes,
        ignored=list(reply.get("ignored") or ()),
        report=reply.get("report"),
        cgroups=list(reply.get("cgroups") or ()),
        refused=list(reply.get("refused") or ()),
    )
