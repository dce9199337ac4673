"""The Docker executor: an env's commands in fresh containers of the task's SWE-bench-style image.

Images: SWE-bench (Verified) instances use their official evaluation images
(`swebench/sweb.eval.x86_64.<id>:latest` on Docker Hub, or those `python -m
swebench.harness.prepare_images` builds): the repository at `base_commit` in `/testbed`, a conda
env `testbed`. The project's own tasks (a pristine `tree`, no image) get a local image in the
same layout from `envs.swe.images.ImageBuilder`, built on first use and cached. Either runs
without history after `base_commit` (`envs.swe.history`: a repository holding more gets a fresh
single-commit one, once per image, before the episode's first command).

The env's design is kept: the working copy is the image's `/testbed` (copied out once per
image, `.git` left out, read by the file tools) plus the in-memory edits, and every command runs
in a fresh container, `docker run --rm --network none` with the executor's memory, CPU and
process limits and the command's `Limits` as rlimits (file size, CPU time, open files), a
tmpfs `/tmp` of `tmpfs_mb` and a wall-clock timeout. The container gets the edits as a tar on
stdin and sends back a tar (exit status, output, the pytest report plugin's records, and with
`capture` the files the command created, changed or deleted; `envs.swe.container`). No
container outlives a call, so sandboxes still fork by `os.fork()` and CRIU has nothing outside
the worker to copy.

Grading (`envs.swe.grading.grade_in_docker`): in an image whose Python can run it (the local
images) pytest runs under the signed grading harness (`envs.swe.harness`), as in the local jail:
records signed with a per-run key that exists only in the harness process (given on a file
descriptor, its path unlinked first), written to an inherited descriptor that is the
container's stderr, and the command runs as the image's unprivileged uid, which owns
`/testbed` and nothing else. The official images (Python 3.6-3.9, run as root as upstream runs
them) keep upstream's way: pytest with the report plugin in the process, django and sympy with
upstream's test command, read from the log (`envs.swe.swebench`).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.swe import container
from envs.swe.history import scrubbed
from envs.swe.images import CONTAINER_LABEL, LABEL, ImageBuilder
from envs.swe.jail import (
    GUARD,
    JAIL_ROOT,
    JailResult,
    Limits,
    harness_args,
    verify_harness_report,
)

__all__ = ["DOCKER_ROOT", "DockerExecutor", "DockerUnavailableError", "check_docker"]

DOCKER_ROOT = "/testbed"  # Where the repository is in a SWE-bench image.
_HERE = os.path.dirname(os.path.abspath(__file__))
_HARNESS = os.path.join(_HERE, "harness.py")  # The grading harness and the report plugin.
_SLACK_S = 120.0  # Container start and teardown on top of the command's timeout.
_HOW = (
    "To run SWE-bench instances: on a Linux machine with Docker (`docker info` works for your "
    "user; `sudo bash scripts/install_docker.sh` installs and starts it on Debian), pull the "
    "instance images (docker pull swebench/sweb.eval.x86_64.<id>:latest, or build them with "
    "`python -m swebench.harness.prepare_images`), then use "
    "--config.env.task_options.source=swebench --config.env.data_root=verified.jsonl "
    "--config.env.env_options.executor=docker."
)


class DockerUnavailableError(RuntimeError):
    """Docker cannot be used here; the message says why and how to run SWE-bench instead."""


def check_docker(docker: str = "docker") -> str:
    """The path of a working Docker CLI whose daemon answers.

    Raises:
        DockerUnavailableError: If the CLI is missing or the daemon does not answer.
    """
    path = shutil.which(docker)
    if path is None:
        raise DockerUnavailableError(
            f"executor='docker' needs the Docker CLI, but {docker!r} is not on PATH: this "
            "machine has no Docker, so SWE-bench instances cannot run here (the synthetic "
            f"tasks run with executor='jail'). {_HOW}"
        )
    try:
        result = subprocess.run(
            [path, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DockerUnavailableError(f"`{path} info` failed: {e}. {_HOW}") from e
    if result.returncode != 0:
        raise DockerUnavailableError(
            f"The Docker daemon does not answer (`{path} info` exit status {result.returncode}: "
            f"{(result.stderr or result.stdout).strip()[-500:]}). {_HOW}"
        )
    return path


class DockerExecutor:
    """Runs an env's commands in fresh containers of the task's image; see the module docstring.

    Args:
        docker: The Docker CLI.
        cache_dir: Where each image's /testbed is copied out (once) for the file tools.
        pull: Pull an image that is not present.
        memory_mb: Container memory limit (memory and swap together), MiB.
        cpus: Container CPU limit (cores).
        pids: Container process and thread limit.
        activate: Shell line that activates the image's Python environment (default: the
            image's `org.bpo.swe.activate` label, else SWE-bench's conda env `testbed`).
        build_images: Build the local image of a task that has a tree but names no image.
        images: Options of that builder (`envs.swe.images.ImageBuilder`).
        scrub_history: Run each image with its repository reduced to what `base_commit`
            reaches (`envs.swe.history`: once per image; on by default).
    """

    root = DOCKER_ROOT

    def __init__(
        self,
        docker: str = "docker",
        cache_dir: str = "~/.cache/bpo_jax/swe-docker",
        pull: bool = True,
        memory_mb: int = 4096,
        cpus: float = 1.0,
        pids: int = 512,
        activate: str | None = None,
        build_images: bool = True,
        images: Mapping[str, Any] | None = None,
        scrub_history: bool = True,
    ):
        self.docker = check_docker(docker)
        self.cache_dir = Path(cache_dir).expanduser()
        self.pull = pull
        self.memory_mb = int(memory_mb)
        self.cpus = float(cpus)
        self.pids = int(pids)
        self.activate = activate
        self.build_images = build_images
        self._builder_options = dict(images or {})
        self.scrub_history = scrub_history
        self._history_free: dict[tuple[str, str], str] = {}  # (image, base) -> image to run
        self._builder: ImageBuilder | None = None
        self._images: dict[str, str] = {}  # task id -> image (built ones)
        self._labels: dict[str, dict[str, str]] = {}
        self._bases: dict[str, str] = {}  # image -> its copied-out /testbed

    def _docker(self, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([self.docker, *args], capture_output=True, timeout=timeout, **kwargs)

    # Images --------------------------------------------------------------------------------------

    @property
    def builder(self) -> ImageBuilder:
        if self._builder is None:
            self._builder = ImageBuilder(self.docker, **self._builder_options)
        return self._builder

    def image_of(self, task) -> str:
        """The image the task's commands run in: the one it names, else its local image (built
        if missing), without history after `base_commit` (`envs.swe.history`)."""
        image = task.image
        if not image:
            if task.task_id not in self._images:
                if not (task.tree and self.build_images):
                    raise ValueError(
                        f"Task {task.task_id} names no Docker image and has no tree to build "
                        "one from (or build_images=False)."
                    )
                self._images[task.task_id] = self.builder.instance_image(task)
            image = self._images[task.task_id]
        if not self.scrub_history:
            return image
        key = (image, task.base_commit)
        if key not in self._history_free:
            self._ensure_image(image)
            self._history_free[key] = scrubbed(self.docker, image, task.base_commit,
                                               self.cache_dir, CONTAINER_LABEL)  # fmt: skip
        return self._history_free[key]

    def _ensure_image(self, image: str) -> None:
        if self._docker("image", "inspect", image).returncode == 0:
            return
        if not self.pull:
            raise DockerUnavailableError(f"Image {image} is not present and pull=False. {_HOW}")
        result = self._docker("pull", image, timeout=3600)
        if result.returncode != 0:
            raise DockerUnavailableError(
                f"`docker pull {image}` failed: {result.stderr.decode()[-500:]}. {_HOW}"
            )

    def labels(self, image: str) -> dict[str, str]:
        """The image's id (key "id") and its `org.bpo.swe.*` labels, without the prefix."""
        if image not in self._labels:
            self._ensure_image(image)
            done = self._docker("image", "inspect", "--format",
                                "{{.Id}} {{json .Config.Labels}}", image)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"`docker image inspect {image}` failed: {done.stderr!r}")
            image_id, _, text = done.stdout.decode().strip().partition(" ")
            raw = json.loads(text) if text and text != "null" else {}
            found = {k[len(LABEL) :]: json.loads(v) if v.startswith('"') else v
                     for k, v in (raw or {}).items() if k.startswith(LABEL)}  # fmt: skip
            self._labels[image] = {"id": image_id, **found}
        return self._labels[image]

    def supports_harness(self, task) -> bool:
        """Whether the task's image runs the signed grading harness (its Python is >= 3.11)."""
        return self.labels(self.image_of(task)).get("harness") == "1"

    def prepare(self, task) -> str:
        """The local copy of the task image's /testbed (the workspace's base tree)."""
        image = self.image_of(task)
        image_id = self.labels(image)["id"]
        dest = self.cache_dir / image_id.replace("sha256:", "")[:16] / "testbed"
        self._bases[image] = str(dest)
        if dest.is_dir():
            return str(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".testbed-", dir=dest.parent))
        try:
            copy = self._docker("run", "--rm", "--network", "none", "--label", CONTAINER_LABEL,
                                "--entrypoint", "tar", image,
                                "-c", "-C", DOCKER_ROOT, "--exclude=./.git", ".",
                                timeout=3600)  # fmt: skip
            if copy.returncode != 0:
                raise RuntimeError(f"Copying /testbed out of {image} failed: {copy.stderr!r}")
            with tarfile.open(fileobj=io.BytesIO(copy.stdout)) as t:
                t.extractall(scratch / "testbed", filter="data")
            try:
                (scratch / "testbed").rename(dest)
            except OSError:  # Another worker copied it first.
                pass
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return str(dest)

    # Commands ------------------------------------------------------------------------------------

    def run(
        self,
        task,
        files: Mapping[str, bytes | None],
        argv: Sequence[str],
        *,
        limits: Limits,
        env: Mapping[str, str],
        capture: bool = False,
        pytest_report: bool = False,
    ) -> JailResult:
        """Runs `argv` in /testbed of a fresh container with `files` applied.

        `env` is as for the jail: a PYTHONPATH of jail paths is moved to /testbed in the local
        images and dropped in the official ones (their env has the repository installed).
        """
        image = self.image_of(task)
        labels = self.labels(image)
        environ = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if labels.get("uid") and env.get("PYTHONPATH"):
            environ["PYTHONPATH"] = env["PYTHONPATH"].replace(JAIL_ROOT, DOCKER_ROOT)
        extra = {}
        if pytest_report:
            with open(_HARNESS, "rb") as f:
                extra[f"{container.RUN}/plugin/bpo_swe_report.py"] = f.read()
            environ["PYTHONPATH"] = ":".join(
                p for p in (f"{container.RUN}/plugin", environ.get("PYTHONPATH", "")) if p
            )
            environ["BPO_SWE_REPORT"] = "/tmp/.report/report.jsonl"
        launch = (
            f"( {container.ulimits(limits)}; exec timeout -s KILL {limits.timeout_s:g} "
            f'{container.drop_privileges(labels)} "$@" < /dev/null )'
        )
        result, _ = self._container(image, labels, files, extra, launch, argv, limits, environ,
                                    capture)  # fmt: skip
        if not pytest_report:
            result.report = None
        return result

    def run_harness(
        self,
        task,
        files: Mapping[str, bytes | None],
        pytest_args: Sequence[str],
        *,
        limits: Limits,
        pythonpath: Sequence[str] = (),
        agent_files: Sequence[str] = (),
        agent_defs: Sequence[str] = (),
        python: str = "python",
    ) -> JailResult:
        """pytest under the signed grading harness in a fresh container (as `jail.run_harness`).

        `pythonpath`, `agent_files` and `agent_defs` name container paths (under /testbed).

        Raises:
            ValueError: If the task's image cannot run the harness (`supports_harness`).
        """
        image = self.image_of(task)
        labels = self.labels(image)
        if labels.get("harness") != "1":
            raise ValueError(f"{image} cannot run the grading harness (needs Python >= 3.11).")
        key = secrets.token_hex(32)
        with open(_HARNESS, "rb") as f, open(GUARD, "rb") as g:
            extra = {
                f"{container.RUN}/harness.py": f.read(),
                f"{container.RUN}/{os.path.basename(GUARD)}": g.read(),
                f"{container.RUN}/key": (key + "\n").encode(),
            }
        # The subshell opens the key as the harness's stdin and unlinks it before the harness
        # starts; fd 3 is the container's stderr, which carries only signed records.
        launch = (
            f"( rm -f {container.RUN}/key; {container.ulimits(limits)}; "
            f"exec timeout -s KILL {limits.timeout_s:g} {container.drop_privileges(labels)} "
            f'{python} -P -s -B {container.RUN}/harness.py "$@" ) < {container.RUN}/key 3>&2'
        )
        argv = harness_args(3, pytest_args, pythonpath, agent_files, agent_defs)
        result, stderr = self._container(image, labels, files, extra, launch, argv, limits, {},
                                         False)  # fmt: skip
        if not result.error:
            lines = stderr.decode("utf-8", "replace").splitlines()
            result.report, result.harness_end = verify_harness_report(lines, key)
        return result

    def _container(self, image, labels, files, extra, launch, argv, limits, environ, capture):
        """(result, the container's stderr) of one command; see `envs.swe.container`."""
        uid = int(labels.get("uid") or 0)
        archive = container.request_archive(files, extra, self._bases.get(image), uid)
        script = container.script(launch, self._activate(labels), limits, uid, capture)
        command = [
            self.docker, "run", "--rm", "-i", "--network", "none", "--label", CONTAINER_LABEL,
            "--memory", f"{self.memory_mb}m", "--memory-swap", f"{self.memory_mb}m",
            "--cpus", f"{self.cpus:g}", "--pids-limit", str(self.pids),
            "--tmpfs", f"/tmp:rw,exec,size={limits.tmpfs_mb}m",
            "-e", "HOME=/tmp/home", "-e", "PYTHONHASHSEED=0", "-e", "PYTHONDONTWRITEBYTECODE=1",
            "-e", "PYTHONUNBUFFERED=1", "-e", "LANG=C.UTF-8",
        ]  # fmt: skip
        for key, value in environ.items():
            command += ["-e", f"{key}={value}"]
        command += ["--entrypoint", "bash", image, "-c", script, "bash", *argv]
        start = time.monotonic()
        try:
            done = subprocess.run(command, input=archive, capture_output=True,
                                  timeout=limits.timeout_s + _SLACK_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            return JailResult(
                error=f"the container did not finish in {limits.timeout_s + _SLACK_S:.0f} s"
            ), b""
        return container.read_reply(done, limits, capture, start), done.stderr

    def _activate(self, labels: Mapping[str, str]) -> str:
        if self.activate is not None:
            return self.activate or ":"
        return labels.get(
            "activate", "source /opt/miniconda3/bin/activate && conda activate testbed"
        )
