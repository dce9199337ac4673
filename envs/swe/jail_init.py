"""Process 1 of a command jail: `unshare ... python -I -S jail_init.py` (stdlib only).

`envs.swe.jail` starts this program as root inside fresh mount, network and PID namespaces and
writes one JSON request to its stdin. It then:

1. mounts a private, size-limited tmpfs and builds a small root file system in it: the host's
   /usr, /etc and the Python installation bound read-only at their own paths, a minimal /dev, a
   fresh /proc (this PID namespace only), and a writable /tmp on the tmpfs. The command is
   chrooted there: it cannot see the host's other files (the repository, /root, the data
   folder, other sandboxes), and nothing it writes reaches the host's disk;
2. brings up the loopback interface (the namespace has no other: no network);
3. copies the read-only base tree into /tmp/testbed (in the new root) and applies the overlay
   (the agent's edits), owned by a fresh unprivileged uid;
4. runs the command as that uid with resource limits (CPU seconds, address space, processes,
   file size, open files) and a wall-clock timeout; on timeout, or when the command ends,
   `kill(-1, SIGKILL)` removes every other process of the namespace;
5. walks the tree for files the command created, changed or deleted, and answers with one JSON
   object on stdout: exit status, output (head and tail), changes, and the pytest report.
   Everything this process (root, outside the chroot) does in the tree goes through directory
   descriptors opened before the command started, never through a path (see `jail_fs.py`):
   the command owns the tree and can rename or replace any of its folders with a symlink.
   For grading it also installs the harness (`harness.py`, root-owned) and hands it a report
   descriptor and a key (see `envs.swe.jail.run_harness`).

When this process exits, the kernel kills whatever is left in the namespace and frees the tmpfs,
so a jail cannot leave a process or a file behind, whatever the command does.
"""

import ctypes
import fcntl
import importlib.util
import json
import os
import resource
import signal
import socket
import struct
import sys
import time


def _load_sibling(name):
    # By file path: under `python -I` this folder is not on sys.path, and must not be.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(f"_bpo_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


jail_fs = _load_sibling("jail_fs")

# Host paths inside this mount namespace (the tmpfs hides the host's /tmp).
_TMPFS = "/tmp"
_PRIVATE = "/tmp/.jail"  # Root-only, outside the command's root: the output file.
NEW_ROOT = "/tmp/root"  # The command's file system root.
# Paths as the command sees them (under NEW_ROOT here).
TREE_IN_ROOT = "/tmp/testbed"
_PLUGIN_IN_ROOT = "/tmp/.plugin"  # Root-owned, world-readable: the pytest report plugin.
_REPORT_IN_ROOT = "/tmp/.report"  # Owned by the command's uid: pytest writes its report here.
# Root-owned, world-readable, outside the command's writable folders: the grading harness.
HARNESS_IN_ROOT = "/.bpo_harness/harness.py"
TREE = NEW_ROOT + TREE_IN_ROOT
_SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 32, 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None):
    if _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _mount_tmpfs(target, size_bytes, mode="1777"):
    _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(size_bytes)},mode={mode}")


def _bind_read_only(fd, target):
    source = f"/proc/self/fd/{fd}"
    _mount(source, target, None, _MS_BIND)
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID)


def _mkdirs(path, mode=0o755):
    if not os.path.isdir(path):
        _mkdirs(os.path.dirname(path), mode)
        os.mkdir(path, mode)


def _open_host_paths(paths):
    """O_PATH fds (or symlink targets) of the host paths to show, opened before /tmp is hidden."""
    opened = []
    for path in paths:
        if os.path.islink(path):
            opened.append((path, "link", os.readlink(path)))
        elif os.path.isdir(path):
            opened.append((path, "dir", os.open(path, os.O_PATH | os.O_DIRECTORY)))
    return opened


def _build_root(opened, plugin, harness=None):
    """Fills NEW_ROOT: read-only host paths, /dev, /proc, /tmp (see the module docstring)."""
    _mkdirs(NEW_ROOT)
    # Parents first, so that a path inside another (a venv inside a bound folder) lands on top.
    for path, kind, value in sorted(opened, key=lambda item: item[0]):
        target = NEW_ROOT + path
        if kind == "link":
            if not os.path.lexists(target):
                _mkdirs(os.path.dirname(target))
                os.symlink(value, target)
            continue
        _mkdirs(target)
        _bind_read_only(value, target)
        os.close(value)
    dev = NEW_ROOT + "/dev"
    _mkdirs(dev)
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm", 0o1777)
    os.chmod(f"{dev}/shm", 0o1777)
    _mkdirs(NEW_ROOT + "/proc")
    _mount("proc", NEW_ROOT + "/proc", "proc", _MS_NOSUID | _MS_NODEV)
    for folder in ("/tmp", "/var/tmp", "/run/lock"):
        _mkdirs(NEW_ROOT + folder)
        os.chmod(NEW_ROOT + folder, 0o1777)
    if plugin:
        name, source = plugin
        _mkdirs(NEW_ROOT + _PLUGIN_IN_ROOT)
        with open(os.path.join(NEW_ROOT + _PLUGIN_IN_ROOT, name), "w") as f:
            f.write(source)
    if harness:  # The harness and the files it loads beside it (its assertion guard).
        path = NEW_ROOT + HARNESS_IN_ROOT
        _mkdirs(os.path.dirname(path))
        files = {os.path.basename(path): harness["source"], **harness.get("beside", {})}
        for name, source in files.items():
            target = os.path.join(os.path.dirname(path), os.path.basename(name))
            with open(target, "w") as f:
                f.write(source)
            os.chmod(target, 0o444)


