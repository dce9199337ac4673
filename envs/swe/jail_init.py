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

When this process exits, the kernel kills whatever is left in the namespace and frees the tmpfs,
so a jail cannot leave a process or a file behind, whatever the command does.
"""

import base64
import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import stat
import struct
import sys
import time

# Host paths inside this mount namespace (the tmpfs hides the host's /tmp).
_TMPFS = "/tmp"
_PRIVATE = "/tmp/.jail"  # Root-only, outside the command's root: the output file.
NEW_ROOT = "/tmp/root"  # The command's file system root.
# Paths as the command sees them (under NEW_ROOT here).
TREE_IN_ROOT = "/tmp/testbed"
_PLUGIN_IN_ROOT = "/tmp/.plugin"  # Root-owned, world-readable: the pytest report plugin.
_REPORT_IN_ROOT = "/tmp/.report"  # Owned by the command's uid: pytest writes its report here.
TREE = NEW_ROOT + TREE_IN_ROOT
_SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}
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


def _build_root(opened, plugin):
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


def _loopback_up():
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, ifreq))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _copy_tree(src_fd, dest, uid):
    """Copies the folder open at `src_fd` into `dest` (created), never following symlinks."""
    os.mkdir(dest, 0o755)
    os.chown(dest, uid, uid)
    with os.scandir(src_fd) as entries:
        items = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in entries)
    for name, mode in items:
        target = os.path.join(dest, name)
        if stat.S_ISDIR(mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=src_fd)
            try:
                _copy_tree(fd, target, uid)
            finally:
                os.close(fd)
        elif stat.S_ISREG(mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=src_fd)
            try:
                out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    while True:
                        chunk = os.read(fd, 1 << 20)
                        if not chunk:
                            break
                        os.write(out, chunk)
                finally:
                    os.close(out)
            finally:
                os.close(fd)
            os.chown(target, uid, uid)
            os.chmod(target, 0o755 if mode & 0o111 else 0o644)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), target)
            os.lchown(target, uid, uid)


def _makedirs(path, uid):
    if os.path.isdir(path):
        return
    _makedirs(os.path.dirname(path), uid)
    os.mkdir(path, 0o755)
    os.chown(path, uid, uid)


def _apply_overlay(files, uid):
    for rel, content in sorted(files.items()):
        path = os.path.join(TREE, rel)
        if content is None:
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
            continue
        _makedirs(os.path.dirname(path), uid)
        if os.path.lexists(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, base64.b64decode(content))
        finally:
            os.close(fd)
        os.chown(path, uid, uid)


def _index(top):
    """rel path -> (kind, size, mtime_ns, inode) for every entry below `top`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            kind = "file" if stat.S_ISREG(st.st_mode) else "other"
            out[os.path.relpath(path, top)] = (kind, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _changes(before, max_file, max_total):
    """Files the command created, changed or deleted: (changes, ignored paths)."""
    after = _index(TREE)
    changes, ignored, total = {}, [], 0
    for rel in sorted(set(before) | set(after)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        if new is None:
            changes[rel] = None
            continue
        if rel.endswith((".pyc", ".pyo")):
            continue
        if new[0] != "file" or new[1] > max_file or total + new[1] > max_total:
            ignored.append(rel)
            continue
        try:
            fd = os.open(os.path.join(TREE, rel), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            ignored.append(rel)
            continue
        try:
            data = b""
            while len(data) <= max_file:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        total += len(data)
        changes[rel] = base64.b64encode(data).decode()
    return changes, ignored


def _read_output(path, keep):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= keep:
            return f.read().decode("utf-8", "replace"), size
        head = f.read(keep // 2).decode("utf-8", "replace")
        f.seek(size - keep // 2)
        tail = f.read().decode("utf-8", "replace")
    return f"{head}\n[... {size - keep} bytes of output left out ...]\n{tail}", size


def _read_report(path, max_bytes):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes)
    records = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


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


def _start(request, uid, out_fd, cgroups=()):
    """Forks the command as `uid` with its limits; returns its pid."""
    limits = request["limits"]
    env = dict(request["env"])
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, 65536)
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
    response = {"error": None}
    try:
        base_fd = os.open(request["base"], os.O_RDONLY | os.O_DIRECTORY)
        paths = [p for p in _SYSTEM_PATHS if os.path.lexists(p)] + list(request["read_only"])
        opened = _open_host_paths(dict.fromkeys(paths))
        _mount_tmpfs(_TMPFS, limits["tmpfs_bytes"], mode="0755")
        _loopback_up()
        _build_root(opened, request.get("plugin"))
        _copy_tree(base_fd, TREE, uid)
        os.close(base_fd)
        _apply_overlay(request["files"], uid)
        os.mkdir(_PRIVATE, 0o700)
        home = NEW_ROOT + "/tmp/home"
        os.mkdir(home, 0o700)
        os.chown(home, uid, uid)
        if request.get("plugin"):
            os.mkdir(NEW_ROOT + _REPORT_IN_ROOT, 0o700)
            os.chown(NEW_ROOT + _REPORT_IN_ROOT, uid, uid)
        before = _index(TREE) if request.get("capture") else {}
        out_path = os.path.join(_PRIVATE, "output")
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except Exception as e:  # noqa: BLE001 - the host reports it.
        response["error"] = f"setting up the jail failed: {type(e).__name__}: {e}"
        sys.stdout.write(json.dumps(response))
        sys.stdout.flush()
        os._exit(1)

    cgroups = _make_cgroups(f"bpo-jail-{uid}", limits)
    pid = _start(request, uid, out_fd, cgroups)
    os.close(out_fd)
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
    )
    if request.get("capture"):
        changes, ignored = _changes(before, limits["capture_file_bytes"], limits["capture_bytes"])
        response.update(changes=changes, ignored=ignored)
    if request.get("plugin"):
        report = os.path.join(NEW_ROOT + _REPORT_IN_ROOT, "report.jsonl")
        response["report"] = _read_report(report, limits["capture_bytes"])
    sys.stdout.write(json.dumps(response))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
