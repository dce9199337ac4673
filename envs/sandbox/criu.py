"""The `criu` backend: a sandbox is a process tree in its own PID namespace, checkpointed by CRIU.

A snapshot is `criu dump --leave-running` of the worker and all its children (shells, servers,
interpreters) into an image folder on a tmpfs; a restore is `criu restore` of that folder into a
fresh PID namespace (and network namespace, with `network_namespace=True`), as many times as
needed. This is the only backend that copies a whole process tree.

Plumbing: the worker talks to the trainer over two pipes (see `criu_proc`). On restore, CRIU
replaces the checkpointed pipes with new ones the trainer made (`--inherit-fd`), and
`--restore-sibling` makes the restored worker a child of the trainer, which reaps it. Killing a
worker (its namespace's init) kills its whole namespace. New sandboxes are restored from a
*template* image, taken once of a worker that has imported the env, which is faster than starting
Python.

Requirements (checked at start-up, with CRIU's own output in the error): root, and a `criu` >= 4
that passes `criu check` (see scripts/install_criu.sh; Debian bookworm's 3.17 does not work on
recent kernels). `$BPO_CRIU` overrides which binary is used.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from envs.registry import preload_for
from envs.sandbox import procutil
from envs.sandbox.backend import SandboxBackend, register_backend
from envs.sandbox.base import (
    BackendUnavailableError,
    Sandbox,
    SandboxError,
    SandboxFault,
    SnapshotHandle,
    SnapshotUnsupportedError,
)
from envs.sandbox.remote import Remote, RemoteSandbox
from envs.sandbox.worker import worker_environ

__all__ = ["CriuBackend", "CriuSandbox", "KDAT_DIR", "check_criu", "find_criu"]

# Where our CRIU build keeps its kernel-feature cache when /run is not a tmpfs (see
# scripts/install_criu.sh). Without the folder every CRIU call re-probes the kernel (~0.15 s).
KDAT_DIR = "/dev/shm/criu-kdat"
_MIN_MAJOR = 4
_CONTROL_TIMEOUT_S = 120.0
# Log lines CRIU prints on every run here, whatever failed: left out of error messages.
_BENIGN = re.compile(
    r"Can't setup RLIMIT_NOFILE|CLONE_PARENT \| CLONE_NEWPID but it might cause restore problem"
)
_check_cache: dict[str, str] = {}  # criu path -> "" if usable, else the reason.


def find_criu() -> str | None:
    """The criu binary to use: `$BPO_CRIU`, else `criu` on PATH or in the usual sbin folders."""
    override = os.environ.get("BPO_CRIU")
    if override:
        return override
    found = shutil.which("criu")
    if found:
        return found
    for folder in ("/usr/local/sbin", "/usr/sbin", "/sbin"):
        path = os.path.join(folder, "criu")
        if os.access(path, os.X_OK):
            return path
    return None


def _ensure_kdat_dir() -> None:
    try:
        os.makedirs(KDAT_DIR, mode=0o700, exist_ok=True)
        info = os.lstat(KDAT_DIR)
        if info.st_uid != 0 or not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022:
            # Someone else's folder: CRIU would read a cache it did not write. Leave it.
            return
    except OSError:
        pass


def check_criu(criu: str | None = None) -> str:
    """Checks that CRIU can run here; returns its path.

    Raises:
        BackendUnavailableError: If not root, no criu is found, it is older than 4, or
            `criu check` fails (the message includes CRIU's output and what to do).
    """
    criu = criu or find_criu()
    hint = "Install it with `sudo bash scripts/install_criu.sh` (builds CRIU 4.x)."
    if criu is None:
        raise BackendUnavailableError(
            f"The criu backend needs the `criu` binary; none found. {hint}"
        )
    if criu in _check_cache:
        if _check_cache[criu]:
            raise BackendUnavailableError(_check_cache[criu])
        return criu
    reason = ""
    if os.geteuid() != 0:
        reason = f"The criu backend must run as root (euid is {os.geteuid()})."
    else:
        _ensure_kdat_dir()
        try:
            version = subprocess.run(
                [criu, "--version"], capture_output=True, text=True, timeout=30
            ).stdout
            match = re.search(r"Version:\s*(\d+)\.", version)
            if not match or int(match.group(1)) < _MIN_MAJOR:
                reason = (
                    f"{criu} is {version.strip() or 'of unknown version'}; the criu backend needs "
                    f"CRIU >= {_MIN_MAJOR}. {hint}"
                )
            else:
                check = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
                output = (check.stdout + check.stderr).strip()
                if check.returncode != 0 or "Looks good" not in output:
                    reason = (
                        f"`{criu} check` failed (exit status {check.returncode}) on kernel "
                        f"{os.uname().release}: {output[-2000:]}. {hint}"
                    )
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"Running {criu} failed: {e}. {hint}"
    _check_cache[criu] = reason
    if reason:
        raise BackendUnavailableError(reason)
    return criu


@dataclasses.dataclass
class _Image:
    """A held snapshot: an image folder and the inodes of the worker's two pipes in it."""

    path: str
    req_ino: int
    resp_ino: int
    nbytes: int
    has_ghosts: bool


class CriuSandbox(RemoteSandbox):
    """A sandbox whose worker (and its children) live in their own PID namespace."""

    backend: CriuBackend


@register_backend("criu")
class CriuBackend(SandboxBackend):
    """CRIU sandboxes; see the module docstring.

    Args:
        env_name, env_kwargs, step_timeout_s, reset_timeout_s, max_snapshots, snapshot_policy:
            See `SandboxBackend`.
        preload: Modules the template worker imports (default `preload_for(env_name)`).
        network_namespace: Give every sandbox its own network namespace (loopback only). Needed
            for envs that run servers or hold sockets, so that copies do not clash on ports.
        image_dir: Where image folders go (default: a new folder on /dev/shm). Folders left
            there by trainers that died without closing their backend are deleted at start-up.
        criu: The criu binary (default `find_criu()`).
        keep_logs: Keep CRIU's logs of successful runs in the image folders.
        log_level: CRIU's log verbosity (0-4; 4 logs every step with timestamps).
        ghost_limit_bytes: Largest deleted-but-open file a checkpoint may include.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        preload: Sequence[str] | None = None,
        network_namespace: bool = False,
        image_dir: str | None = None,
        criu: str | None = None,
        keep_logs: bool = False,
        log_level: int = 2,
        ghost_limit_bytes: int = 256 << 20,
        **options: Any,
    ):
        super().__init__(env_name, env_kwargs, **options)
        self.ghost_limit_bytes = ghost_limit_bytes
        self.criu = check_criu(criu)
        self.network_namespace = network_namespace
        self.keep_logs = keep_logs
        self.log_level = log_level
        self.preload = tuple(preload_for(env_name) if preload is None else preload)
        base = image_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        _remove_orphaned_roots(base)
        self._root = tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=base)
        self._tmp = os.path.join(self._root, "tmp")  # The workers' TMPDIR.
        os.mkdir(self._tmp)
        self._seq = 0
        self._launchers: list[subprocess.Popen] = []
        self._template: _Image | None = None
        try:
            first = self._launch()
            self._template = self._dump(first)
            first.kill()
        except BaseException:
            self._shutdown()
            raise

    # Sandboxes ---------------------------------------------------------------------------------

    def _new_sandbox(self) -> Sandbox:
        assert self._template is not None
        (remote,) = self._restore(self._template, 1)
        return CriuSandbox(self, remote)

    def _new_sandboxes(self, n: int) -> list[Sandbox]:
        assert self._template is not None
        return [CriuSandbox(self, remote) for remote in self._restore(self._template, n)]

    def _snapshot_state(self, sandbox: Sandbox) -> _Image:
        assert isinstance(sandbox, CriuSandbox)
        if sandbox.remote.dead:
            raise SandboxError(f"{sandbox!r} has no live worker to snapshot.")
        return self._dump(sandbox.remote)

    def _fork(self, handle: SnapshotHandle, record: _Image, n: int) -> list[Sandbox]:
        return [CriuSandbox(self, remote) for remote in self._restore(record, n)]

    def _restore_state(self, sandbox: Sandbox, handle: SnapshotHandle, record: _Image) -> None:
        assert isinstance(sandbox, CriuSandbox)
        (remote,) = self._restore(record, 1)
        old, sandbox.remote = sandbox.remote, remote
        old.kill()

    def _free_snapshot(self, record: _Image) -> None:
        shutil.rmtree(record.path, ignore_errors=True)

    def _close_sandbox_impl(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, CriuSandbox)
        sandbox.remote.kill()

    def _snapshot_bytes(self, record: _Image) -> int:
        return record.nbytes

    def _shutdown(self) -> None:
        for launcher in self._launchers:
            if launcher.poll() is None:
                launcher.kill()
            launcher.wait()
        self._launchers.clear()
        if self._template is not None:
            self._free_snapshot(self._template)
            self._template = None
        shutil.rmtree(self._root, ignore_errors=True)

    # Processes ---------------------------------------------------------------------------------

    def _new_dir(self, kind: str) -> str:
        self._seq += 1
        path = os.path.join(self._root, f"{kind}-{self._seq}")
        os.mkdir(path)
        return path

    def _launch(self) -> Remote:
        """Starts a worker from scratch (Python start-up, imports, env construction)."""
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        argv = [sys.executable, "-m", "envs.sandbox.criu_proc", str(req_r), str(resp_w)]
        if self.network_namespace:
            argv.append("--net")
        launcher = _start(argv, req_r, resp_w, process_group=0, env=worker_environ())
        self._launchers.append(launcher)
        assert launcher.stdout is not None
        ready = select.select([launcher.stdout], [], [], self.reset_timeout_s)[0]
        line = launcher.stdout.readline().decode().strip() if ready else ""
        launcher.stdout.close()
        if not line.isdigit():
            launcher.kill()
            launcher.wait()
            os.close(req_w)
            os.close(resp_r)
            raise BackendUnavailableError(
                f"The CRIU sandbox launcher failed to start a worker: {line or 'no answer'}."
            )

        def on_kill(remote: Remote) -> None:
            try:
                launcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()

        remote = Remote(int(line), resp_r, req_w, pgid=None, label="criu worker", on_kill=on_kill)
        try:
            remote.call(
                "init",
                self.env_name,
                self.env_kwargs,
                self.preload,
                self._tmp,
                timeout_s=self.reset_timeout_s,
            )
        except SandboxError as e:
            remote.kill()
            raise BackendUnavailableError(f"The CRIU sandbox worker failed to start: {e}") from e
        return remote

    def _run_criu(self, args: list[str], log_dir: str, log: str, **popen: Any) -> None:
        """Runs criu (`args` after the binary) and raises with its log's errors if it fails."""
        result = subprocess.run(
            [self.criu, *args, "-o", log, "-W", log_dir, f"-v{self.log_level}"],
            capture_output=True,
            text=True,
            timeout=_CONTROL_TIMEOUT_S,
            **popen,
        )
        if result.returncode != 0:
            raise SandboxError(self._criu_failure(args[0], result, os.path.join(log_dir, log)))

    def _criu_failure(self, verb: str, result: Any, log_path: str) -> str:
        try:
            with open(log_path, errors="replace") as f:
                lines = [
                    line.rstrip()
                    for line in f
                    if ("Error" in line or "Warn" in line) and not _BENIGN.search(line)
                ]
        except OSError:
            lines = []
        output = ((result.stdout or "") + (result.stderr or "")).strip()
        details = "\n".join(lines[-8:]) or output[-2000:] or "(no output)"
        return f"`criu {verb}` failed with exit status {result.returncode}:\n{details}"

    def _dump(self, remote: Remote) -> _Image:
        """Checkpoints `remote`'s process tree (leaving it running) into a new image folder."""
        path = self._new_dir("img")
        req_ino, resp_ino = os.fstat(remote.wfd).st_ino, os.fstat(remote.rfd).st_ino
        args = ["dump", "-t", str(remote.pid), "-D", path, "--leave-running"]
        # Deleted files still mapped are saved in the image; ALFWorld's planner maps a 33 MB
        # copy of libdownward.so that it deleted (CRIU's default limit is 1 MB).
        args += ["--ghost-limit", str(self.ghost_limit_bytes)]
        if self.network_namespace:
            args.append("--tcp-established")
        try:
            self._run_criu(args, path, "dump.log")
        except SandboxError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise SnapshotUnsupportedError(f"CRIU could not checkpoint {remote}: {e}") from e
        except subprocess.TimeoutExpired as e:
            shutil.rmtree(path, ignore_errors=True)
            raise SnapshotUnsupportedError(f"`criu dump` of {remote} timed out: {e}") from e
        if not self.keep_logs:
            _remove(os.path.join(path, "dump.log"))
        entries = [entry for entry in os.scandir(path) if entry.is_file()]
        nbytes = sum(entry.stat().st_size for entry in entries)
        ghosts = any(entry.name.startswith("ghost-file-") for entry in entries)
        return _Image(path, req_ino, resp_ino, nbytes, ghosts)

    def _restore(self, image: _Image, n: int) -> list[Remote]:
        """`n` new workers restored from `image`, in parallel (one criu process each).

        An image that holds deleted files (ghosts) is restored one copy at a time: CRIU puts a
        ghost back at a fixed path while it restores, so two restores at once would collide.
        """
        if n > 1 and image.has_ghosts:
            remotes: list[Remote] = []
            try:
                for _ in range(n):
                    remotes.extend(self._restore(image, 1))
            except BaseException:
                for remote in remotes:
                    remote.kill()
                raise
            return remotes
        jobs = []
        try:
            for _ in range(n):
                work = self._new_dir("restore")
                req_r, req_w = os.pipe()
                resp_r, resp_w = os.pipe()
                args = [
                    self.criu, "restore", "-D", image.path, "-W", work, "-o", "restore.log",
                    "--restore-detached", "--restore-sibling", f"-v{self.log_level}",
                    "--pidfile", os.path.join(work, "pid"),
                    "--inherit-fd", f"fd[{req_r}]:pipe:[{image.req_ino}]",
                    "--inherit-fd", f"fd[{resp_w}]:pipe:[{image.resp_ino}]",
                ]  # fmt: skip
                if self.network_namespace:
                    args.append("--tcp-established")
                proc = _start(args, req_r, resp_w, stderr=subprocess.STDOUT, text=True)
                jobs.append((proc, work, req_w, resp_r))
        except BaseException:
            for proc, _, req_w, resp_r in jobs:
                proc.kill()
                proc.wait()
                os.close(req_w)
                os.close(resp_r)
            raise
        remotes, failures = [], []
        for proc, work, req_w, resp_r in jobs:
            try:
                output, _ = proc.communicate(timeout=_CONTROL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            pid = _read_pid(os.path.join(work, "pid")) if proc.returncode == 0 else None
            if pid is None:
                failures.append(
                    self._criu_failure(
                        "restore",
                        subprocess.CompletedProcess(proc.args, proc.returncode, output, ""),
                        os.path.join(work, "restore.log"),
                    )
                )
                os.close(req_w)
                os.close(resp_r)
                continue
            if not self.keep_logs:
                shutil.rmtree(work, ignore_errors=True)
            remotes.append(
                Remote(pid, resp_r, req_w, pgid=None, label="criu worker", on_kill=_reap_child)
            )
        if failures:
            for remote in remotes:
                remote.kill()
            raise SandboxFault("crash", f"CRIU could not restore {image.path}: {failures[0]}")
        return remotes

    def process_count(self) -> int:
        """Processes in all live sandboxes (workers and their children)."""
        total = 0
        for sandbox in self._sandboxes:
            if isinstance(sandbox, CriuSandbox) and not sandbox.remote.dead:
                total += 1 + len(procutil.descendant_pids(sandbox.remote.pid))
        return total


_ROOT_PREFIX = "bpo-criu-"


def _remove_orphaned_roots(base: str) -> None:
    """Deletes image folders left by trainers that died without closing their backend.

    A folder is named after the pid of the process that made it; it is removed once that
    process is gone (images on a tmpfs are memory, so they must not pile up).
    """
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid_text = name[len(_ROOT_PREFIX) :].split("-", 1)[0]
        if name.startswith(_ROOT_PREFIX) and pid_text.isdigit():
            if not procutil.pid_alive(int(pid_text)):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _start(argv: list[str], req_r: int, resp_w: int, **popen: Any) -> subprocess.Popen:
    """Starts `argv` with a worker channel's far ends (the request pipe's read end, the reply
    pipe's write end), which it inherits and this process then closes; its stdout is a pipe."""
    try:
        return subprocess.Popen(
            argv,
            pass_fds=(req_r, resp_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            **popen,
        )
    finally:
        os.close(req_r)
        os.close(resp_w)


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _reap_child(remote: Remote) -> None:
    """Reaps a restored worker (a child of this process, through --restore-sibling)."""
    status = procutil.reap(remote.pid, timeout_s=10)
    if status is not None:
        remote.exit_note = f"the worker {procutil.describe_status(status)}"
