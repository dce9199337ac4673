"""File operations of a jail's process 1 on the tree, all relative to directory descriptors.

`jail_init.py` runs as root outside the command's chroot, where an absolute symlink means the
host's file. The jailed uid owns the tree (and its path sits in the sticky /tmp of the jail's
root), so while or after a command runs it can rename any folder of the tree, or the tree
itself, and put a symlink (to `/`, `/etc`, `/proc/1/root`) in its place. So after the
descriptor of the tree's root is opened (before the command starts), nothing here names a tree
path from `/` again: every folder is entered with `openat(..., O_NOFOLLOW | O_DIRECTORY)`
relative to its parent's descriptor, every file is opened with `O_NOFOLLOW | O_NONBLOCK` and
checked to be a regular file with `fstat`, and entries are listed with `scandir(fd)` and
`lstat`-style stats. A symlink anywhere in a path makes that path fail (ELOOP, ENOTDIR)
instead of leading elsewhere, and a renamed tree is still read where the descriptor points:
inside the jail's own tmpfs.

Stdlib only: it runs under `python -I -S`.
"""

import base64
import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Caches, never brought back (and not walked, so their size costs nothing).
SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"})


def _parts(rel):
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OSError(f"not a path inside the tree: {rel!r}")
    return parts


def open_dir_beneath(dir_fd, parts, create_uid=None):
    """Descriptor of the folder `parts` below `dir_fd`, entered without following symlinks.

    With `create_uid`, missing folders are created (mode 0755, owned by that uid).
    """
    fd = os.dup(dir_fd)
    try:
        for name in parts:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create_uid is None:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                os.chown(name, create_uid, create_uid, dir_fd=fd, follow_symlinks=False)
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file_beneath(dir_fd, rel, max_bytes):
    """Bytes of the regular file `rel` below `dir_fd` (at most `max_bytes` + 1 of them).

    Raises:
        OSError: If a component is a symlink or missing, or the file is not a regular file.
    """
    *folders, name = _parts(rel)
    parent = open_dir_beneath(dir_fd, folders)
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{rel} is not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def copy_tree(src_fd, dest_fd, uid):
    """Copies the folder open at `src_fd` into the (empty) folder open at `dest_fd`.

    Never follows a symlink on either side; symlinks are copied as symlinks, special files are
    left out.
    """
    with os.scandir(src_fd) as entries:
        items = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in entries)
    for name, mode in items:
        if stat.S_ISDIR(mode):
            os.mkdir(name, 0o755, dir_fd=dest_fd)
            os.chown(name, uid, uid, dir_fd=dest_fd, follow_symlinks=False)
            src = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            try:
                dest = os.open(name, _DIR_FLAGS, dir_fd=dest_fd)
                try:
                    copy_tree(src, dest, uid)
                finally:
                    os.close(dest)
            finally:
                os.close(src)
        elif stat.S_ISREG(mode):
            src = os.open(name, _FILE_FLAGS, dir_fd=src_fd)
            try:
                perm = 0o755 if mode & 0o111 else 0o644
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                out = os.open(name, flags, perm, dir_fd=dest_fd)
                try:
                    while chunk := os.read(src, 1 << 20):
                        os.write(out, chunk)
                    os.fchown(out, uid, uid)
                    os.fchmod(out, perm)
                finally:
                    os.close(out)
            finally:
                os.close(src)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dest_fd)
            os.chown(name, uid, uid, dir_fd=dest_fd, follow_symlinks=False)


def apply_overlay(tree_fd, files, uid):
    """Writes the overlay (rel path -> base64 content, or None to delete) into the tree.

    A path through a symlink of the tree (a link that the base tree holds) is refused rather
    than followed, so an edit can never land outside the tree.

    Returns:
        The overlay paths that could not be applied (with the reason).
    """
    refused = []
    for rel, content in sorted(files.items()):
        try:
            *folders, name = _parts(rel)
            parent = open_dir_beneath(tree_fd, folders, None if content is None else uid)
        except OSError as e:
            if content is not None:
                refused.append(f"{rel}: {e.strerror or e}")
            continue
        try:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                if content is not None:
                    refused.append(f"{rel}: is a folder")
                continue
            if st is not None:
                os.unlink(name, dir_fd=parent)
            if content is None:
                continue
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=parent)
            try:
                os.write(fd, base64.b64decode(content))
                os.fchown(fd, uid, uid)
            finally:
                os.close(fd)
        finally:
            os.close(parent)
    return refused


def index(dir_fd, prefix=""):
    """rel path -> (kind, size, mtime_ns, inode) for every non-folder entry below `dir_fd`.

    Folders are entered through descriptors and never through a symlink; a symlink is an entry
    of kind "other" (it is not brought back, and whatever it points to is not looked at).
    """
    out = {}
    with os.scandir(dir_fd) as entries:
        items = []
        for entry in entries:
            try:
                items.append((entry.name, entry.stat(follow_symlinks=False)))
            except OSError:
                continue
    for name, st in sorted(items, key=lambda item: item[0]):
        rel = prefix + name
        if stat.S_ISDIR(st.st_mode):
            if name in SKIP_DIRS:
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # Replaced since it was listed.
            try:
                out.update(index(child, rel + "/"))
            finally:
                os.close(child)
            continue
        kind = "file" if stat.S_ISREG(st.st_mode) else "other"
        out[rel] = (kind, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def changes(tree_fd, before, max_file, max_total):
    """Files the command created, changed or deleted below `tree_fd`: (changes, ignored paths).

    `changes` maps a relative path to its base64 content, or None for a deleted file.
    """
    after = index(tree_fd)
    found, ignored, total = {}, [], 0
    for rel in sorted(set(before) | set(after)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        if new is None:
            found[rel] = None
            continue
        if rel.endswith((".pyc", ".pyo")):
            continue
        if new[0] != "file" or new[1] > max_file or total + new[1] > max_total:
            ignored.append(rel)
            continue
        try:
            data = read_file_beneath(tree_fd, rel, max_file)
        except OSError:
            ignored.append(rel)
            continue
        if len(data) > max_file or total + len(data) > max_total:
            ignored.append(rel)  # It grew between the listing and the read.
            continue
        total += len(data)
        found[rel] = base64.b64encode(data).decode()
    return found, ignored
