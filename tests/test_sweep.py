"""The sweep command: run names and order, skip, resume after a crash and after Ctrl-C, parallel
runs, the manifest, --dry_run and --commit_to, against a stand-in main module."""

import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bpo_jax.study import sweep as sweep_lib

REPO = Path(__file__).resolve().parents[1]

# A stand-in for bpo_jax.main: the same flags (config_flags, overrides), a "checkpoint" after
# every iteration that a re-run resumes from, summary.json at the end; it exits with status 3
# at iteration `crash_at` when $FAKE_CRASH names its run.
FAKE_MAIN = """
import json, os, sys, time
from pathlib import Path
from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "", lock_config=True)
flags.DEFINE_string("workdir", None, "")


def main(argv):
    cfg, wd = flags.FLAGS.config, Path(flags.FLAGS.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "config.json").write_text(json.dumps(cfg.to_dict()))
    ckpt = wd / "ckpt.json"
    start = json.loads(ckpt.read_text())["iteration"] if ckpt.exists() else 0
    with open(wd / "invocations.txt", "a") as f:
        f.write(f"{os.getpid()} {start} {time.time()}\\n")
    print(f"resuming at iteration {start}", flush=True)
    crash = os.environ.get("FAKE_CRASH", "") == f"{wd.parent.name}/{wd.name}"
    if cfg.init_from and not (Path(cfg.init_from) / "summary.json").is_file():
        sys.exit(f"init_from {cfg.init_from} has no summary")
    if crash and cfg.train.iterations == 0:
        sys.exit(3)
    for it in range(start, cfg.train.iterations):
        time.sleep(cfg.sleep)
        if crash and it == cfg.crash_at:
            print("crashing", flush=True)
            sys.exit(3)
        ckpt.write_text(json.dumps({"iteration": it + 1}))
        with open(wd / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": it + 1, "train/iteration": it + 1}) + "\\n")
    (wd / "evals.json").write_text(json.dumps({"after_rl": {"eval/success": 0.5}}))
    summary = {"iterations": cfg.train.iterations, "success_after_rl": 0.5, "end": time.time()}
    (wd / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
"""

# A stand-in for bpo_jax.study.probe: the probe's flags; it reads the start's "checkpoint" and
# writes
# the probe's config.json and probe.json.
FAKE_PROBE = """
import json, sys
from pathlib import Path
from absl import app, flags
from ml_collections import config_flags
config_flags.DEFINE_config_file("config", None, "", lock_config=True)
flags.DEFINE_string("workdir", None, "")
flags.DEFINE_string("algos", "rloo,bpo", "")
flags.DEFINE_integer("batches", 64, "")
def main(argv):
    cfg, wd = flags.FLAGS.config, Path(flags.FLAGS.workdir)
    if not (Path(cfg.init_from) / "summary.json").is_file():
        sys.exit(f"init_from {cfg.init_from} has no summary")
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "config.json").write_text(json.dumps(cfg.to_dict()))
    algos = flags.FLAGS.algos.split(",")
    results = {a: {"trace_var": 1.0 + i, "norm_var": 1.0, "trace_var_ratio": 1.0 + i,
                   "batches": flags.FLAGS.batches} for i, a in enumerate(algos)}
    (wd / "probe.json").write_text(json.dumps({"results": results}))
if __name__ == "__main__":
    app.run(main)
"""

EXPERIMENT = """
import ml_collections
from bpo_jax.experiment import parse_variants


def get_config(arg=None):
    variants = parse_variants(arg)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.train = ml_collections.ConfigDict()
    c.train.algo = variants.get("algo", "grpo")
    c.train.iterations = 3
    c.rollout = ml_collections.ConfigDict()
    c.rollout.num_branches = 2
    c.env = ml_collections.ConfigDict()
    c.env.eval_split = "valid_seen"
    c.eval = ml_collections.ConfigDict()
    c.eval.num_tasks = 0
    c.eval.cache_dir = ""
    c.init_from = ""
    c.sleep = 0.0
    c.crash_at = 1
    return c
"""

SWEEP = """
from bpo_jax.study.sweep import Ablation, Probe, Sweep


def get_sweep():
    return Sweep(
        config="{config}:cpu",
        algos=("bpo", "grpo"),
        seeds=(0, 1),
        overrides={{"sleep": {sleep}}},
        ablations=(Ablation("k4", {{"rollout.num_branches": 4}}, algos=("bpo",)),),
    )
"""

