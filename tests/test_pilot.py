"""The pilot of a tree's shape (`bpo_jax.study.pilot`) on a tabular MDP with a known profile.

`run_pilot` plays the real engine (in-process sandbox pool, planner, forest builder) with the
exact softmax-table policy; its profile must match the exact one at the steps it branched at,
its choice must be the exact profile's where the two are close, a re-run resumes after the
batches it kept, and the probe's size follows the reference spread.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
from test_experiments import tiny_cpu_config
from test_tree_design import exact

from bpo_jax.config import validate
from bpo_jax.io.metrics import BRANCH_PARTS_FILE
from bpo_jax.rollout.design import Design, choose_design, predicted_ratio
from bpo_jax.study import fshare, pilot
from envs.sandbox import SandboxPool
from envs.tabular import mdp_tasks
from envs.tabular.policy import TabularPolicy, encode_state


def pilot_config(horizon: int, n: int = 4):
    cfg = validate(
        tiny_cpu_config(
            **{"env.max_steps": horizon, "train.group_size": n, "rollout.budget_unit": "env_steps"}
        )
    )
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, overlap_cohorts=1))


def play(mdp, logits, cfg, designs, workdir, tasks=300):
    with SandboxPool("tabular", {"mdp": mdp}, backend="inprocess") as pool:
        return pilot.run_pilot(
            pool,
            TabularPolicy(logits),
            encode_state,
            mdp_tasks(mdp, copies=tasks),
            cfg,
            designs,
            jax.random.key(0),
            workdir,
            log=lambda _: None,
        )


def test_the_pilot_measures_the_exact_profile_and_chooses_its_design(tmp_path):
    mdp, logits, profile = exact("generic", 0)
    cfg = pilot_config(mdp.horizon)
    designs = pilot.pilot_designs(4, range(1, mdp.horizon))
    assert all(d.root_group == 4 and d.num_branches == 2 for d in designs)
    stats = play(mdp, logits, cfg, designs, tmp_path)
    measured = stats.profile()
    np.testing.assert_allclose(measured.survival, profile.survival, atol=0.04)
    np.testing.assert_allclose(measured.explained, profile.explained, atol=0.08)
    out = pilot.summarize(stats, 4, reference=(0.2, 64))
    tree = out["choice"]["tree"]  # [[0, K0], [d_1, K], ...]
    design = Design(tree[0][1], tree[-1][1] if len(tree) > 1 else 2, [d for d, _ in tree[1:]])
    # Where the measured profile picks another design, the exact model rates it within 10%.
    exact_choice = choose_design(profile, 4)
    assert predicted_ratio(design, profile, 4) <= exact_choice.ratio * 1.1 + 1e-9
    ranked = [r["predicted_ratio"] for r in out["candidates"][:10]]
    assert ranked == sorted(ranked) and ranked[0] == pytest.approx(out["choice"]["best_tree_ratio"])
    if design.branches:
        need = out["probe_batches"]["needed_80pct_power"]
        ratio = out["choice"]["predicted_ratio"]
        assert need == math.ceil(64 * ((pilot.Z95 + pilot.Z80) * 0.2 / -math.log(ratio)) ** 2)
    # The folder is a run folder for the f report: per-depth f and Table 2a.
    text, tables = fshare.report(tmp_path)
    assert "Table 2a" in text and tables["table2a"]
    depths = {row["depth"] for row in tables["f"] if row["depth"] != "all"}
    assert depths == set(range(1, mdp.horizon))


def test_a_rerun_resumes_after_the_kept_batches(tmp_path):
    mdp, logits, _ = exact("generic", 0)
    cfg = pilot_config(mdp.horizon)
    designs = pilot.pilot_designs(4, [1, 2, 3])
    play(mdp, logits, cfg, designs[:2], tmp_path, tasks=40)
    first = (tmp_path / pilot.BATCHES_FILE).read_text().splitlines()
    stats = play(mdp, logits, cfg, designs, tmp_path, tasks=40)
    rows = (tmp_path / pilot.BATCHES_FILE).read_text().splitlines()
    assert rows[:2] == first and len(rows) == 3 and len(stats.batches) == 3
    assert [json.loads(r)["tree"] for r in rows] == [d.tree for d in designs]
    assert len((tmp_path / BRANCH_PARTS_FILE).read_text().splitlines()) == 3


def test_batches_needed_and_the_reference_spread(tmp_path):
    assert pilot.batches_needed(1.1, 0.2, 64) is None
    assert pilot.batches_needed(0.5, 0.2, 64) < pilot.batches_needed(0.8, 0.2, 64)
    # Half the spread needs a quarter of the batches.
    assert pilot.batches_needed(0.7, 0.1, 64) == pytest.approx(
        pilot.batches_needed(0.7, 0.2, 64) / 4, abs=1
    )
    path = tmp_path / "probe.json"
    results = {
        "rloo": {"trace_var_ratio_ci95": [1.0, 1.0], "batches": 64},
        "bpo": {"trace_var_ratio_ci95": [0.8, 1.8], "batches": 64},
    }
    path.write_text(json.dumps({"results": results}))
    sd, at = pilot.reference_spread(path)
    assert at == 64 and sd == pytest.approx(math.log(1.8 / 0.8) / (2 * pilot.Z95))


@pytest.mark.parametrize(
    "steps,depth,what",
    [("", 2, "branch_steps"), ("3,2", 2, "branch_steps"), ("x", 2, "branch_steps"),
     ("1,3,5", 2, "max_depth")],
)  # fmt: skip
def test_a_fixed_design_in_the_config_is_checked(steps, depth, what):
    fields = {"rollout.selector": "steps", "rollout.branch_steps": steps}
    with pytest.raises(ValueError, match=f"config.rollout.{what} "):
        validate(tiny_cpu_config(**fields, **{"rollout.max_depth": depth}))
    cfg = validate(tiny_cpu_config(**{**fields, "rollout.branch_steps": "2,5"}))
    assert pilot.RolloutState.create(cfg).selector.steps.tolist() == [2, 5]
