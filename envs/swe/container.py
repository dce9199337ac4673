"""One command's round trip through a container: the request tar, the script, the reply tar.

The executor (`envs.swe.docker.DockerExecutor`) sends a container the request on stdin: the
edits of the working copy (`request_archive`) and the executor's files under `RUN`. `SCRIPT`,
run by bash as root in the container, unpacks it, runs the command (the `launch` line: its
rlimits, timeout and uid), and packs the result on stdout: exit status, output (its head and
tail past the kept size), the pytest report plugin's records and with `capture` the files the
command created, changed or deleted, which `read_reply` turns into a `JailResult`.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tarfile
import time
from collections.abc import Mapping
from typing import Any

from envs.swe.jail import JailResult, Limits
from envs.swe.jail_fs import SKIP_DIRS

RUN = "/run/bpo"  # The executor's files in a container (root-owned; the key 0400).

# Runs in the container as root: unpack the request, run the command, pack the result.
# {launch} is the command's line (a subshell that sets the command's rlimits, so that packing
# the result is not subject to them); it must leave its exit status in $?.
SCRIPT = r"""
set -u
tar -x -C / || exit 90
if [ -s {run}/deleted ]; then (cd /testbed && xargs -0 rm -f -- < {run}/deleted); fi
{own}
mkdir -p {run}/result /tmp/.report /tmp/home && chmod 1777 /tmp/.report /tmp/home
cd /testbed
{activate} >/dev/null 2>&1 || true
if [ {capture} = 1 ]; then
  find . -path ./.git -prune -o ! -type d -print0 | sort -z > {run}/before
  touch {run}/mark && sleep 0.02  # File times are coarse: a write after this is newer.
fi
start=$(date +%s%N)
{launch} > {run}/out 2>&1
status=$?
end=$(date +%s%N)
R={run}/result
echo "$status $(( (end - start) / 1000000 )) $(wc -c < {run}/out)" > $R/status
size=$(wc -c < {run}/out)
if [ "$size" -le {keep} ]; then cp {run}/out $R/head
else head -c {half} {run}/out > $R/head; tail -c {half} {run}/out > $R/tail; fi
cp /tmp/.report/report.jsonl $R/report.jsonl 2>/dev/null
if [ {capture} = 1 ]; then
  cd /testbed
  find . -path ./.git -prune -o ! -type d -print0 | sort -z > {run}/after
  comm -z -23 {run}/before {run}/after > $R/deleted
  new="-newer {run}/mark -o -cnewer {run}/mark"
  find . -path ./.git -prune {skip} -o ! -type d \( $new \) -type f -size -{small}c -print0 \
    > {run}/changed
  find . -path ./.git -prune {skip} -o ! -type d \( $new \) ! \( -type f -size -{small}c \) \
    -print0 > $R/ignored
  tar -c --null --no-recursion -T {run}/changed -f $R/changes.tar