NAMES = [
    "bpo/seed_0",
    "bpo_k4/seed_0",
    "grpo/seed_0",
    "bpo/seed_1",
    "bpo_k4/seed_1",
    "grpo/seed_1",
]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """Writes the stand-in module, experiment and sweep files; returns a sweep-file factory."""
    (tmp_path / "fake_main.py").write_text(FAKE_MAIN)
    (tmp_path / "fake_probe.py").write_text(FAKE_PROBE)
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    monkeypatch.delenv("FAKE_CRASH", raising=False)

    def make(sleep=0.0, shared_bc=False, extra=""):
        tag = f"{str(sleep).replace('.', '_')}_{shared_bc}_{len(extra)}"
        path = tmp_path / f"sweep_{tag}.py"
        text = SWEEP.format(config=tmp_path / "exp.py", sleep=sleep)
        if shared_bc:
            text = text.replace("seeds=(0, 1),", f"seeds=(0, 1), shared_bc=True, {extra}")
        path.write_text(text)
        return path

    return make


def invocations(run_dir: Path) -> list[tuple[int, int, float]]:
    lines = (run_dir / "invocations.txt").read_text().split("\n")
    return [(int(p), int(s), float(t)) for p, s, t in (ln.split() for ln in lines if ln)]


def manifest(workdir: Path) -> dict:
    return {r["name"]: r for r in json.loads((workdir / "sweep.json").read_text())["runs"]}


def test_expand_names_order_and_flags(setup):
    runs = sweep_lib.expand(sweep_lib.load_sweep(setup()))
    assert [r.name for r in runs] == NAMES
    k4 = runs[1]
    assert k4.config.endswith(":cpu,algo=bpo") and k4.seed == 0 and k4.ablation == "k4"
    assert k4.overrides == (
        "--config.sleep=0.0",
        "--config.rollout.num_branches=4",
        "--config.seed=0",
    )
    cfg = sweep_lib.resolve_config(runs[5])
    assert (cfg.train.algo, cfg.seed, cfg.rollout.num_branches) == ("grpo", 1, 2)
    assert sweep_lib.resolve_config(k4).rollout.num_branches == 4


def test_expand_rejects_bad_sweeps():
    base = dict(config="e.py:cpu", algos=("bpo",), seeds=(0,))
    with pytest.raises(ValueError, match="algo="):
        sweep_lib.expand(sweep_lib.Sweep(**{**base, "config": "e.py:cpu,algo=bpo"}))
    with pytest.raises(ValueError, match="twice"):
        sweep_lib.expand(sweep_lib.Sweep(**{**base, "seeds": (0, 0)}))
    with pytest.raises(ValueError, match="does not run"):
        bad = sweep_lib.Ablation("k4", {"rollout.num_branches": 4}, algos=("ppo",))
        sweep_lib.expand(sweep_lib.Sweep(**base, ablations=(bad,)))
    with pytest.raises(ValueError, match="folder"):
        sweep_lib.expand(sweep_lib.Sweep(**base, ablations=(sweep_lib.Ablation("k/4", {}),)))


