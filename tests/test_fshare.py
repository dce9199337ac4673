"""What a run recorded of f, read back: `python -m bpo_jax.study.fshare` on a run folder (f per
depth with bootstrap CIs over tasks, Table 2a; over iterations from the metrics alone; one-line
errors), and `bpo_jax.study.tables`' section on f, only for runs that recorded it.

The run folders are written as `bpo_jax.train` writes them (`MetricWriter.write` of
`rollout.explained.batch_metrics`, `MetricWriter.append` of the batch's parts, the summary),
from forests of a tabular MDP (`test_explained.batches`).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_cli import _one_line_error, _run
from test_explained import batches

from bpo_jax.io.metrics import BRANCH_PARTS_FILE, MetricWriter
from bpo_jax.rollout import explained
from bpo_jax.study import fshare, table2a


def write_run(run_dir, parts_list, algo="bpo"):
    """A run folder as `train` writes it: metrics and branch parts per iteration, summary."""
    run_dir.mkdir(parents=True)
    share = explained.ExplainedShare()
    with MetricWriter(run_dir, use_tensorboard=False) as writer:
        for it, parts in enumerate(parts_list, 1):
            share.add(parts)
            writer.write(it, {"train/iteration": it, **explained.batch_metrics(parts)})
            writer.append(BRANCH_PARTS_FILE, {"iteration": it, "step": it, **share.record()})
    config = {"seed": 0, "env": {"name": "tabular"}, "train": {"algo": algo}}
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "summary.json").write_text(json.dumps({"iterations": 3, **share.summary()}))
    return share


def test_fshare_command(tmp_path):
    parts = batches(3, tasks=40)
    share = write_run(tmp_path / "run", parts)
    text, data = fshare.report(tmp_path / "run", num_resamples=200)
    assert data["unit"] == "tasks" and [r["depth"] for r in data["f"]] == [1, 2, "all"]
    assert data["f"][-1]["f"] == pytest.approx(share.summary()["f"], rel=1e-9)
    assert data["f"][-1]["units"] == 120 and data["f"][-1]["branch_points"] == 120 * 9
    var_units = sum(len({t for t, v in zip(p["task"], p["var_return"]) if v > 0}) for p in parts)
    assert data["f"][-1]["units_with_variance"] == var_units and "Var(R) > 0" in text
    lo, hi = data["f"][-1]["f_ci"]
    assert lo < data["f"][-1]["f"] < hi
    rows = data["table2a"]
    assert [r["depth"] for r in rows] == [1, 2, "all"] and "Table 2a" in text
    assert all(r["f"] == pytest.approx(q["f"]) for r, q in zip(rows, data["f"]))
    # Only the metrics' sums (a run without branch_parts.jsonl): f per depth over iterations.
    (tmp_path / "run" / BRANCH_PARTS_FILE).unlink()
    text, data = fshare.report(tmp_path / "run", num_resamples=200)
    assert data["unit"] == "iterations" and data["table2a"] is None
    assert data["f"][-1]["f"] == pytest.approx(share.summary()["f"], rel=1e-9)
    assert data["f"][-1]["units"] == 3 and "No Table 2a" in text
    # Mistakes end in one line and exit status 2 (as a user runs the command: a subprocess).
    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "metrics.jsonl").write_text('{"step": 1, "train/iteration": 1}\n')
    for run, expected in (
        (tmp_path / "nothing", "no such folder"),
        (tmp_path, "not a run's folder"),
        (tmp_path / "grpo", "no f recorded (train.algo=unknown"),
    ):
        with pytest.raises(ValueError, match=re.escape(expected)):
            fshare.read_run_parts(run)
    message = _one_line_error(_run("bpo_jax.study.fshare", f"--run={tmp_path / 'grpo'}"))
    assert message.startswith(f"--run={tmp_path / 'grpo'}: no f recorded")
    proc = _run("bpo_jax.study.fshare", f"--run={tmp_path / 'run'}", "--resamples=100")
    assert proc.returncode == 0 and "| all | 1080 | 3 |" in proc.stdout, proc.stderr[-2000:]


def test_tables_add_f_only_for_runs_that_recorded_it(tmp_path):
    from test_tables import write_run as write_table_run

    from bpo_jax.study import tables

    root = tmp_path / "runs"
    for algo, wins in (("bpo", [6, 5]), ("rloo", [6, 3])):
        for seed, w in enumerate(wins):
            write_table_run(root / algo / f"seed_{seed}", algo, seed, w)
    tables.write_tables(root, tmp_path / "plain", num_resamples=200)
    plain = json.loads((tmp_path / "plain" / "table2.json").read_text())
    assert "f" not in plain and "## f:" not in (tmp_path / "plain" / "results.md").read_text()
    parts = batches(2, tasks=20)
    for seed in (0, 1):  # BPO's runs recorded f: two iterations each.
        run = root / "bpo" / f"seed_{seed}"
        with MetricWriter(run, use_tensorboard=False) as writer:
            for it, p in enumerate(parts, 1):
                record = {k: np.asarray(v).tolist() for k, v in p.items()}
                writer.append(BRANCH_PARTS_FILE, {"iteration": it, "step": it, **record})
    tables.write_tables(root, tmp_path / "f", num_resamples=200)
    t2 = json.loads((tmp_path / "f" / "table2.json").read_text())
    assert set(t2["f"]) == set(t2["table2a"]) == {"bpo"} and t2["f"]["bpo"]["unit"] == "tasks"
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    all_row = t2["f"]["bpo"]["rows"][-1]
    assert all_row["units"] == 2 * 2 * 20 and all_row["branch_points"] == 2 * 2 * 20 * 9
    assert all_row["f"] == pytest.approx(pooled["between"].sum() / pooled["var_return"].sum())
    md = (tmp_path / "f" / "results.md").read_text()
    assert "## f:" in md and "### bpo" in md and "Table 2a (bpo)" in md
    assert md.index("## f:") < md.index("## Figures")
    # Everything else as before.
    assert {k: v for k, v in t2.items() if k not in ("f", "table2a")} == plain


def test_a_resample_without_return_variance_is_left_out_of_the_interval():
    # 16 tasks, two with return variance (f 1 and 0): about 12% of the resamples hold neither
    # and have no f; the interval comes from the others (scipy's would be NaN).
    num, den = np.r_[np.zeros(14), 1.0, 0.0], np.r_[np.zeros(14), 1.0, 1.0]
    rng = np.random.default_rng(0)
    f, (lo, hi) = table2a.ratio_ci(
        num, den, method="bootstrap", level=0.95, num_resamples=2000, rng=rng
    )
    assert f == 0.5 and (lo, hi) == (0.0, 1.0)
