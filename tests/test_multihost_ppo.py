"""PPO on several hosts: two JAX processes (gloo over 127.0.0.1, 2 CPU devices each) against one
process with 4 devices, on the tiny ALFWorld config (`tests/multihost_worker.py`).

PPO is the one algorithm with a second model, the critic (a value head on the policy's
features, `bpo_jax.learner.critic`): its features are computed by a program over the global mesh,
whose
parameters live on both hosts, and its head is fitted on every host. Both runs split every batch
of tasks into the same two shares, so their rollouts, values, advantages and updates, and hence
the policy's and the critic's parameters, must agree.
"""

import json
import time

import numpy as np
import pytest
from test_multihost import _final_state, _run_one, _run_two

PPO = [
    "--config.train.algo=ppo",
    "--config.eval.initial=False",  # The BPO test covers evaluations: only the final one here.
]


def _max_diff(a: dict, b: dict, part: str) -> float:
    keys = [k for k in a if k.startswith(part)]
    assert keys, (part, sorted(a))
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in keys)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # Two runs, mostly compiling: minutes each on 2 busy cores.
def test_ppo_two_processes_match_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    t0 = time.time()
    _run_two(two, PPO)
    t_two = time.time() - t0
    t0 = time.time()
    _run_one(one, PPO)
    t_one = time.time() - t0

    s2, s1 = _final_state(two), _final_state(one)
    assert s2.keys() == s1.keys()
    policy = _max_diff(s2, s1, "['train_state']['params']")
    head = _max_diff(s2, s1, "['critic']['head']")
    critic_opt = _max_diff(s2, s1, "['critic']['opt_state']")
    print(
        f"two processes {t_two:.0f}s, one process {t_one:.0f}s, max |diff|: policy {policy:.2e}, "
        f"critic head {head:.2e}, critic optimizer {critic_opt:.2e}"
    )
    assert policy <= 1e-5
    assert head <= 1e-5 and critic_opt <= 1e-5

    # The critic was fitted (its output layer starts at 0) and the policy was updated.
    assert np.any(s1["['critic']['head']['w2_h']"] != 0)
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in records if "train/iteration" in r]
    assert [r["train/iteration"] for r in iters] == [1, 2]
    assert any(r["train/grad_norm_mean"] > 0 for r in iters), iters
    assert all("train/value_loss" in r for r in iters), iters