def test_dry_run_prints_commands_and_runs_nothing(setup, tmp_path):
    out = io.StringIO()
    sweep_lib.run_sweep(setup(), tmp_path / "runs", dry_run=True, module="fake_main", out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(NAMES)
    assert f"--workdir={tmp_path / 'runs' / 'bpo_k4/seed_1'}" in lines[4]
    assert " -m fake_main " in lines[0] and "--config.rollout.num_branches=4" in lines[4]
    assert not (tmp_path / "runs").exists()


def test_crash_then_resume_skips_finished_runs(setup, tmp_path, monkeypatch):
    sweep_file, workdir, committed = setup(), tmp_path / "runs", tmp_path / "results"
    monkeypatch.setenv("FAKE_CRASH", "grpo/seed_0")
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, workdir, module="fake_main", commit_to=committed, out=out
    )
    assert statuses == {n: "failed" if n == "grpo/seed_0" else "done" for n in NAMES}
    assert len(out.getvalue().splitlines()) == len(NAMES)  # One progress line per run.
    m = manifest(workdir)
    assert [m[n]["status"] for n in NAMES] == [
        "done", "done", "failed", "done", "done", "done"
    ]  # fmt: skip
    assert m["grpo/seed_0"]["returncode"] == 3 and m["bpo/seed_0"]["returncode"] == 0
    assert all(m[n]["attempts"] == 1 and m[n]["wall_seconds"] > 0 for n in NAMES)
    assert "crashing" in (workdir / "grpo/seed_0/log.txt").read_text()
    assert not (committed / "grpo/seed_0").exists()
    assert sorted(p.name for p in (committed / "bpo_k4/seed_1").iterdir()) == [
        "config.json", "evals.json", "metrics.jsonl", "summary.json"
    ]  # fmt: skip

    monkeypatch.delenv("FAKE_CRASH")
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, workdir, module="fake_main", commit_to=committed, out=out
    )
    assert set(statuses.values()) == {"done"}
    text = out.getvalue()
    assert text.count("skipped") == 5 and "grpo/seed_0: done (rc 0)" in text
    # The crashed run resumed from its checkpoint (iteration 1); the others were not re-run.
    assert [s for _, s, _ in invocations(workdir / "grpo/seed_0")] == [0, 1]
    assert all(len(invocations(workdir / n)) == 1 for n in NAMES if n != "grpo/seed_0")
    assert manifest(workdir)["grpo/seed_0"]["attempts"] == 2
    assert (committed / "grpo/seed_0/summary.json").is_file()
    log = (workdir / "grpo/seed_0/log.txt").read_text()
    assert log.count("sweep starts") == 2 and "resuming at iteration 1" in log


def test_parallel_runs_overlap(setup, tmp_path):
    workdir = tmp_path / "runs"
    statuses = sweep_lib.run_sweep(
        setup(sleep=0.4), workdir, parallel=2, module="fake_main", out=io.StringIO()
    )
    assert set(statuses.values()) == {"done"}
    spans = []
    for n in NAMES:
        start = invocations(workdir / n)[0][2]
        end = json.loads((workdir / n / "summary.json").read_text())["end"]
        spans.append((start, end))
    # Some two runs were alive at once, and never more than two.
    times = sorted({t for span in spans for t in span})
    alive = [sum(s <= t < e for s, e in spans) for t in times]
    assert max(alive) == 2


