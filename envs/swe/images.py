"""Local Docker images for the project's repair tasks, in SWE-bench's image layout.

SWE-bench evaluates an instance in an image with the repository at `base_commit` in `/testbed`
and an environment with its test dependencies installed; nothing is fetched when it runs. This
builder makes the same layout from Debian's and PyPI's packages, without an image registry, in
three cached layers (as SWE-bench's base, env and instance images):

- base: `debootstrap --variant=minbase` of Debian with python3, python3-venv and git, imported
  with `docker import` (about a minute and 420 MB, once per machine);
- env: a venv at `/opt/testbed` with the test dependencies (default: the pytest the local jail
  uses, so that both executors grade alike, plus the task's `test_requirements`, what its test
  environment holds: `envs.swe.testenv`) installed offline from wheels that `pip download`
  fetched on the host beforehand (`--network none` while installing); tagged by the hash of the
  base image and of the wheels;
- instance: the task's pristine tree at `/testbed` as a git repository with one commit (fixed
  author and dates, so the same tree always gives the same `base_commit`), owned by an
  unprivileged uid that the executor runs commands as; tagged by the env and the tree's hash.

Labels (`org.bpo.swe.*`) tell the executor (`envs.swe.docker`) how to use an image: how to
activate the env, which uid to drop to, that its Python can run the signed grading harness
(`envs.swe.harness`, Python >= 3.11), and the commit of `/testbed`.

    python -m envs.swe.images --data-root DIR   # builds an image per task tree of DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from envs.swe.data import SweTask
from envs.swe.patching import tree_hash

__all__ = ["CONTAINER_LABEL", "LABEL", "ImageBuilder", "default_requirements"]

LABEL = "org.bpo.swe."
CONTAINER_LABEL = "org.bpo.swe.container"  # On every container this project starts.
ENV_PREFIX = "/opt/testbed"
SANDBOX_UID = 1001  # The uid commands run as in these images (owns /testbed).
_PATH = f"{ENV_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_BASE_PACKAGES = ("python3", "python3-venv", "git", "ca-certificates")
_GIT_DATE = "2000-01-01T00:00:00+0000"


def default_requirements() -> tuple[str, ...]:
    """The env's test dependencies: the pytest of this interpreter (the local jail's)."""
    import pytest

    return (f"pytest=={pytest.__version__}",)


def _sha(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class ImageBuilder:
    """Builds (or finds cached) base, env and instance images; see the module docstring.

    Args:
        docker: The Docker CLI.
        cache_dir: Where downloaded wheels are kept (by the hash of the requirements).
        requirements: pip requirements of the env (default: `default_requirements()`).
        suite: Debian suite of the base image.
        mirror: Debian mirror debootstrap downloads from.
        namespace: Repository prefix of the images' names.
        log: Progress messages.
    """

    def __init__(
        self,
        docker: str = "docker",
        cache_dir: str = "~/.cache/bpo_jax/swe-images",
        requirements: Sequence[str] | None = None,
        suite: str = "bookworm",
        mirror: str = "http://deb.debian.org/debian",
        namespace: str = "bpo-swe",
        log: Callable[[str], None] = lambda message: None,
    ):
        self.docker = docker
        self.cache_dir = Path(cache_dir).expanduser()
        self.requirements = tuple(requirements or default_requirements())
        self.suite = suite
        self.mirror = mirror
        self.namespace = namespace
        self.log = log
        self._envs: dict[tuple[str, ...], str] = {}

    # Docker --------------------------------------------------------------------------------------

    def _docker(self, *args: str, input: bytes | None = None, timeout: float = 1800):
        done = subprocess.run(
            [self.docker, *args], input=input, capture_output=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`docker {' '.join(args[:3])} ...` failed (exit status {done.returncode}): "
                f"{done.stderr.decode(errors='replace').strip()[-1500:]}"
            )
        return done.stdout.decode(errors="replace").strip()

    def exists(self, image: str) -> bool:
        probe = [self.docker, "image", "inspect", "--format", "{{.Id}}", image]
        return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0

    def image_id(self, image: str) -> str:
        return self._docker("image", "inspect", "--format", "{{.Id}}", image)

    def _commit(self, container: str, image: str, labels: dict[str, str], *changes: str) -> None:
        # The build container's command is not the image's (build steps set no entrypoint).
        args = ["commit", "--change", 'CMD ["/bin/bash"]']
        for change in (*changes, *(f"LABEL {LABEL}{k}={json.dumps(v)}" for k, v in labels.items())):
            args += ["--change", change]
        self._docker(*args, container, image)

    def _run_and_commit(self, source, image, script, labels, *, stdin=None, mounts=(), changes=()):
        """Runs `script` (bash) in a new container of `source` and commits it as `image`."""
        name = f"bpo-build-{os.getpid()}-{time.monotonic_ns()}"
        args = [
            "run",
            "-i" if stdin is not None else "-d",
            "--name",
            name,
            "--network",
            "none",
            "--label",
            CONTAINER_LABEL,
        ]
        for host, inside in mounts:
            args += ["-v", f"{host}:{inside}:ro"]
        try:
            if stdin is None:
                self._docker(*args, source, "bash", "-c", script)
                status = self._docker("wait", name)
                if status != "0":
                    logs = subprocess.run([self.docker, "logs", name], capture_output=True)
                    raise RuntimeError(
                        f"building {image}: the build step exited with status {status}: "
                        f"{(logs.stdout + logs.stderr).decode(errors='replace')[-2000:]}"
                    )
                out = ""
            else:
                out = self._docker(*args, source, "bash", "-c", script, input=stdin)
            self._commit(name, image, labels, *changes)
            return out
        finally:
            subprocess.run([self.docker, "rm", "-f", name], capture_output=True, timeout=120)

    # Layers ----------------------------------------------------------------------------------

    def base_image(self) -> str:
        """Debian `suite` with python3, venv and git, imported from a debootstrap tree."""
        recipe = _sha(self.suite, self.mirror, *_BASE_PACKAGES, _PATH)
        image = f"{self.namespace}/base:{self.suite}-{recipe[:12]}"
        if self.exists(image):
            return image
        if shutil.which("debootstrap") is None:
            raise RuntimeError(
                "Building the base image needs debootstrap (apt-get install debootstrap, or run "
                "scripts/install_docker.sh)."
            )
        start = time.monotonic()
        self.log(f"building {image}: debootstrap {self.suite} (about a minute)")
        root = Path(tempfile.mkdtemp(prefix="bpo-base-", dir="/var/tmp"))
        try:
            done = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={','.join(_BASE_PACKAGES)}",
                 self.suite, str(root / "rootfs"), self.mirror],
                capture_output=True, timeout=1800,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(
                    f"debootstrap failed (exit status {done.returncode}): "
                    f"{(done.stdout + done.stderr).decode(errors='replace')[-2000:]}"
                )
            tar = subprocess.Popen(["tar", "-C", str(root / "rootfs"), "-c", "."],
                                   stdout=subprocess.PIPE)  # fmt: skip
            imported = subprocess.run(
                [self.docker, "import", "--change", f"ENV PATH={_PATH}", "--change",
                 f"LABEL {LABEL}recipe={recipe}", "-", image],
                stdin=tar.stdout, capture_output=True, timeout=1800,
            )  # fmt: skip
            tar.stdout.close()
            if tar.wait() != 0 or imported.returncode != 0:
                raise RuntimeError(f"docker import of the base tree failed: {imported.stderr!r}")
        finally:
            _unmount_below(root)  # debootstrap mounts /proc and /sys inside; an abort leaves them.
            shutil.rmtree(root, ignore_errors=True)
        self.log(f"built {image} in {time.monotonic() - start:.0f} s")
        return image

    def wheels(self, requirements: Sequence[str]) -> Path:
        """The folder of wheels for `requirements` (downloaded once, for the base's Python)."""
        folder = self.cache_dir / "wheels" / _sha(*requirements, "cp311")[:16]
        if (folder / "COMPLETE").is_file():
            return folder
        scratch = Path(tempfile.mkdtemp(prefix=".wheels-", dir=self.cache_dir))
        self.log(f"pip download {' '.join(requirements)}")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
             "--abi", "cp311", "--platform", "manylinux2014_x86_64", "--dest", str(scratch),
             *requirements],
            capture_output=True, timeout=1800,
        )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise RuntimeError(
                f"pip download {' '.join(requirements)} failed: "
                f"{(done.stdout + done.stderr).decode(errors='replace')[-1500:]}"
            )
        (scratch / "COMPLETE").write_text(json.dumps(list(requirements)))
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            scratch.rename(folder)
        except OSError:  # Another process finished the same download first.
            shutil.rmtree(scratch, ignore_errors=True)
        return folder

    def env_image(self, extra: Sequence[str] = ()) -> str:
        """The base plus a venv at /opt/testbed with the requirements (and `extra`, a task's
        test requirements), installed offline."""
        requirements = (*self.requirements, *extra)
        if requirements in self._envs and self.exists(self._envs[requirements]):
            return self._envs[requirements]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        base = self.base_image()
        wheels = self.wheels(requirements)
        digest = hashlib.sha256(self.image_id(base).encode())
        for path in sorted(wheels.glob("*.whl")):
            digest.update(path.name.encode() + hashlib.sha256(path.read_bytes()).digest())
        image = f"{self.namespace}/env:{digest.hexdigest()[:16]}"
        if not self.exists(image):
            start = time.monotonic()
            names = " ".join(f"'{r}'" for r in requirements)
            script = (
                f"set -e; python3 -m venv {ENV_PREFIX}; "
                f"{ENV_PREFIX}/bin/pip install --quiet --no-index --disable-pip-version-check "
                f"--find-links /wheels {names}; {ENV_PREFIX}/bin/python -m pytest --version"
            )
            labels = {"requirements": " ".join(requirements), "harness": "1",
                      "activate": f". {ENV_PREFIX}/bin/activate"}  # fmt: skip
            self._run_and_commit(base, image, script, labels, mounts=[(str(wheels), "/wheels")],
                                 changes=[f"ENV PATH={_PATH}"])  # fmt: skip
            self.log(f"built {image} in {time.monotonic() - start:.0f} s")
        self._envs[requirements] = image
        return image

    def instance_image(self, task: SweTask, tree: str | None = None) -> str:
        """The image of a task: its pristine tree (default `task.tree`) at /testbed, committed."""
        tree = tree or task.tree
        if not tree or not os.path.isdir(tree):
            raise FileNotFoundError(f"Task {task.task_id}: no tree to build an image from.")
        env = self.env_image(task.test_requirements)
        key = _sha(self.image_id(env), tree_hash(tree))[:16]
        image = f"{self.namespace}/sweb.eval.{_slug(task.task_type or task.task_id)}:{key}"
        if self.exists(image):
            return image
        start = time.monotonic()
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as t:
            t.add(tree, arcname=".", filter=_sandbox_owned)
        script = (
            "set -e; mkdir /testbed; tar -x -C /testbed; cd /testbed; "
            f"export GIT_AUTHOR_DATE={_GIT_DATE} GIT_COMMITTER_DATE={_GIT_DATE}; "
            "git init -q -b main; git add -A; git -c user.name=bpo -c user.email=bpo@localhost "
            "commit -q -m base_commit; git rev-parse HEAD; "
            f"chown -R {SANDBOX_UID}:{SANDBOX_UID} /testbed"
        )
        # The commit is known only after the run; label it in a second, instant commit.
        scratch = f"{image}-scratch"
        commit = self._run_and_commit(env, scratch, script, {}, stdin=archive.getvalue())
        commit = commit.splitlines()[-1].strip()
        try:
            name = f"bpo-label-{os.getpid()}-{time.monotonic_ns()}"
            self._docker("create", "--name", name, "--label", CONTAINER_LABEL, scratch)
            try:
                self._commit(name, image, {"base_commit": commit, "task_type": task.task_type,
                                           "uid": str(SANDBOX_UID)},
                             "WORKDIR /testbed")  # fmt: skip
            finally:
                subprocess.run([self.docker, "rm", "-f", name], capture_output=True)
        finally:
            subprocess.run([self.docker, "rmi", scratch], capture_output=True)
        self.log(f"built {image} ({task.task_type} at {commit[:12]}) in "
                 f"{time.monotonic() - start:.1f} s")  # fmt: skip
        return image

    def for_tasks(self, tasks: Sequence[SweTask]) -> list[SweTask]:
        """The tasks with `image` set to their instance images (one per distinct tree)."""
        images: dict[tuple, str] = {}
        out = []
        for task in tasks:
            key = (task.tree, task.test_requirements)
            if key not in images:
                images[key] = self.instance_image(task)
            out.append(dataclasses.replace(task, image=images[key]))
        return out


def _unmount_below(root: Path) -> None:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name.lower())[:64]


def _sandbox_owned(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in info.name.split("/"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def main(argv: Sequence[str] | None = None) -> None:
    from envs.swe.data import load_tasks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-root", default=None, help="the built tasks (default: as load_tasks)"
    )
    parser.add_argument("--docker", default="docker")
    args = parser.parse_args(argv)
    builder = ImageBuilder(args.docker, log=print)
    for task in builder.for_tasks(load_tasks(args.data_root, "all")):
        print(f"{task.task_id}\t{task.image}")


if __name__ == "__main__":
    main()
