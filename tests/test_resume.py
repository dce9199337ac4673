"""Kill a training run mid-way, restart it, and it continues from the saved step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _iterations_logged(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # A line cut by the kill.
        if "train/iteration" in rec:
            out.append(rec["train/iteration"])
    return out


def _command(workdir):
    return [
        sys.executable,
        "-m",
        "bpo_jax.main",
        "--config=experiments/alfworld.py:cpu",
        f"--workdir={workdir}",
        "--config.env.num_train_tasks=2",
        "--config.env.max_steps=3",
        "--config.eval.num_tasks=1",
        "--config.bc.steps=3",
        "--config.bc.batch_size=8",
        "--config.train.iterations=4",
        "--config.train.tasks_per_iter=1",
        "--config.train.group_size=2",
        "--config.train.minibatch_size=8",
        "--config.agent.max_prompt_tokens=192",
        "--config.model.max_seq_len=256",
        "--config.checkpoint.every=1",
    ]


@pytest.mark.slow
def test_kill_and_resume(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ)
    proc = subprocess.Popen(
        _command(workdir),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            ckpts = workdir / "checkpoints"
            if 2 in _iterations_logged(workdir) and ckpts.exists():
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stdout.read()}"
        os.killpg(proc.pid, signal.SIGKILL)  # No chance to clean up, as in a preemption.
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = _iterations_logged(workdir)
    assert max(before) >= 2 and max(before) < 4

    out = subprocess.run(
        _command(workdir), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = [
        line for line in (out.stdout + out.stderr).splitlines() if "Resumed from checkpoint" in line
    ]
    assert resumed, out.stdout[-2000:]
    resumed_iter = int(resumed[0].split("RL iteration ")[1].rstrip(").").split(")")[0])
    # Checkpoints are written every iteration (asynchronously, so the kill may beat the last).
    assert 1 <= resumed_iter <= max(before)
    after = _iterations_logged(workdir)[len(before) :]
    assert after == list(range(resumed_iter + 1, 5))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["iterations"] == 4