def test_ctrl_c_terminates_children_and_a_rerun_resumes(setup, tmp_path):
    sweep_file, workdir = setup(sleep=1.0), tmp_path / "runs"
    # `python -m bpo_jax.study.sweep`, its KeyboardInterrupt handler installed first: a shell
    # without job control starts background commands with SIGINT ignored, and Python then
    # installs none. Set in the child rather than by a preexec_fn, which would make Popen fork
    # this JAX-threaded process (JAX's os.fork() warning) instead of spawning.
    sweep_main = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('bpo_jax.study.sweep', run_name='__main__', alter_sys=True)"
    )
    cmd = [sys.executable, "-c", sweep_main, f"--sweep={sweep_file}", f"--workdir={workdir}",
           "--module=fake_main"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpt = workdir / "bpo_k4/seed_0/ckpt.json"  # The second run, one iteration in.
    deadline = time.time() + 60
    while not ckpt.exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "interrupted" in output
    pid = invocations(workdir / "bpo_k4/seed_0")[0][0]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # The child is gone (terminated and reaped).
    m = manifest(workdir)
    assert m["bpo/seed_0"]["status"] == "done"
    assert m["bpo_k4/seed_0"]["status"] == "interrupted"
    assert m["grpo/seed_0"]["status"] == "pending"
    assert not (workdir / "bpo_k4/seed_0/summary.json").exists()

    statuses = sweep_lib.run_sweep(
        sweep_file, workdir, parallel=2, module="fake_main", out=io.StringIO()
    )
    assert set(statuses.values()) == {"done"}
    starts = [s for _, s, _ in invocations(workdir / "bpo_k4/seed_0")]
    assert starts[0] == 0 and starts[1] >= 1  # Resumed from its checkpoint.
    assert len(invocations(workdir / "bpo/seed_0")) == 1


def test_second_sweep_in_the_same_folder_is_refused(setup, tmp_path):
    workdir = tmp_path / "runs"
    workdir.mkdir()
    with (workdir / ".sweep.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Another sweep holds the folder.
        with pytest.raises(RuntimeError, match="another sweep is running"):
            sweep_lib.run_sweep(setup(), workdir, module="fake_main", out=io.StringIO())
    assert not (workdir / "bpo/seed_0").exists()


def test_probes_of_their_own_configuration_are_named_runs():
    design = sweep_lib.Probe(
        algos=("rloo", "bpo", "bpo_traj"),
        batches=96,
        name="design",
        overrides={"rollout.selector": "steps", "rollout.branch_steps": "4"},
        variants=("bpo_shrink",),
        predicted=0.71,
        reason="the pilot's choice",
    )
    base = dict(config="experiments/alfworld.py:cpu", algos=("bpo",), seeds=(0, 1), shared_bc=True)
    once = sweep_lib.expand(
        sweep_lib.Sweep(**base, bc_once=True, probe=(sweep_lib.Probe(batches=8), design))
    )
    assert [r.name for r in once[:3]] == ["bc/shared", "probe/shared", "probe/design"]
    run = once[2]
    assert run.init_from == "bc/shared" and run.probe_flags == (
        "--algos=rloo,bpo,bpo_traj", "--batches=96", "--variants=bpo_shrink", "--predicted=0.71",
        "--design_reason=the pilot's choice",
    )  # fmt: skip
    assert "--config.rollout.branch_steps=4" in run.overrides
    assert "--config.rollout.branch_steps=4" not in once[1].overrides
    per_seed = sweep_lib.expand(sweep_lib.Sweep(**base, probe=design))
    assert [r.name for r in per_seed if r.is_probe] == [
        "probe/design_seed_0",
        "probe/design_seed_1",
    ]
    with pytest.raises(ValueError, match="same name"):
        sweep_lib.expand(sweep_lib.Sweep(**base, probe=(design, design)))


def test_paper_sweep_file_loads():
    sweep = sweep_lib.load_sweep(REPO / "experiments/paper/alfworld_cpu.py")
    runs = sweep_lib.expand(sweep)
    # One behaviour-cloning start for all, its probe, then 3 algorithms x 5 seeds.
    assert len(runs) == 17
    assert [r.name for r in runs[:5]] == [
        "bc/shared", "probe/shared", "bpo/seed_0", "grpo/seed_0", "rloo/seed_0"
    ]  # fmt: skip
    assert all(r.init_from == "bc/shared" for r in runs[1:]) and runs[-1].name == "rloo/seed_4"
    assert runs[1].probe_flags == ("--algos=rloo,bpo", "--batches=64")
    assert all(r.share_evals for r in runs if not r.is_probe)
    cwd = os.getcwd()
    os.chdir(REPO)  # The sweep's config path is relative to the repository root.
    try:
        cfg = sweep_lib.resolve_config(runs[6])
    finally:
        os.chdir(cwd)
    assert (cfg.train.algo, cfg.seed, cfg.env.name) == ("grpo", 1, "alfworld")
    assert cfg.train.iterations == sweep.overrides["train.iterations"]


def test_shared_bc_runs_once_per_seed_and_its_runs_start_from_it(setup, tmp_path, monkeypatch):
    workdir = tmp_path / "runs"
    names = [n for n in NAMES]
    runs = sweep_lib.expand(sweep_lib.load_sweep(setup(shared_bc=True)))
    assert [r.name for r in runs] == ["bc/seed_0", *names[:3], "bc/seed_1", *names[3:]]
    monkeypatch.setenv("FAKE_CRASH", "bc/seed_1")  # Its seed's runs must not start.
    statuses = sweep_lib.run_sweep(
        setup(sleep=0.2, shared_bc=True), workdir, parallel=2, module="fake_main",
        out=io.StringIO(),
    )  # fmt: skip
    assert statuses["bc/seed_0"] == "done" and statuses["bc/seed_1"] == "failed"
    assert all(statuses[n] == "done" for n in names[:3])
    assert all(statuses[n] == "failed" for n in names[3:])
    assert all(not (workdir / n / "invocations.txt").exists() for n in names[3:])
    bc = json.loads((workdir / "bc/seed_0/config.json").read_text())
    assert bc["train"]["iterations"] == 0 and bc["eval"]["num_tasks"] == 1
    bc_end = json.loads((workdir / "bc/seed_0/summary.json").read_text())["end"]
    for n in names[:3]:
        cfg = json.loads((workdir / n / "config.json").read_text())
        assert cfg["init_from"] == str(workdir / "bc/seed_0") and cfg["seed"] == 0
        assert invocations(workdir / n)[0][2] >= bc_end  # Started after its start finished.
    # Resumed: the failed start runs again, then its seed's runs.
    monkeypatch.delenv("FAKE_CRASH")
    statuses = sweep_lib.run_sweep(
        setup(shared_bc=True), workdir, module="fake_main", out=io.StringIO()
    )
    assert set(statuses.values()) == {"done"}
    assert len(invocations(workdir / "bpo/seed_0")) == 1


def test_bc_once_starts_every_seed_from_one_policy_and_evals_are_shared(setup, tmp_path):
    workdir = tmp_path / "runs"
    sweep_file = setup(shared_bc=True, extra="bc_once=True, share_evals=True,")
    runs = sweep_lib.expand(sweep_lib.load_sweep(sweep_file))
    assert [r.name for r in runs] == ["bc/shared", *NAMES]
    cache = f"--config.eval.cache_dir={workdir / 'eval_cache'}"
    assert all(cache in r.command(workdir) for r in runs)
    statuses = sweep_lib.run_sweep(sweep_file, workdir, module="fake_main", out=io.StringIO())
    assert set(statuses.values()) == {"done"}
    bc = json.loads((workdir / "bc/shared/config.json").read_text())
    assert bc["seed"] == 0 and bc["train"]["iterations"] == 0
    for n in NAMES:
        cfg = json.loads((workdir / n / "config.json").read_text())
        assert cfg["init_from"] == str(workdir / "bc/shared")
        assert cfg["eval"]["cache_dir"] == str(workdir / "eval_cache")
    assert {json.loads((workdir / n / "config.json").read_text())["seed"] for n in NAMES} == {0, 1}


def test_a_fresh_machine_skips_committed_runs_and_reruns_a_needed_start(setup, tmp_path):
    sweep_file = setup(shared_bc=True, extra="bc_once=True, share_evals=True,")
    records = tmp_path / "records"
    first = sweep_lib.run_sweep(
        sweep_file, tmp_path / "a", module="fake_main", commit_to=records, out=io.StringIO()
    )
    assert set(first.values()) == {"done"}
    # Every record committed: a fresh workdir runs nothing, not even the start.
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, tmp_path / "b", module="fake_main", commit_to=records, out=out
    )
    assert set(statuses.values()) == {"done"}
    assert not any((tmp_path / "b" / n).exists() for n in ["bc/shared", *NAMES])
    assert f"grpo/seed_1: finished earlier (3 iterations; record in {records}), skipped" in (
        out.getvalue()
    )
    # One run's record missing: the start runs again (its checkpoint is not in the record),
    # then that run; the others stay skipped.
    shutil.rmtree(records / "grpo/seed_1")
    start_record = (records / "bc/shared/summary.json").read_text() + "\n"
    (records / "bc/shared/summary.json").write_text(start_record)  # Marked: the first run's.
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, tmp_path / "c", module="fake_main", commit_to=records, out=out
    )
    assert set(statuses.values()) == {"done"}
    ran = {n for n in ["bc/shared", *NAMES] if (tmp_path / "c" / n / "invocations.txt").exists()}
    assert ran == {"bc/shared", "grpo/seed_1"}
    assert (records / "grpo/seed_1/summary.json").is_file()
    # The re-run start's committed record (the one its runs were paired with) is kept.
    assert (records / "bc/shared/summary.json").read_text() == start_record
    assert f"its committed record in {records} is kept" in out.getvalue()


