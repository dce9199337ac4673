"""Set-up the tests share: subprocesses (a script that reports one RESULT line, processes run side
by side as the hosts of one job) and the small models most tests train."""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_together(
    commands: Sequence[Sequence[str]], *, timeout: float
) -> tuple[list[subprocess.Popen], list[str]]:
    """Runs the commands side by side in the repository (with `repo_env()`), to the end.

    Returns:
        The processes (each has exited) and their outputs, stdout and stderr merged. On the way
        out (a timeout included) a process still running is killed.
    """
    procs = [
        subprocess.Popen(
            list(command),
            cwd=REPO,
            env=repo_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs


def run_script_result(script: str, *, timeout: float):
    """Runs `python -c script` on the CPU platform; returns the JSON of the one line it prints
    that starts with "RESULT " (the test fails if it exits non-zero or prints no such line or
    several)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    return json.loads(lines[0][len("RESULT ") :])
