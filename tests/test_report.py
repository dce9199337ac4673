"""What the main job ends with: RL's effect on the evaluation games with a paired interval and
test, its compute, `curves.png`, and the RL bar's postfix."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bpo_jax import report
from bpo_jax.io.metrics import MetricWriter
from bpo_jax.study.stats import wilson_ci
from bpo_jax.train import rl_postfix


def _evals(wins, ids=None):
    ids = ids or [f"game{i}" for i in range(len(wins))]
    return {
        "eval/success": float(np.mean(wins)),
        "eval/episodes": list(wins),
        "eval/task_ids": ids,
        "eval/num_episodes": len(wins),
    }


def test_paired_effect_by_hand():
    """Six games: two won both times, one lost both times, three newly won, one lost."""
    before = _evals([1, 1, 0, 0, 1, 0, 0])
    # The same games in another order: pairs are matched by game, not position.
    after_wins = dict(zip(before["eval/task_ids"], [1, 0, 1, 1, 1, 1, 0], strict=True))
    ids = list(reversed(before["eval/task_ids"]))
    e = report.paired_effect(before, _evals([after_wins[t] for t in ids], ids))
    assert (e["n"], e["gained"], e["lost"]) == (7, 3, 1)
    assert e["before"] == pytest.approx(3 / 7) and e["after"] == pytest.approx(5 / 7)
    assert e["diff"] == pytest.approx(2 / 7)
    assert e["p_value"] == pytest.approx(0.625)  # Exact McNemar: 2 * P(X >= 3), X ~ B(4, 1/2).
    assert e["before_ci"] == pytest.approx(wilson_ci(3, 7))
    lo, hi = e["diff_ci"]
    assert lo < 0 < hi and not e["significant"]  # Four changed games: noise.


def test_a_large_paired_effect_is_significant_and_no_change_is_not():
    e = report.paired_effect(_evals([0] * 24), _evals([1] * 12 + [0] * 12))
    assert e["p_value"] == pytest.approx(2 * 0.5**12)
    assert e["diff"] == 0.5 and e["diff_ci"][0] > 0 and e["significant"]
    same = report.paired_effect(_evals([1, 0, 1]), _evals([1, 0, 1]))
    assert same["diff_ci"] == (0.0, 0.0) and same["p_value"] == 1.0 and not same["significant"]
    assert report.paired_effect(_evals([1, 0]), _evals([1, 0], ["x", "y"])) is None
    # Five games lost, none won: the bootstrap's interval excludes 0, McNemar's p is 0.0625.
    lost = report.paired_effect(_evals([1] * 5 + [0] * 19), _evals([0] * 24))
    assert lost["diff_ci"][1] < 0 and lost["p_value"] == pytest.approx(0.0625)
    assert not lost["significant"]


def _summary(effect, iterations=6):
    return {
        "eval_tasks": effect["n"] if effect else 24,
        "eval_split": "train",
        "success_initial": 0.0,
        "success_before_rl": effect["before"] if effect else 0.5,
        "success_after_rl": effect["after"] if effect else 0.5,
        "iterations": iterations,
        "rl_effect": effect,
        "rl_spend": {
            "iterations": iterations,
            "generated_tokens": 8506,
            "env_steps": 1039,
            "rl_seconds": 414.0,
            "spend_ratio": 0.99,
            "spend_ratio_range": (0.9, 1.1),
        },
        "figure": "/runs/x/curves.png",
    }


def test_final_lines_say_when_the_difference_is_noise():
    noise = report.paired_effect(_evals([1] * 10 + [0] * 14), _evals([1] * 9 + [0] * 15))
    lines = report.final_lines(_summary(noise))
    assert lines[0].startswith("Evaluation success (greedy, 24 train tasks): initial 0.000 |")
    assert "before RL 0.417 (95% CI 0.24-0.61) | after RL 0.375 (95% CI 0.21-0.57)" in lines[0]
    assert "RL's effect: -0.042" in lines[1] and "0 newly won, 1 lost" in lines[1]
    assert "within noise" in lines[1]
    assert "spend / budget 0.99 per batch (range 0.90-1.10" in lines[2]
    assert lines[3] == "Figure: /runs/x/curves.png"
    helped = report.paired_effect(_evals([0] * 24), _evals([1] * 12 + [0] * 12))
    assert "RL helped." in report.final_lines(_summary(helped))[1]
    assert report.final_lines(_summary(None))[0].endswith("before RL 0.500 | after RL 0.500")


def test_curves_and_spend_from_a_run_s_records(tmp_path):
    with MetricWriter(tmp_path, use_tensorboard=False) as writer:
        for it, success in enumerate([0.0, 0.25, 0.5], start=1):
            record = {"train/iteration": it, "train/success": success, "train/return": success}
            record |= {"compute/generated_tokens": 100, "compute/env_steps": 10}
            record |= {"compute/spend_ratio": 0.9 + 0.1 * it, "train/iteration_seconds": 60.0}
            writer.write(it, record)
        writer.write(2, {"train/iteration": 2, "train/success": 0.3})  # A resumed iteration.
    evals = {"before_rl": _evals([1, 0, 0, 0]), "after_rl": _evals([1, 1, 0, 0])}
    out = report.summarise(_CFG, tmp_path, evals)
    assert out["rl_spend"]["iterations"] == 3
    assert out["rl_spend"]["spend_ratio_range"] == pytest.approx((1.0, 1.2))
    assert [r["train/success"] for r in report.rl_records(tmp_path)] == [0.0, 0.3, 0.5]
    assert out["figure"] == str(tmp_path / report.FIGURE)
    assert (tmp_path / report.FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["rl_effect"]["gained"] == 1
    json.dumps(out)  # summary.json holds it.


# The fields the figure's title reads.
_CFG = SimpleNamespace(
    seed=0,
    train=SimpleNamespace(algo="bpo", iterations=3, tasks_per_iter=4, group_size=4, lr=5e-5),
    env=SimpleNamespace(name="alfworld"),
    model=SimpleNamespace(preset="tiny"),
)


def test_rl_bar_postfix():
    metrics = {
        "train/success": 0.25,
        "compute/spend_ratio": 1.04,
        "train/branch_points": 4,
        "train/rollout_seconds": 19.2,
        "train/update_seconds": 73.0,
    }
    assert rl_postfix(metrics) == (
        "success 0.25 | spend/budget 1.04 | branch points 4 | rollout 19s, update 73s"
    )
    independent = {k: v for k, v in metrics.items() if k != "compute/spend_ratio"}
    assert rl_postfix({**independent, "train/branch_points": 0}).startswith("success 0.25 | roll")
