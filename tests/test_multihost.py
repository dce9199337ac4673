"""Multi-host runs on one machine: two JAX processes (gloo over 127.0.0.1, 2 CPU devices each)
against one process with 4 devices, on the tiny ALFWorld config with BPO.

Both split every batch of tasks into the same two shares (`mesh.task_shards=2`); the two
processes play one share each, the single process both, so their rollouts, advantages and
updates, and hence their parameters, must agree. The two-process run must write its files
once, and resume from its own checkpoint. Both sampling modes are checked: each process on its
own devices (`mesh.sampler=host`, the default) and every sampler program over both processes'
devices, the processes in lockstep (`mesh.sampler=slice`).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port, repo_env, run_together

from bpo_jax.parallel import distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"

OVERRIDES = [
    "--config.env.num_train_tasks=4",
    "--config.env.max_steps=3",
    "--config.env.num_workers=1",
    "--config.eval.num_tasks=2",
    "--config.bc.steps=2",
    "--config.bc.batch_size=8",
    "--config.train.iterations=2",
    "--config.train.tasks_per_iter=2",
    "--config.train.group_size=4",  # The budget: 4 episodes, for 2 backbones and branches.
    "--config.train.minibatch_size=8",
    "--config.agent.max_prompt_tokens=192",
    "--config.model.max_seq_len=256",
    # One length bucket for every prompt and update batch: fewer programs to compile.
    "--config.sampler.length_bucket=256",
    "--config.checkpoint.every=1",
    "--config.mesh.task_shards=2",
    # Returns that differ (an invalid action costs), so the advantages and updates are not 0,
    # and trees that branch at every step while the budget lasts.
    "--config.env.invalid_action_penalty=0.1",
    "--config.rollout.selector=interval",
    "--config.rollout.interval=1",
]


def _run_two(workdir: Path, extra=()) -> list[str]:
    """Runs the two processes to the end; returns their outputs."""
    address = f"127.0.0.1:{free_port()}"
    procs, outs = run_together(
        [
            [sys.executable, str(WORKER), str(workdir), "2", address, "2", str(i)]
            + OVERRIDES
            + list(extra)
            for i in range(2)
        ],
        timeout=1500,
    )
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-5000:]
    return outs


def _run_one(workdir: Path, extra=()) -> str:
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(workdir), "4"] + OVERRIDES + list(extra),
        cwd=ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout + proc.stderr


def _final_state(workdir: Path, part=lambda state: state) -> dict[str, np.ndarray]:
    """The arrays of `part` of the run's latest checkpoint (default: all of it: policy,
    optimizer, critic), restored onto this process."""
    import jax
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    path = workdir / "checkpoints" / str(steps[-1]) / "state"
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    state = ckptr.restore(path, abstract)
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(part(state))
    }


def _final_params(workdir: Path) -> dict[str, np.ndarray]:
    """The policy parameters of the run's latest checkpoint, restored onto this process."""
    return _final_state(workdir, lambda state: state["train_state"]["params"])


def _iterations(workdir: Path) -> list[int]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["train/iteration"] for r in map(json.loads, lines) if "train/iteration" in r]


def _without_seconds(evals: dict) -> dict:
    return {k: {f: v for f, v in r.items() if f != "eval/seconds"} for k, r in evals.items()}


def test_shares_cover_the_tasks_once():
    for n in range(0, 9):
        for shares in (1, 2, 3, 5):
            slices = distributed.share_slices(n, shares)
            assert len(slices) == shares
            covered = [i for s in slices for i in range(n)[s]]
            assert covered == list(range(n))
            sizes = [len(range(n)[s]) for s in slices]
            assert max(sizes) - min(sizes) <= 1


