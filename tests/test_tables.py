"""The tables command on synthetic run records whose numbers are computed by hand below."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from bpo_jax.study import stats, tables

REPO = Path(__file__).resolve().parents[1]
BC_STEPS = 10  # RL starts at update step 10; two updates per iteration.
TASKS_PER_ITER = 2

# Final successes per seed, as wins out of 8 episodes (4 on valid_seen, 4 on valid_unseen).
WINS = {
    "bpo": [6, 5, 7, 4],  # 0.75, 0.625, 0.875, 0.5: mean 22/32 = 0.6875
    "grpo": [4, 5, 5, 3],  # 0.5, 0.625, 0.625, 0.375: mean 17/32 = 0.53125
    "rloo": [6, 3, 8, 5],  # 0.75, 0.375, 1.0, 0.625: mean 22/32 = 0.6875
}
# Mean success at iter_2 (every seed, both splits): BPO reaches RLOO's final 0.6875 there.
ITER2 = {"bpo": 0.6875, "grpo": 0.5, "rloo": 0.5}
TOKENS = {"bpo": 90, "grpo": 100, "rloo": 100}  # Generated tokens per iteration (2 tasks).


def episodes(wins: int) -> tuple[list[int], list[int]]:
    """8 episodes with `wins` ones, split 4 / 4 between the two splits."""
    eps = [1] * wins + [0] * (8 - wins)
    return eps[0::2], eps[1::2]


def write_run(
    run_dir: Path, algo: str, seed: int, wins: int, *, per_split=True, probe=None, steps=True
):
    run_dir.mkdir(parents=True)
    config = {
        "seed": seed,
        "env": {"name": "alfworld", "eval_split": "valid_unseen"},
        "train": {"algo": algo, "iterations": 4, "tasks_per_iter": TASKS_PER_ITER},
        "bc": {"steps": BC_STEPS},
    }
    seen, unseen = episodes(wins)
    evals, metrics = {}, [{"step": BC_STEPS, "eval_before_rl/success": 0.25}]
    if per_split:
        for split, eps in (("valid_seen", seen), ("valid_unseen", unseen)):
            evals[f"before_rl/{split}"] = {"eval/success": 0.25, "eval/num_episodes": 4}
            evals[f"iter_2/{split}"] = {"eval/success": ITER2[algo], "eval/num_episodes": 4}
            evals[f"after_rl/{split}"] = {
                "eval/success": float(np.mean(eps)),
                "eval/num_episodes": 4,
                "eval/episodes": eps,
            }
    else:  # Today's record: one evaluation per point, success means only.
        evals["before_rl"] = {"eval/success": 0.25, "eval/num_episodes": 8}
        evals["after_rl"] = {"eval/success": wins / 8, "eval/num_episodes": 8}
    for it in range(1, 5):
        step = BC_STEPS + 2 * it
        for k, g in enumerate((1.0 + it + seed, 2.0 + it)):
            metrics.append({"step": step - 1 + k, "update/grad_norm": g})
        metrics.append(
            {
                "step": step,
                "train/iteration": it,
                "compute/generated_tokens": TOKENS[algo],
                "compute/task_cost_mean": TOKENS[algo] / TASKS_PER_ITER,
                "train/budget_per_task": 50.0,
                "train/branch_points": 3 if algo == "bpo" else 0,
                # Where BPO's 3 branch points were: two at step 0, one at step 3.
                **(
                    {"train/branch_step/0": 2, "train/branch_step/3": 1}
                    if steps and algo == "bpo"
                    else {}
                ),
            }
        )
    summary = {
        "eval_split": "valid_unseen",
        "eval_tasks": 8,
        "success_after_rl": wins / 8,
        "updates": BC_STEPS + 8,
        "iterations": 4,
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "evals.json").write_text(json.dumps(evals))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if probe is not None:
        (run_dir / "probe.json").write_text(json.dumps(probe))


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    for algo, wins in WINS.items():
        for seed, w in enumerate(wins):
            probe = None
            if algo == "rloo" and seed < 2:  # Probes of seeds 0 and 1: BPO/RLOO 0.5 and 0.75.
                probe = {
                    "results": {
                        "rloo": {"trace_var": 2.0, "norm_var": 4.0},
                        "bpo": {
                            "trace_var": 1.0 + 0.5 * seed,
                            "norm_var": 1.0,
                            "batches": 64,
                            "spend_ratio": [1.01, 1.2][seed],
                            "spend_warning": [
                                None,
                                "bpo spent 1.200 of rloo's cost: not at matched spend.",
                            ][seed],
                        },
                    }
                }
            write_run(root / algo / f"seed_{seed}", algo, seed, w, probe=probe)
    return root


def test_iqm_and_stratified_bootstrap_by_hand():
    assert stats.iqm([1, 2, 3, 4, 5, 6, 7, 100]) == 4.5  # mean of 3, 4, 5, 6
    assert stats.iqm([0, 1, 1]) == pytest.approx(2 / 3)  # n < 4: nothing cut
    # Within-stratum resampling keeps each stratum's size: a stratum of zeros and one of ones
    # always pool to half ones, so the CI of the mean is a point; an unstratified bootstrap is not.
    strata = [np.zeros(4), np.ones(4)]
    rng = np.random.default_rng(0)
    ci = stats.stratified_bootstrap_ci(strata, rng, statistic=lambda x: x.mean(axis=1))
    assert ci == (0.5, 0.5)
    lo, hi = stats.bootstrap_mean_ci(np.concatenate(strata), np.random.default_rng(0))
    assert lo < 0.5 < hi
    assert stats.probability_of_improvement([0.25, 0.0, -0.1, 0.3]) == 0.625


def test_table1_values_by_hand(runs, tmp_path):
    out = tmp_path / "out"
    tables.write_tables(runs, out, baseline="rloo", reference="bpo", seed=0)
    t1 = json.loads((out / "table1.json").read_text())
    assert set(t1) == {"env", "eval_splits", "episodes_per_seed", "algorithms", "paired"}
    assert (t1["env"], t1["eval_splits"], t1["episodes_per_seed"]) == (
        "alfworld",
        ["valid_seen", "valid_unseen"],
        8,
    )
    assert list(t1["algorithms"]) == ["bpo", "grpo", "rloo"]
    keys = {"seeds", "success", "mean", "ci95", "iqm", "spend_ratio", "updates"}
    for row in t1["algorithms"].values():
        assert set(row) == keys
        assert row["seeds"] == [0, 1, 2, 3]
        assert row["ci95"][0] <= row["mean"] <= row["ci95"][1]
    bpo, grpo, rloo = (t1["algorithms"][n] for n in ("bpo", "grpo", "rloo"))
    assert bpo["success"] == [0.75, 0.625, 0.875, 0.5]
    assert (bpo["mean"], grpo["mean"], rloo["mean"]) == (0.6875, 0.53125, 0.6875)
    # IQM of 32 pooled episodes: cut 8 from each end of the sorted list, mean of the middle 16.
    # bpo and rloo: 10 zeros, 22 ones -> 14/16; grpo: 15 zeros, 17 ones -> 9/16.
    assert (bpo["iqm"], grpo["iqm"], rloo["iqm"]) == (0.875, 0.5625, 0.875)
    # Generated tokens per task: 45 (bpo) and 50 against RLOO's 50.
    assert (bpo["spend_ratio"], grpo["spend_ratio"], rloo["spend_ratio"]) == (0.9, 1.0, 1.0)
    # Best baseline: RLOO (0.6875). BPO reaches it at iter_2 (4 RL updates), RLOO at the end
    # (8), GRPO never.
    assert (bpo["updates"], rloo["updates"], grpo["updates"]) == (4, 8, None)

    assert set(t1["paired"]) == {"bpo-grpo", "bpo-rloo"}
    for row in t1["paired"].values():
        assert set(row) == {"mean", "ci95", "prob_improvement"}
    # bpo - grpo per seed: 0.25, 0, 0.25, 0.125; bpo - rloo: 0, 0.25, -0.125, -0.125.
    vs_grpo, vs_rloo = t1["paired"]["bpo-grpo"], t1["paired"]["bpo-rloo"]
    assert vs_grpo["mean"] == 0.15625 and vs_grpo["prob_improvement"] == 0.875
    assert vs_rloo["mean"] == 0.0 and vs_rloo["prob_improvement"] == 0.375
    # A resample of the bpo-grpo differences has mean 0 only if all four draws are the 0
    # (probability 1/256 < 2.5%): the CI excludes 0. The bpo-rloo CI covers it.
    assert vs_grpo["ci95"][0] > 0
    assert vs_rloo["ci95"][0] < 0 < vs_rloo["ci95"][1]

    md = (out / "results.md").read_text()
    assert "BPO does not beat RLOO here: +0.0 points, 95% CI [" in md
    assert "BPO beats GRPO here: +15.6 points" in md
    assert "P(BPO > RLOO) = 0.38 over 4 paired seeds" in md
    assert "| grpo | 4 | 0.531 |" in md and "| 1.00 | not reached |" in md
    assert (
        "BPO reaches RLOO's final success (0.688) after 4 RL updates, RLOO after 8 (50% fewer" in md
    )
    assert "Compute is not matched: BPO generated 0.90x RLOO's tokens per task." in md
    for png in ("success_vs_tokens", "success_vs_updates", "grad_norm_variance",
                "spend_budget", "branch_points", "branch_steps"):  # fmt: skip
        path = out / f"{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png}.png)" in md
    run = [r for r in tables.find_runs(runs) if r.group == "bpo"][0]
    assert run.branch_steps() == [0, 0, 3] * 4  # Four iterations' counts, pooled.


def test_bootstrap_is_deterministic_per_seed(runs, tmp_path):
    tables.write_tables(runs, tmp_path / "a", seed=0)
    tables.write_tables(runs, tmp_path / "b", seed=0)
    a, b = ((tmp_path / d / "table1.json").read_text() for d in "ab")
    assert a == b
    assert (tmp_path / "a/results.md").read_text() == (tmp_path / "b/results.md").read_text()
    # The CI is the documented computation: 10,000 resamples from default_rng([seed, label]).
    diffs = [0.0, 0.25, -0.125, -0.125]
    for seed in (0, 3):
        t1, _ = tables.build_table1(tables.find_runs(runs), seed=seed)
        rng = np.random.default_rng([seed, zlib.crc32(b"paired/bpo-rloo")])
        idx = rng.integers(0, 4, size=(10_000, 4))
        expected = np.percentile(np.asarray(diffs)[idx].mean(axis=1), [2.5, 97.5])
        assert t1["paired"]["bpo-rloo"]["ci95"] == list(expected)


def test_table2_from_probe_records(runs, tmp_path):
    tables.write_tables(runs, tmp_path / "out")
    t2 = json.loads((tmp_path / "out/table2.json").read_text())
    assert t2["reference"] == "rloo"
    assert t2["probes"] == ["rloo/seed_0", "rloo/seed_1"]  # Relative to --runs: portable.
    bpo = t2["algorithms"]["bpo"]
    assert bpo["seeds"] == [0, 1] and bpo["trace_var_ratio"] == [0.5, 0.75]
    assert bpo["mean"] == 0.625 and bpo["norm_var_mean"] == 0.25
    assert 0.5 <= bpo["ci95"][0] <= 0.625 <= bpo["ci95"][1] <= 0.75
    assert bpo["batches"] == [64, 64] and bpo["spend_ratio"] == [1.01, 1.2]
    # Seed 1's probe was not at matched spend: the note says so, in the JSON and the text.
    assert "bpo spent 1.200 of rloo's cost" in t2["note"]
    md = (tmp_path / "out/results.md").read_text()
    assert "| bpo | 2 | 64, 64 | 0.62 | [" in md and "| 0.25 | 1.010, 1.200 |" in md
    assert "not at matched spend" in md


def test_a_probe_of_its_own_design_gets_its_own_table(runs, tmp_path):
    from bpo_jax.estimators import PART_SUMS
    from bpo_jax.study.fshare import f_tables, jsonable

    rng = np.random.default_rng(0)  # Two batches of f parts, as the probe keeps them.
    parts = [
        {"task": [0, 1, 2], "depth": [2, 2, 4], "branch_points": [3, 2, 1],
         **{k: (rng.uniform(0.1, 0.5, 3) * (2.0 if k == "m" else 1.0)).tolist()
            for k in PART_SUMS}}
        for _ in range(2)
    ]  # fmt: skip
    explained = jsonable(f_tables(parts, "tasks"))
    design = {"tree": [[0, 3], [4, 2]], "group_size": 4, "predicted_ratio": 0.7, "reason": "why"}
    probe = {
        "design": design,
        "results": {
            "rloo": {"trace_var": 2.0, "norm_var": 4.0},
            "bpo": {"trace_var": 1.2, "norm_var": 2.0, "batches": 96, "spend_ratio": 0.99,
                    "trace_var_ratio_ci95": [0.45, 0.9], "explained": explained},
        },
    }  # fmt: skip
    folder = runs / "probe/design"  # A probe's record: no summary.json.
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"seed": 0}))
    (folder / "probe.json").write_text(json.dumps(probe))
    tables.write_tables(runs, tmp_path / "out")
    t2 = json.loads((tmp_path / "out/table2.json").read_text())
    # The sweep's own probes make the table as before; the design's is its own.
    assert (
        t2["probes"] == ["rloo/seed_0", "rloo/seed_1"] and t2["algorithms"]["bpo"]["mean"] == 0.625
    )
    sub = t2["designs"]["design"]
    assert sub["design"] == design and sub["probes"] == ["probe/design"]
    bpo = sub["algorithms"]["bpo"]
    assert bpo["mean"] == pytest.approx(0.6) and bpo["ci95"] == [0.45, 0.9]
    assert bpo["spend_ratio"] == [0.99] and bpo["explained"]["f"] == explained["f"]
    md = (tmp_path / "out/results.md").read_text()
    assert "### Table 2, probe `design`: tree [[0, 3], [4, 2]]" in md
    assert "(first-order model, from the pilot): 0.70." in md and "Why this design: why" in md
    assert "| bpo | 1 | 96 | 0.60 | [0.45, 0.90] |" in md
    assert "f per depth on `bpo`'s probe batches:" in md


def test_todays_record_names_and_no_probe(tmp_path):
    """Plain eval names, success means only, run folders not named by a sweep."""
    root = tmp_path / "runs"
    for i, (algo, wins) in enumerate([("bpo", 6), ("bpo", 4), ("rloo", 5), ("rloo", 5)]):
        write_run(root / f"run{i}", algo, seed=i % 2, wins=wins, per_split=False, steps=False)
    out = tmp_path / "out"
    tables.write_tables(root, out)
    t1 = json.loads((out / "table1.json").read_text())
    assert t1["eval_splits"] == ["valid_unseen"] and t1["episodes_per_seed"] == 8
    assert t1["algorithms"]["bpo"]["success"] == [0.75, 0.5]
    assert t1["algorithms"]["bpo"]["iqm"] == 0.625  # IQM over the two seeds' means.
    assert t1["algorithms"]["bpo"]["updates"] is None  # No per-iteration evaluations.
    assert t1["paired"]["bpo-rloo"]["mean"] == 0.0
    assert t1["paired"]["bpo-rloo"]["prob_improvement"] == 0.5
    t2 = json.loads((out / "table2.json").read_text())
    assert t2["algorithms"] == {} and "no probe record" in t2["note"]
    md = (out / "results.md").read_text()
    assert "BPO does not beat RLOO here" in md and "no probe record" in md
    # Records from before the per-step branch counts: the figure is missing, and says why.
    assert "branch_steps.png not drawn: no record holds the step" in md


def test_single_paired_seed_draws_no_conclusion(tmp_path):
    write_run(tmp_path / "bpo/seed_0", "bpo", 0, 6, per_split=False)
    write_run(tmp_path / "rloo/seed_0", "rloo", 0, 4, per_split=False)
    tables.write_tables(tmp_path, tmp_path / "out")
    md = (tmp_path / "out/results.md").read_text()
    assert "BPO against RLOO: +25.0 points on a single paired seed; no confidence interval" in md
    assert "beats" not in md


def test_iqm_of_rare_wins_is_flagged(runs, tmp_path):
    """Under a quarter of 0/1 episodes won: the IQM is 0 whatever the rate, and results.md
    says so; the by-hand fixture (over half won) gets no such note."""
    for algo, seed in (("bpo", 0), ("bpo", 1), ("rloo", 0), ("rloo", 1)):
        write_run(tmp_path / "rare" / algo / f"seed_{seed}", algo, seed, wins=1 + seed)
    t1 = tables.write_tables(tmp_path / "rare", tmp_path / "out")["table1"]
    assert t1["algorithms"]["bpo"]["iqm"] == 0.0 and t1["algorithms"]["bpo"]["mean"] == 0.1875
    md = (tmp_path / "out/results.md").read_text()
    assert "The IQM of bpo, rloo is 0 or 1 by construction" in md
    tables.write_tables(runs, tmp_path / "fixture")
    assert "by construction" not in (tmp_path / "fixture/results.md").read_text()


def test_duplicate_seed_is_an_error(tmp_path):
    write_run(tmp_path / "a", "bpo", 0, 4)
    write_run(tmp_path / "b", "bpo", 0, 5)
    with pytest.raises(ValueError, match="two runs of bpo with seed 0"):
        tables.write_tables(tmp_path, tmp_path / "out")


def test_a_sweeps_behaviour_cloning_starts_are_not_runs(runs):
    before = [(r.group, r.seed) for r in tables.find_runs(runs)]
    write_run(runs / "bc" / "shared", "bpo", 0, 4)  # A bc_once start, with algo bpo, seed 0.
    write_run(runs / "bc" / "seed_1", "bpo", 1, 4)
    assert [(r.group, r.seed) for r in tables.find_runs(runs)] == before


def test_command_line(runs, tmp_path):
    out = tmp_path / "cli"
    # A sweep's shared behaviour-cloning start (no RL iterations) is not a result.
    write_run(runs / "bc" / "seed_0", "grpo", 0, 8)
    summary = runs / "bc" / "seed_0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "iterations": 0}))
    proc = subprocess.run(
        [sys.executable, "-m", "bpo_jax.study.tables", f"--runs={runs}", f"--out={out}",
         "--seed=0"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "BPO does not beat RLOO here" in proc.stdout
    table1 = json.loads((out / "table1.json").read_text())
    assert table1["algorithms"]["bpo"]["mean"] == 0.6875 and "bc" not in table1["algorithms"]


def test_curve_points_carry_an_episode_bootstrap_ci(runs):
    group = [r for r in tables.find_runs(runs) if r.group == "bpo"]
    splits = ["valid_seen", "valid_unseen"]
    curve = tables.success_curve(group, splits, np.random.default_rng(0), num_resamples=500)
    by_point = {c["point"]: c for c in curve}
    assert by_point["iter_2"]["ci95"] is None  # No per-episode outcomes recorded there.
    final = by_point["after_rl"]
    assert final["success"] == 0.6875
    # By hand: the 8 strata (4 seeds x 2 splits) of 4 episodes, each resampled on its own.
    strata = [e for r in group for e in r.episodes("after_rl", splits)]
    rng = np.random.default_rng(0)
    pooled = np.concatenate([s[rng.integers(0, 4, size=(500, 4))] for s in strata], axis=1)
    assert final["ci95"] == list(np.percentile(pooled.mean(axis=1), [2.5, 97.5]))
    assert final["ci95"][0] < 0.6875 < final["ci95"][1]
    assert tables.success_curve(group, splits)[-1]["ci95"] is None  # No rng: no CI.