fi
cd $R && tar -c .
"""


def request_archive(
    files: Mapping[str, bytes | None], extra: Mapping[str, bytes], base: str | None, uid: int
) -> bytes:
    """The tar a container unpacks at `/`: the edits over /testbed (`None`: deleted), `extra`.

    `base` is the copied-out /testbed an edited file takes its executable bit from, `uid` the
    image's unprivileged uid that owns /testbed (0: root).
    """
    archive = io.BytesIO()
    deleted = []
    with tarfile.open(fileobj=archive, mode="w") as t:
        for rel, content in sorted(files.items()):
            if content is None:
                deleted.append(rel)
                continue
            # An edited file keeps the base's executable bit (`./tests/runtests.py`).
            runnable = base is not None and os.access(os.path.join(base, rel), os.X_OK)
            _add(t, f"testbed/{rel}", content, uid=uid, mode=0o755 if runnable else 0o644)
        _add(t, f"{RUN[1:]}/deleted", b"".join(p.encode() + b"\0" for p in deleted))
        for path, content in extra.items():
            _add(t, path.lstrip("/"), content, mode=0o400 if path.endswith("/key") else 0o644)
    return archive.getvalue()


def script(launch: str, activate: str, limits: Limits, uid: int, capture: bool) -> str:
    """`SCRIPT` for one command: its `launch` line, after the image's `activate` line."""
    keep = int(limits.output_chars)
    skip = " ".join(f"-o -name {name} -prune" for name in sorted(SKIP_DIRS))
    return SCRIPT.format(
        run=RUN, activate=activate, capture=int(capture), launch=launch,
        keep=keep, half=max(keep // 2, 1), skip=skip, small=(limits.capture_kb << 10) + 1,
        own=_own_new_folders(uid),
    )  # fmt: skip


def read_reply(
    done: subprocess.CompletedProcess, limits: Limits, capture: bool, start: float
) -> JailResult:
    """The command's result from the container's reply (`start`: `time.monotonic()` at launch)."""
    try:
        parts = _members(done.stdout)
        status, elapsed_ms, size = (parts["status"].decode().split() + ["0", "0"])[:3]
    except (tarfile.TarError, KeyError, ValueError):
        detail = done.stderr.decode("utf-8", "replace").strip()[-800:]
        return JailResult(error=f"docker run failed (exit status {done.returncode}): {detail}")
    code, elapsed = int(status), int(elapsed_ms) / 1000
    timed_out = code == 128 + signal.SIGKILL and elapsed >= limits.timeout_s * 0.98
    sig = None
    if 128 < code <= 128 + 64:
        try:
            sig = signal.Signals(code - 128).name
        except ValueError:
            sig = f"signal {code - 128}"
    output = parts.get("head", b"").decode("utf-8", "replace")
    if "tail" in parts:
        left = int(size) - len(parts["head"]) - len(parts["tail"])
        output += (f"\n[... {left} bytes of output left out ...]\n"
                   + parts["tail"].decode("utf-8", "replace"))  # fmt: skip
    changes, ignored = {}, []
    if capture:
        changes, ignored = _changes(parts, limits)
    result = JailResult(
        exit_code=None if sig else code,
        signal=sig,
        timed_out=timed_out,
        elapsed_s=elapsed if elapsed else time.monotonic() - start,
        output=output,
        output_bytes=int(size),
        changes=changes,
        ignored=ignored,
        report=_records(parts.get("report.jsonl", b"")),
        cgroups=["memory", "pids"],
    )
    if code == 90:
        result = JailResult(error="the request could not be unpacked in the container")
    return result


def _own_new_folders(uid: int) -> str:
    """Gives the folders tar made for new files of the overlay (as root) to the image's uid."""
    if not uid:
        return ":"
    return (f"find /testbed -path /testbed/.git -prune -o -type d -user 0 -print0 | "
            f"xargs -0 -r chown {uid}:{uid}")  # fmt: skip


def ulimits(limits: Limits) -> str:
    """bash's `ulimit` line for the command's per-process limits (file size in KiB blocks)."""
    return f"ulimit -f {limits.file_mb << 10} -t {limits.cpu_s} -n {limits.open_files}"


def drop_privileges(labels: Mapping[str, str]) -> str:
    """The command prefix that drops to the image's unprivileged uid (none: stay root)."""
    uid = labels.get("uid")
    return f"setpriv --reuid={uid} --regid={uid} --clear-groups --" if uid else ""


def _add(t: tarfile.TarFile, name: str, content: bytes, *, uid: int = 0, mode: int = 0o644):
    info = tarfile.TarInfo(name)
    info.size = len(content)
    info.mode = mode
    info.uid = info.gid = uid
    info.mtime = int(time.time())
    t.addfile(info, io.BytesIO(content))


def _members(data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for member in t.getmembers():
            if member.isfile():
                out[member.name.removeprefix("./")] = t.extractfile(member).read()
    return out


def _records(text: bytes) -> list[dict[str, Any]]:
    records = []
    for line in text.decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _changes(parts: Mapping[str, bytes], limits: Limits):
    """(changes, ignored) from the container's `changes.tar` and `deleted` list."""
    changes: dict[str, bytes | None] = {}
    ignored: list[str] = []
    for rel in parts.get("deleted", b"").split(b"\0"):
        if rel:
            changes[rel.decode("utf-8", "replace").removeprefix("./")] = None
    ignored += [p.decode("utf-8", "replace").removeprefix("./")
                for p in parts.get("ignored", b"").split(b"\0") if p]  # fmt: skip
    budget = limits.capture_mb << 20
    if "changes.tar" in parts:
        with tarfile.open(fileobj=io.BytesIO(parts["changes.tar"])) as t:
            for member in t.getmembers():
                rel = member.name.removeprefix("./")
                if not member.isfile() or member.size > limits.capture_kb << 10:
                    ignored.append(rel)
                elif member.size > budget:
                    ignored.append(rel)
                else:
                    budget -= member.size
                    changes[rel] = t.extractfile(member).read()
    return changes, ignored