def test_a_rerun_start_that_does_not_reproduce_its_record_stops_its_runs(setup, tmp_path):
    sweep_file = setup(shared_bc=True, extra="bc_once=True,")
    records = tmp_path / "records"
    sweep_lib.run_sweep(
        sweep_file, tmp_path / "a", module="fake_main", commit_to=records, out=io.StringIO()
    )
    shutil.rmtree(records / "grpo/seed_1")
    # The committed start differs from what a re-run makes (here: one more metric record).
    (records / "bc/shared/metrics.jsonl").write_text('{"step": 1, "bc/loss": 0.5}\n')
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, tmp_path / "b", module="fake_main", commit_to=records, out=out
    )
    assert statuses["bc/shared"] == "failed" and statuses["grpo/seed_1"] == "failed"
    assert "0 metric records against 1 committed" in out.getvalue()
    assert "grpo/seed_1: not started: bc/shared failed" in out.getvalue()
    assert not (tmp_path / "b" / "grpo/seed_1").exists()
    assert not (records / "grpo/seed_1").exists()
    # Resuming in the same folder checks the finished start again; allowed, its runs go on.
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file,
        tmp_path / "b",
        module="fake_main",
        commit_to=records,
        out=out,
        allow_changed_start=True,
    )
    assert set(statuses.values()) == {"done"}
    assert "WARNING: 0 metric records against 1 committed" in out.getvalue()
    assert (records / "grpo/seed_1/summary.json").is_file()
    assert (records / "bc/shared/metrics.jsonl").read_text().count("\n") == 1  # Kept.