def _loopback_up():
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, ifreq))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _read_output(path, keep):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= keep:
            return f.read().decode("utf-8", "replace"), size
        head = f.read(keep // 2).decode("utf-8", "replace")
        f.seek(size - keep // 2)
        tail = f.read().decode("utf-8", "replace")
    return f"{head}\n[... {size - keep} bytes of output left out ...]\n{tail}", size


def _read_report(dir_fd, max_bytes):
    """The plugin's records from `report.jsonl` in the report folder open at `dir_fd`."""
    try:
        data = jail_fs.read_file_beneath(dir_fd, "report.jsonl", max_bytes)
    except OSError:
        return None
    records = []
    for line in data[:max_bytes].decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _read_private_lines(path, max_bytes):
    """Lines of a root-only file outside the command's root (the harness report)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes)
    return data.decode("utf-8", "replace").splitlines()


def _cgroup_dirs():
    """controller -> this process's cgroup folder, for the v1 memory and pids controllers."""
    found = {}
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            if controller in ("memory", "pids"):
                folder = f"/sys/fs/cgroup/{controller}{path}"
                if os.path.isdir(folder):
                    found[controller] = folder
    return found


def _make_cgroups(name, limits):
    """Per-jail cgroups capping the command's total memory and tasks (v1; best effort).

    RLIMIT_AS and RLIMIT_NPROC bound each process; these bound the processes together (a fork
    bomb whose every process allocates). Returns the folders made (empty where cgroups cannot be
    created, e.g. without a writable cgroup v1 hierarchy; the rlimits still apply).
    """
    made = []
    settings = {
        "memory": ("memory.limit_in_bytes", limits["memory_bytes"]),
        "pids": ("pids.max", limits["processes"]),
    }
    for controller, parent in _cgroup_dirs().items():
        _remove_stale_cgroups(parent)
        folder = os.path.join(parent, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        made.append(folder)
        knob, value = settings[controller]
        try:
            with open(os.path.join(folder, knob), "w") as f:
                f.write(str(int(value)))
        except OSError:
            pass
    return made


def _remove_stale_cgroups(parent):
    """Removes empty cgroups left by jails that were killed before cleaning up."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith("bpo-jail-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(parent, name)
        try:
            # Old ones only: a new one may belong to a jail whose command has not joined yet.
            if time.time() - os.stat(path).st_mtime > 600:
                os.rmdir(path)  # Fails (EBUSY) while processes are in it.
        except OSError:
            pass


def _start(request, uid, out_fd, cgroups=(), stdin_fd=None, pass_fd=None):
    """Forks the command as `uid` with its limits; returns its pid.

    `stdin_fd` becomes the command's stdin (default /dev/null); `pass_fd` is (fd, number): a
    descriptor the command inherits at that number (the harness's report file).
    """
    limits = request["limits"]
    env = dict(request["env"])
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY) if stdin_fd is None else stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        if pass_fd is None:
            os.closerange(3, 65536)
        else:
            fd, number = pass_fd
            os.dup2(fd, number)  # Inheritable: dup2 clears FD_CLOEXEC.
            os.closerange(3, number)
            os.closerange(number + 1, 65536)
        os.setsid()
        for folder in cgroups:
            try:
                with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                    f.write("0")
            except OSError:
                pass  # Best effort: the rlimits below still apply.
        for name, value in (
            ("RLIMIT_CPU", limits["cpu_s"]),
            ("RLIMIT_AS", limits["memory_bytes"]),
            ("RLIMIT_NPROC", limits["processes"]),
            ("RLIMIT_FSIZE", limits["file_bytes"]),
            ("RLIMIT_NOFILE", limits["open_files"]),
            ("RLIMIT_CORE", 0),
        ):
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
        os.chroot(NEW_ROOT)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir(os.path.join(TREE_IN_ROOT, request.get("cwd") or "."))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        argv = request["argv"]
        os.execve(_which(argv[0], env.get("PATH", "")), argv, env)
    except BaseException as e:  # noqa: BLE001 - reported through the output, then exit.
        os.write(2, f"jail: cannot run {request['argv'][:1]}: {e}\n".encode())
    os._exit(127)


def _which(name, path):
    if "/" in name:
        return name
    for folder in path.split(":"):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"{name!r} not found on PATH {path!r}")


def _kill_all_and_reap(deadline):
    """SIGKILLs every other process of the namespace and reaps them (until `deadline`)."""
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            return
        time.sleep(0.005)


def _wait(pid, timeout_s):
    """Waits for the command; returns (wait status or None, timed_out, seconds)."""
    start = time.monotonic()
    deadline = start + timeout_s
    status, delay = None, 0.0005
    while True:
        try:
            done, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if done == pid:
            status = st
            break
        if done:
            continue  # An orphan re-parented to us.
        if time.monotonic() >= deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    elapsed = time.monotonic() - start
    _kill_all_and_reap(time.monotonic() + 10.0)
    return status, status is None, elapsed


def _describe(status):
    if status is None:
        return None, None
    if os.WIFSIGNALED(status):
        return None, signal.Signals(os.WTERMSIG(status)).name
    return os.waitstatus_to_exitcode(status), None


def main():
    request = json.loads(sys.stdin.buffer.read())
    limits = request["limits"]
    uid = int(request["uid"])
    harness = request.get("harness")
    response = {"error": None}
    try:
        base_fd = os.open(request["base"], os.O_RDONLY | os.O_DIRECTORY)
        paths = [p for p in _SYSTEM_PATHS if os.path.lexists(p)] + list(request["read_only"])
        opened = _open_host_paths(dict.fromkeys(paths))
        _mount_tmpfs(_TMPFS, limits["tmpfs_bytes"], mode="0755")
        _loopback_up()
        _build_root(opened, request.get("plugin"), harness)
        os.mkdir(TREE, 0o755)
        os.chown(TREE, uid, uid)
        # From here on the tree is reached only through this descriptor (see jail_fs): the
        # command can rename the tree's path, or put a symlink there.
        tree_fd = os.open(TREE, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        jail_fs.copy_tree(base_fd, tree_fd, uid)
        os.close(base_fd)
        refused = jail_fs.apply_overlay(tree_fd, request["files"], uid)
        os.mkdir(_PRIVATE, 0o700)
        home = NEW_ROOT + "/tmp/home"
        os.mkdir(home, 0o700)
        os.chown(home, uid, uid)
        report_dir_fd = None
        if request.get("plugin"):
            os.mkdir(NEW_ROOT + _REPORT_IN_ROOT, 0o700)
            os.chown(NEW_ROOT + _REPORT_IN_ROOT, uid, uid)
            report_dir_fd = os.open(
                NEW_ROOT + _REPORT_IN_ROOT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            )
        stdin_fd = pass_fd = harness_path = None
        if harness:
            # The report goes to a root-only file outside the command's root, reachable only
            # through the descriptor the harness inherits; the key comes on stdin.
            harness_path = os.path.join(_PRIVATE, "harness.jsonl")
            report_fd = os.open(harness_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            pass_fd = (report_fd, int(harness["report_fd"]))
            stdin_fd, key_w = os.pipe()
            os.write(key_w, harness["key"].encode() + b"\n")
            os.close(key_w)
        before = jail_fs.index(tree_fd) if request.get("capture") else {}
        out_path = os.path.join(_PRIVATE, "output")
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except Exception as e:  # noqa: BLE001 - the host reports it.
        response["error"] = f"setting up the jail failed: {type(e).__name__}: {e}"
        sys.stdout.write(json.dumps(response))
        sys.stdout.flush()
        os._exit(1)

    cgroups = _make_cgroups(f"bpo-jail-{uid}", limits)
    pid = _start(request, uid, out_fd, cgroups, stdin_fd, pass_fd)
    os.close(out_fd)
    if pass_fd is not None:
        os.close(pass_fd[0])
        os.close(stdin_fd)
    status, timed_out, elapsed = _wait(pid, float(limits["timeout_s"]))
    for folder in cgroups:
        try:
            os.rmdir(folder)
        except OSError:
            pass
    exit_code, killed_by = _describe(status)
    output, output_bytes = _read_output(out_path, int(limits["output_chars"]))
    response.update(
        exit_code=exit_code,
        signal=killed_by,
        timed_out=timed_out,
        elapsed_s=round(elapsed, 3),
        output=output,
        output_bytes=output_bytes,
        cgroups=sorted(f.split("/")[4] for f in cgroups),
        refused=refused,
    )
    if request.get("capture"):
        found, ignored = jail_fs.changes(
            tree_fd, before, limits["capture_file_bytes"], limits["capture_bytes"]
        )
        response.update(changes=found, ignored=ignored)
    if report_dir_fd is not None:
        response["report"] = _read_report(report_dir_fd, limits["capture_bytes"])
    if harness_path is not None:
        response["harness_report"] = _read_private_lines(harness_path, limits["capture_bytes"])
    sys.stdout.write(json.dumps(response))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