def test_initialize_needs_all_three_flags():
    with pytest.raises(ValueError, match="go together"):
        distributed.initialize("127.0.0.1:1234", None, 0)
    with pytest.raises(ValueError, match="process_id"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # About 20 minutes on 2 busy cores: three runs, mostly compiling.
def test_two_processes_match_one_and_resume(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    t0 = time.time()
    _run_two(two)
    t_two = time.time() - t0
    t0 = time.time()
    _run_one(one)
    t_one = time.time() - t0

    _assert_same_runs(two, one, "host", t_two, t_one)
    for name in ("config.json", "summary.json", "tokenizer.model", "expert_demos.json"):
        assert (two / name).is_file(), name
    assert not list(two.glob("*.tmp"))
    assert all(p.name.isdigit() for p in (two / "checkpoints").iterdir())

    # Resume from the two-process checkpoint with one more iteration.
    outs = _run_two(two, ["--config.train.iterations=3"])
    assert all("Resumed from checkpoint" in out for out in outs), outs[0][-3000:]
    assert _iterations(two) == [1, 2, 3]


# Slice-wide sampling has no prefix reuse; the one-process reference runs without it too.
SLICE_WIDE = ["--config.mesh.sampler=slice", "--config.sampler.prefix_reuse=False"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # Two runs, mostly compiling; measured in the test's print.
def test_two_processes_sampling_slice_wide_match_one(tmp_path):
    """`mesh.sampler=slice`: every sampler program over both processes' 4 devices, each
    process's rows a block of the batch (`bpo_jax.multihost.slice_sampler`), against one process."""
    two, one = tmp_path / "two", tmp_path / "one"
    t0 = time.time()
    outs = _run_two(two, SLICE_WIDE)
    t_two = time.time() - t0
    t0 = time.time()
    _run_one(one, ["--config.sampler.prefix_reuse=False"])
    t_one = time.time() - t0

    assert all("SUMMARY" in out for out in outs)
    _assert_same_runs(two, one, "slice-wide", t_two, t_one)


def _assert_same_runs(two: Path, one: Path, mode: str, t_two: float, t_one: float) -> None:
    """The two-process run ended where the one-process run did, having learned something, and
    wrote its files once."""
    p2, p1 = _final_params(two), _final_params(one)
    assert p2.keys() == p1.keys()
    diff = max(float(np.max(np.abs(p2[k] - p1[k]))) for k in p1)
    print(f"{mode}: two processes {t_two:.0f}s, one process {t_one:.0f}s, "
          f"max |param diff| {diff:.2e}")  # fmt: skip
    assert diff <= 1e-5
    # RL updated the parameters with trees that branched (not a comparison of zero updates).
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in records if "train/iteration" in r]
    assert any(r["train/grad_norm_mean"] > 0 for r in iters), iters
    assert sum(r["train/branch_points"] for r in iters) > 0, iters
    # Files written once: one metrics line per iteration, one record per evaluation.
    assert _iterations(two) == [1, 2] == _iterations(one)
    evals = json.loads((two / "evals.json").read_text())
    assert evals["after_rl"]["eval/num_episodes"] == 2
    assert _without_seconds(evals) == _without_seconds(json.loads((one / "evals.json").read_text()))


def test_merged_forest_keeps_every_share_s_values_and_weights():
    """Shares' forests merged into one: the estimators see each share's trees unchanged."""
    import jax
    from test_engine_mdp import TabularPolicy, encode

    from bpo_jax.estimators import step_advantages
    from bpo_jax.multihost.shares import merge_forests
    from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector
    from bpo_jax.rollout.engine import TreeSpec, play_forest
    from envs.sandbox import SandboxPool
    from envs.tabular import load_tasks, make_mdp, random_logits

    instance = "generic"
    mdp = make_mdp(instance, 0)
    policy = TabularPolicy(random_logits(mdp, seed=1, scale=0.7))
    spec = TreeSpec(root_group=2, num_branches=2, branch_budget=2, max_depth=2)
    forests = []
    with SandboxPool("tabular", {"instance": instance}, backend="inprocess") as pool:
        for seed, copies in ((0, 2), (1, 3)):
            forests.append(
                play_forest(
                    pool,
                    policy,
                    encode,
                    load_tasks(None, "train", instance=instance, copies=copies),
                    spec,
                    rng=jax.random.key(seed),
                    selector=make_selector("interval", interval=1),
                    lengths=LengthModel(mdp.horizon),
                    costs=CostModel("env_steps"),
                )
            )
    merged = merge_forests(forests)
    assert all(f.num_branch_points > 0 for f in forests)
    assert merged.num_branch_points == sum(f.num_branch_points for f in forests)
    assert merged.task_ids == forests[0].task_ids + forests[1].task_ids
    for estimator in ("bpo", "rloo"):
        np.testing.assert_allclose(
            merged.arrays().unpad_steps(step_advantages(merged.to_forest(), estimator)),
            np.concatenate(
                [f.arrays().unpad_steps(step_advantages(f.to_forest(), estimator)) for f in forests]
            ),
            atol=1e-6,
        )
    for mode in ("trajectory", "path_mass"):
        np.testing.assert_allclose(
            merged.step_weights(mode),
            np.concatenate([f.step_weights(mode) for f in forests]),
            atol=1e-12,
        )
    np.testing.assert_allclose(merged.leaf_mass(), np.concatenate([f.leaf_mass() for f in forests]))
    assert merged.stats.env_steps == sum(f.stats.env_steps for f in forests)
