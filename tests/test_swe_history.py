"""No future history in the Docker executor's images (envs/swe/history.py, envs/swe/docker.py).

An official SWE-bench image can carry history from after `base_commit`. Here a local image of
the textvec record (its repository at `base_commit`, the bug in it) gets the upstream fix as a
later commit, with a tag, a remote ref, a note and a stash pointing at it, a reflog and
ORIG_HEAD that remember it, and everything packed; HEAD is then reset to `base_commit`. Without
the scrub each of `git log --all`, `git show`, `git cat-file -p`, `git fsck --lost-found` and a
plain read of `.git/` finds it; through the executor none does, and the gold patch is still
graded resolved. The scrub runs once per image: a second executor finds its result.

Skipped without Docker unless $BPO_REQUIRE_DOCKER is set (CI sets it); marked slow (about a
minute with the base and env images cached).
"""

from __future__ import annotations

import base64
import dataclasses
import subprocess
import time

import pytest
from swe_docker_fixtures import containers, remove_images, require_docker
from swe_fixtures import put
from swebench_fixtures import patched_files, record_task

from envs.base import make_env
from envs.base import step_result as step  # (observation, reward, done, info)
from envs.swe.docker import DockerExecutor
from envs.swe.images import CONTAINER_LABEL, ImageBuilder

pytestmark = pytest.mark.slow
_MADE: list[str] = []  # Scrubbed images the test made (removed at the end).

_MARKER = "FUTURE-MARKER-4711"
# Run as root in the base image: the fix becomes a later commit, then HEAD goes back.
_FUTURE = f"""
set -e
cd /testbed
export HOME=/tmp GIT_AUTHOR_NAME=upstream GIT_AUTHOR_EMAIL=up@localhost
export GIT_COMMITTER_NAME=upstream GIT_COMMITTER_EMAIL=up@localhost
git config --global --add safe.directory '*'
base=$(git rev-parse HEAD)
git apply
echo "upstream's fix, {_MARKER}" > FUTURE.txt
git add -A && git commit -q -m "Fix strip_accents_unicode ({_MARKER})"
fix=$(git rev-parse HEAD)
git tag -a -m "{_MARKER}" v-fixed "$fix"
git update-ref refs/remotes/origin/main "$fix"
git notes add -m "{_MARKER}" "$fix"
echo "{_MARKER}" > stashed.txt && git add stashed.txt && git stash -q
dangling=$(echo "{_MARKER}, dangling" | git commit-tree "$fix^{{tree}}" -p "$fix")
git reset -q --hard "$base"
git gc -q
chown -R 1001:1001 /testbed  # As the base image: the sandbox uid owns the tree.
echo "$fix $(git rev-parse "$fix:textvec/text.py") $dangling"
"""
# Reads every file of .git by hand: the later commit's and blob's ids (hex and binary, as pack
# indexes hold them) and the marker, also inside loose objects.
_BY_HAND = """
import os, sys, zlib
needles = [n.encode() for n in sys.argv[1:]] + [bytes.fromhex(n) for n in sys.argv[1:4]]
found = []
for folder, _, names in os.walk(".git"):
    for name in names:
        path = os.path.join(folder, name)
        data = open(path, "rb").read()
        try:
            data += zlib.decompress(data)
        except zlib.error:
            pass
        found += [path for n in needles if n in data]
print("FOUND", sorted(set(found)))
"""


def _history_image(image: str, patch: str) -> tuple[str, str, str, str]:
    """A copy of `image` whose repository holds the fix as a later commit: (image, the fix's
    commit, the fixed file's blob, a commit after it that nothing refers to)."""
    name = f"bpo-future-{time.monotonic_ns()}"
    done = subprocess.run(["docker", "run", "-i", "--name", name, "--network", "none",
                           "--label", CONTAINER_LABEL, image, "bash", "-c", _FUTURE],
                          input=patch, capture_output=True, text=True, timeout=300)  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr
        fix, blob, dangling = done.stdout.split()
        future = image.replace("/sweb.eval.", "/sweb.future-history.")
        subprocess.run(["docker", "commit", "--change", 'CMD ["/bin/bash"]', name, future],
                       check=True, capture_output=True)  # fmt: skip
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    return future, fix, blob, dangling