def test_record_difference_ignores_clocks_and_cache_hits(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rows = [
        {"step": 1, "time": 1.0, "bc/loss": 0.25, "eval/seconds": 3.0, "eval/cached": 0.0},
        {"step": 2, "time/sampling_seconds": 1.0, "bc/grad_norm": 6.791347980499268},
    ]
    (a / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rows[0].update(time=9.0, **{"eval/seconds": 7.0, "eval/cached": 1.0})
    rows[1]["time/sampling_seconds"] = 2.0
    (b / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert sweep_lib.record_difference(a, b) is None
    rows[1]["bc/grad_norm"] = 6.791347026824951
    (b / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert sweep_lib.record_difference(a, b) == (
        "metric record 1 (step 2) differs from the committed one: "
        "bc/grad_norm 6.791347980499268 against 6.791347026824951"
    )


def test_the_probe_of_the_start_runs_after_it_and_its_record_lands(setup, tmp_path):
    from bpo_jax.study import tables

    sweep_file = setup(
        shared_bc=True, extra="bc_once=True, probe=Probe(algos=('rloo', 'bpo'), batches=8),"
    )
    workdir, records = tmp_path / "runs", tmp_path / "records"
    runs = sweep_lib.expand(sweep_lib.load_sweep(sweep_file))
    assert [r.name for r in runs] == ["bc/shared", "probe/shared", *NAMES]
    cmd = runs[1].command(workdir)
    assert cmd[2] == "bpo_jax.study.probe" and cmd[-2:] == ["--algos=rloo,bpo", "--batches=8"]
    assert f"--config.init_from={workdir / 'bc/shared'}" in cmd
    out = io.StringIO()
    statuses = sweep_lib.run_sweep(
        sweep_file, workdir, module="fake_main", probe_module="fake_probe", commit_to=records,
        out=out,
    )  # fmt: skip
    assert set(statuses.values()) == {"done"}
    assert "probe/shared: done (rc 0)" in out.getvalue()
    assert "trace-variance ratios rloo 1.000, bpo 2.000" in out.getvalue()
    probe = json.loads((records / "probe/shared/probe.json").read_text())
    assert probe["results"]["bpo"]["batches"] == 8
    # Table 2 reads it (a probe folder, not a run: no summary.json).
    found = tables.find_probes(records)
    assert [(p.path.name, p.seed) for p in found] == [("shared", 0)]
    assert tables.build_table2(found)["algorithms"]["bpo"]["mean"] == 2.0
    # Resumed on a fresh machine: the committed probe.json is enough; nothing runs.
    statuses = sweep_lib.run_sweep(
        sweep_file, tmp_path / "fresh", module="fake_main", probe_module="fake_probe",
        commit_to=records, out=io.StringIO(),
    )  # fmt: skip
    assert set(statuses.values()) == {"done"} and not (tmp_path / "fresh/bc").exists()
    with pytest.raises(ValueError, match="Sweep.probe needs shared_bc"):
        sweep_lib.expand(sweep_lib.Sweep("x.py", ("bpo",), (0,), probe=sweep_lib.Probe()))


def test_bc_once_and_share_evals_are_checked(setup, tmp_path):
    base = dict(config="x.py:cpu", algos=("bpo",), seeds=(0,))
    with pytest.raises(ValueError, match="bc_once needs shared_bc"):
        sweep_lib.expand(sweep_lib.Sweep(**base, bc_once=True))
    with pytest.raises(ValueError, match="must not set eval.cache_dir"):
        sweep_lib.expand(
            sweep_lib.Sweep(**base, share_evals=True, overrides={"eval.cache_dir": "/x"})
        )
