"""No future history: an image's repository reduced to what its base commit reaches.

SWE-bench's images hold the repository at `base_commit` in `/testbed`, but its `.git` can hold
history from after it: branches, tags and remote refs of later commits, reflogs, stashes, notes,
packed objects. `git log --all`, `git show <later sha>` or `git fsck --lost-found` then show the
upstream fix. Before the first command of an episode, the Docker executor runs each image it is
given through `scrubbed` (once per image and machine; the result is cached by the image's id):

- a repository that holds nothing but `base_commit` (every ref, reflog and pseudo-ref such as
  ORIG_HEAD reaches that commit alone, `git fsck --unreachable` finds nothing, no alternates)
  is kept as it is: the project's own images are built so (one commit);
- any other gets a fresh single-commit repository: `base_commit` fetched with `--depth 1` into
  a new repository (the same commit, so `git rev-parse HEAD` is still `base_commit`; one
  branch, the one that was checked out; no other ref, no reflog, only the objects of that
  commit's tree), which replaces `.git`; the index is read from that commit and the working
  tree is left as it was. The container is committed as `bpo-swe/scrubbed:<id>` with the
  image's entrypoint, command and user. (The old objects stay in the source image's layers on
  the host; a container of the new image cannot reach them.)

Its cost is one container and one commit per image, measured on an image holding
pytest-dev/pytest's repository at 7.0.0 with all of its history (27,904 commits, 7,980 refs,
60 MB of `.git`): 2.1 s and a 1.5 MB layer (the new `.git`: one pack of 601 objects); a later
lookup of the cached answer 0.04 s; the check of a clean repository 0.7 s. The alternative,
deleting the other refs, `git reflog expire --expire=now --all` and `git gc --prune=now`, took
21 s on the same repository and left 59 MB: it keeps the 14,180 commits before `base_commit`
(which the fresh fetch drops: `git log` shows one commit), and its result depends on every place
git can keep a ref; the fresh fetch has one answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["SCRIPT", "scrubbed"]

_VERSION = "1"  # Bumped when the script changes what an image holds.
_TAG = "bpo-swe/scrubbed"

# Runs as root in a container of the image; $1 is base_commit (may be empty or unknown).
SCRIPT = r"""
set -eu
cd /testbed 2>/dev/null && [ -e .git ] || { echo "bpo-scrub: none"; exit 0; }
if ! command -v git >/dev/null 2>&1; then rm -rf .git; echo "bpo-scrub: removed"; exit 0; fi
export HOME=/tmp/bpo-scrub-home GIT_CONFIG_NOSYSTEM=1
mkdir -p "$HOME" && git config --global --add safe.directory '*'
base=${1:-}
if [ -z "$base" ] || ! git cat-file -e "$base^{commit}" 2>/dev/null; then
  base=$(git rev-parse HEAD)
fi
base=$(git rev-parse "$base^{commit}")
clean() {  # Only base_commit anywhere; the fsck (a walk of every object) last.
  [ "$(git rev-parse HEAD)" = "$base" ] && [ ! -s .git/objects/info/alternates ] \
    && [ "$(git rev-list --all --reflog HEAD | sort -u)" = "$base" ] \
    && ! ls .git | grep -qE '^[A-Z_]+_HEAD$' \
    && [ -z "$(git fsck --unreachable --no-progress 2>/dev/null | head -n 1)" ]
}
if clean; then echo "bpo-scrub: clean $base"; exit 0; fi
branch=$(git symbolic-ref -q --short HEAD || echo main)
owner=$(stat -c %u:%g .)
fresh=$(mktemp -d /tmp/bpo-scrub.XXXXXX)
git update-ref refs/bpo-scrub/base "$base"
git init -q "$fresh"
git -C "$fresh" fetch -q --depth 1 --no-tags file:///testbed \
  "refs/bpo-scrub/base:refs/heads/$branch"
git -C "$fresh" symbolic-ref HEAD "refs/heads/$branch"
rm -rf .git
mv "$fresh/.git" .git
rm -rf "$fresh" .git/logs .git/FETCH_HEAD
git read-tree HEAD
git update-index -q --refresh >/dev/null 2>&1 || true
chown -R "$owner" .git
echo "bpo-scrub: scrubbed $base $(du -sk .git | cut -f1)"
"""


def _docker(docker: str, *args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout)


def _config(docker: str, image: str) -> dict:
    done = _docker(docker, "image", "inspect", "--format", "{{json .Id}} {{json .Config}}", image)
    if done.returncode != 0:
        raise RuntimeError(f"`docker image inspect {image}` failed: {done.stderr.strip()}")
    image_id, config = done.stdout.strip().split(" ", 1)
    return {"id": json.loads(image_id), **(json.loads(config) or {})}


def scrubbed(
    docker: str,
    image: str,
    base_commit: str,
    cache_dir: Path,
    label: str,
    log: Callable[[str], None] = lambda message: None,
) -> str:
    """The image to run for `image`: itself if its repository holds only `base_commit` (or it
    has none), else its scrubbed copy (made once, then found by the source image's id).

    Args:
        docker: The Docker CLI.
        image: The task's image (present).
        base_commit: The task's base commit (an unknown one: the image's HEAD).
        cache_dir: Where the answer for each image id is kept.
        label: The label of the containers this project starts.
        log: Progress messages.

    Raises:
        RuntimeError: If the image's repository cannot be read or rewritten.
    """
    config = _config(docker, image)
    key = hashlib.sha256(f"{_VERSION}\0{config['id']}\0{base_commit}".encode()).hexdigest()[:16]
    marker = Path(cache_dir) / "scrubbed" / key
    if marker.is_file():
        known = marker.read_text().strip()
        if known == image or _docker(docker, "image", "inspect", known).returncode == 0:
            return known
    started = time.monotonic()
    name = f"bpo-scrub-{os.getpid()}-{time.monotonic_ns()}"
    # No entrypoint of ours: the commit keeps the container's, and `ENTRYPOINT []` is not
    # honoured by every daemon; the image's own is put back below.
    run = ["run", "--name", name, "--network", "none", "--label", label, "--entrypoint", ""]
    if config.get("User"):
        run += ["--user", "0"]
    try:
        done = _docker(docker, *run, image, "bash", "-c", SCRIPT, "bash", base_commit or "")
        status = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode != 0 or not status.startswith("bpo-scrub: "):
            raise RuntimeError(
                f"removing later history from {image} failed (exit status {done.returncode}): "
                f"{(done.stdout + done.stderr).strip()[-1500:]}"
            )
        result = image
        if status.split()[1] in ("scrubbed", "removed"):
            result = f"{_TAG}:{key}"
            changes = [f"CMD {json.dumps(config.get('Cmd') or [])}",
                       f"LABEL org.bpo.swe.scrubbed={json.dumps(image)}"]  # fmt: skip
            if config.get("Entrypoint"):
                changes.append(f"ENTRYPOINT {json.dumps(config['Entrypoint'])}")
            if config.get("User"):
                changes.append(f"USER {config['User']}")
            args = [a for change in changes for a in ("--change", change)]
            commit = _docker(docker, "commit", *args, name, result)
            if commit.returncode != 0:
                raise RuntimeError(f"`docker commit` of {image}'s scrub failed: {commit.stderr}")
    finally:
        _docker(docker, "rm", "-f", name, timeout=120)
    log(f"{image}: {status[len('bpo-scrub: ') :]} in {time.monotonic() - started:.1f} s")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(result + "\n")
    return result