@pytest.fixture(scope="module")
def future(tmp_path_factory):
    require_docker()
    task = record_task(tmp_path_factory.mktemp("history"), "textvec")
    (local,) = ImageBuilder().for_tasks([task])
    image, fix, blob, dangling = _history_image(local.image, task.patch)
    yield local, image, fix, blob, dangling
    remove_images([*_MADE, image, local.image])
    assert containers() == []


def _commands(env, task, fix, blob, dangling):
    """What the agent's commands show of the later commit, by command."""
    env.reset(options={"task": task})
    script = base64.b64encode(_BY_HAND.encode()).decode()
    out = {}
    for label, command in (
        ("git log --all", "git log --all --oneline --decorate; git stash list; git notes list"),
        ("git show", f"git show {fix}"),
        ("git cat-file -p", f"git cat-file -p {fix} | head -8; git cat-file -p {blob} | head -3"),
        ("git fsck --lost-found", "git fsck --lost-found; git fsck --unreachable; "
                                  "ls .git/lost-found/*"),
        ("reading .git/",
         f"echo {script} | base64 -d | python - {fix} {blob} {dangling} {_MARKER}"),
    ):  # fmt: skip
        out[label] = step(env, f"run {command}").observation
    return out


def test_an_image_with_later_history_is_scrubbed_once(future, tmp_path):
    local, image, fix, blob, dangling = future
    task = record_task(tmp_path, "textvec")
    task = dataclasses.replace(task, image=image)
    # Unscrubbed, every way finds the later commit (so the checks below can fail).
    raw = make_env("swe", max_steps=30, executor="docker", docker={"scrub_history": False})
    seen = _commands(raw, task, fix, blob, dangling)
    raw.close()
    assert fix[:7] in seen["git log --all"] and _MARKER in seen["git show"], seen
    assert _MARKER in seen["git cat-file -p"] and dangling in seen["git fsck --lost-found"], seen
    assert "FOUND []" not in seen["reading .git/"], seen
    # Through the executor: nothing of it, HEAD still the base commit; the first use scrubs.
    started = time.monotonic()
    executor = DockerExecutor()
    clean = executor.image_of(task)
    scrub_s = time.monotonic() - started
    print(f"scrubbing {image}: {scrub_s:.1f} s")
    _MADE.append(clean)
    assert clean != image
    env = make_env("swe", max_steps=30, executor="docker")
    seen = _commands(env, task, fix, blob, dangling)
    assert "fatal: bad object" in seen["git show"], seen
    assert seen["git cat-file -p"].count("fatal: Not a valid object name") == 2, seen
    for label, text in seen.items():
        shown = "\n".join(line for line in text.splitlines() if not line.startswith("fatal:"))
        for needle in (fix[:7], blob[:7], dangling[:7], _MARKER):
            assert needle not in shown, (label, text)
    assert "FOUND []" in seen["reading .git/"], seen
    head = step(env, "run git rev-parse HEAD; git log --oneline | wc -l").observation.split()
    assert head[:2] == [DockerExecutor().labels(image)["base_commit"], "1"], head
    # The gold patch is still resolved.
    env.reset(options={"task": task})
    for rel, text in sorted(patched_files(task, task.patch).items()):
        assert not step(env, put(rel, text)).info["invalid_action"]
    graded = step(env, "submit")
    assert graded.reward == 1.0, graded.observation
    env.close()
    # Once per image: a new executor finds the scrubbed image; a clean image is used as is.
    started = time.monotonic()
    assert DockerExecutor().image_of(task) == clean
    assert time.monotonic() - started < min(5.0, scrub_s)
    assert DockerExecutor().image_of(local) == local.image
