"""The Docker executor: SWE-bench (Verified) instances in their official evaluation images.

Each SWE-bench instance has an image with its repository at `base_commit` in `/testbed` and a
conda env `testbed` with its dependencies (`swebench/sweb.eval.x86_64.<id>:latest` on Docker
Hub, or the images `python -m swebench.harness.prepare_images` builds). The executor keeps the
env's design: the working copy is the image's `/testbed` (copied out once per image, read by
the file tools) plus the in-memory edits, and every command runs in a fresh container
(`docker run --rm --network none` with memory, CPU and process limits) that receives the edits
as a tar on stdin. Containers never outlive a step, so sandboxes still fork by `os.fork()`.

Grading (`envs.swe.grading.grade_in_docker`) runs as SWE-bench's harness does: pytest with the
repository's own options and the image's plugins (autoload on, as upstream), plus the report
plugin; django and sympy with upstream's test command on the files `test_patch` touches, their
outcomes read from the log (`envs.swe.swebench`). Limits of this executor: file changes made by
`run COMMAND` are not brought back (edit with the tools), and the report plugin and the code
under test share a process (the jail's signed harness is not used here).

This machine has no Docker: constructing the executor raises `DockerUnavailableError` saying so.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from envs.swe.jail import JailResult, Limits

__all__ = ["DockerExecutor", "DockerUnavailableError", "check_docker"]

_PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_report.py")
_MARK = "@@BPO-SWE"
_HOW = (
    "To run SWE-bench instances: on a Linux machine with Docker (`docker info` works for your "
    "user), pull the instance images (docker pull swebench/sweb.eval.x86_64.<id>:latest, or "
    "build them with `python -m swebench.harness.prepare_images`), then use "
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
        memory_mb: Container memory limit.
        cpus: Container CPU limit.
        pids: Container process limit.
        activate: Shell line that activates the image's Python environment.
    """

    def __init__(
        self,
        docker: str = "docker",
        cache_dir: str = "~/.cache/bpo_jax/swe-docker",
        pull: bool = True,
        memory_mb: int = 4096,
        cpus: float = 1.0,
        pids: int = 512,
        activate: str = "source /opt/miniconda3/bin/activate && conda activate testbed",
    ):
        self.docker = check_docker(docker)
        self.cache_dir = Path(cache_dir).expanduser()
        self.pull = pull
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.pids = pids
        self.activate = activate

    def _docker(self, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([self.docker, *args], capture_output=True, timeout=timeout, **kwargs)

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

    def prepare(self, task) -> str:
        """The local copy of the task image's /testbed (the workspace's base tree)."""
        if not task.image:
            raise ValueError(f"Task {task.task_id} names no Docker image.")
        dest = self.cache_dir / hashlib.sha1(task.image.encode()).hexdigest()[:16] / "testbed"
        if dest.is_dir():
            return str(dest)
        self._ensure_image(task.image)
        created = self._docker("create", task.image)
        if created.returncode != 0:
            raise RuntimeError(f"`docker create {task.image}` failed: {created.stderr.decode()}")
        cid = created.stdout.decode().strip()
        scratch = Path(tempfile.mkdtemp(prefix=".testbed-", dir=dest.parent.parent))
        try:
            copy = self._docker("cp", f"{cid}:/testbed", "-", timeout=3600)
            if copy.returncode != 0:
                raise RuntimeError(f"`docker cp {cid}:/testbed -` failed: {copy.stderr.decode()}")
            with tarfile.open(fileobj=io.BytesIO(copy.stdout)) as t:
                t.extractall(scratch, filter="data")
            dest.parent.mkdir(parents=True, exist_ok=True)
            (scratch / "testbed").rename(dest)
        finally:
            self._docker("rm", "-f", cid)
            shutil.rmtree(scratch, ignore_errors=True)
        return str(dest)

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
        """Runs `argv` in /testbed of a fresh container with `files` applied."""
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as t:
            for rel, content in sorted(files.items()):
                if content is not None:
                    info = tarfile.TarInfo(f"testbed/{rel}")
                    info.size = len(content)
                    t.addfile(info, io.BytesIO(content))
            if pytest_report:
                with open(_PLUGIN, "rb") as f:
                    plugin = f.read()
                info = tarfile.TarInfo("tmp/.plugin/bpo_swe_report.py")
                info.size = len(plugin)
                t.addfile(info, io.BytesIO(plugin))
        deleted = " ".join(shlex.quote(f"/testbed/{p}") for p, c in files.items() if c is None)
        keep = int(limits.output_chars)
        script = "\n".join(
            [
                "tar -x -C / || exit 90",
                f"rm -f -- {deleted}" if deleted else ":",
                "mkdir -p /tmp/.report && cd /testbed",
                f"{self.activate} >/dev/null 2>&1 || true",
                'export PYTHONPATH="/tmp/.plugin:${PYTHONPATH}"',
                f'timeout -s KILL {limits.timeout_s:g} "$@" > /tmp/.out 2>&1; status=$?',
                f"size=$(wc -c < /tmp/.out); head -c {keep} /tmp/.out",
                f'echo; echo "{_MARK} $status $size"',
                "cat /tmp/.report/report.jsonl 2>/dev/null || true",
            ]
        )
        command = [
            self.docker, "run", "--rm", "-i", "--network", "none",
            "--memory", f"{self.memory_mb}m", "--cpus", str(self.cpus),
            "--pids-limit", str(self.pids),
            "--ulimit", f"fsize={limits.file_mb << 20}",
            "-e", "BPO_SWE_REPORT=/tmp/.report/report.jsonl",
            "-e", "PYTHONHASHSEED=0",
            "--entrypoint", "bash", task.image, "-c", script, "bash", *argv,
        ]  # fmt: skip
        for key, value in env.items():
            if key != "PYTHONPATH":  # Jail paths; the image's own layout applies.
                command[3:3] = ["-e", f"{key}={value}"]
        try:
            done = subprocess.run(
                command, input=archive.getvalue(), capture_output=True,
                timeout=limits.timeout_s + 120,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return JailResult(error=f"the container did not finish in {limits.timeout_s + 120} s")
        out = done.stdout.decode("utf-8", "replace")
        if _MARK not in out:
            return JailResult(error=f"docker run failed: {done.stderr.decode()[-800:]}")
        output, _, rest = out.rpartition(f"\n{_MARK} ")
        status_line, _, report_text = rest.partition("\n")
        status, size = (status_line.split() + ["0", "0"])[:2]
        report = []
        for line in report_text.splitlines():
            try:
                report.append(json.loads(line))
            except ValueError:
                continue
        code = int(status) if status.lstrip("-").isdigit() else None
        return JailResult(
            exit_code=None if code == 137 else code,
            signal="SIGKILL" if code == 137 else None,
            timed_out=code == 137,
            output=output,
            output_bytes=int(size) if size.isdigit() else len(output),
            ignored=["(the Docker executor does not bring back file changes of commands)"]
            if capture
            else [],
            report=report if pytest_report else None,
        )
