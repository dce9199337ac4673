"""Every experiment config loads and validates; the cpu variant trains end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
from absl import flags
from helpers import SMALL_RUN, set_fields

from bpo_jax.config import ALGOS, validate
from bpo_jax.experiment import define_config_flag, load_experiment, parse_variants

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.py"))
# The tiny `cpu` variants and the paper settings, each with every algorithm.
VARIANTS = [
    *(f"cpu,algo={a}" for a in ALGOS),
    "cpu",
    *(f"algo={a}" for a in ALGOS),
    "",
    "model=llama3_1_8b",
]


def launch_config(path, arg, *overrides):
    """The config `python -m bpo_jax.main --config=PATH:ARG OVERRIDES...` runs with."""
    argv = ["main", f"--config={path}:{arg}", *overrides]
    flag_values = flags.FlagValues()
    define_config_flag(flag_values, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


@pytest.mark.parametrize("arg", VARIANTS)
@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_variant_validates(path, arg):
    variants = parse_variants(arg)
    cpu = "cpu" in variants
    if not cpu:
        # The paper setting needs pretrained weights: validation names the missing field.
        with pytest.raises(ValueError, match="config.model.hf_checkpoint"):
            validate(launch_config(path, arg))
    overrides = [] if cpu else ["--config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct"]
    v = validate(launch_config(path, arg, *overrides))
    assert v.train.algo == variants.get("algo", "bpo")  # BPO is the default
    if cpu:
        assert v.model.preset == "tiny"
    else:
        assert v.model.preset == variants.get("model", "qwen2_5_7b")
        assert v.train.tasks_per_iter == 16 and v.train.group_size == 8


def test_parse_variants():
    assert parse_variants(None) == parse_variants(" , ") == {}
    assert parse_variants(" cpu , algo = rloo,model=tiny") == {
        "cpu": "true",
        "algo": "rloo",
        "model": "tiny",
    }
    assert parse_variants("smoke", known=("smoke",)) == {"smoke": "true"}
    with pytest.raises(ValueError, match=r"\['cpus'\] in 'cpus'; known: cpu, algo, model"):
        parse_variants("cpus")


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_unknown_variant_is_refused(path):
    with pytest.raises(ValueError, match=r"Unknown variant\(s\) \['turbo'\]"):
        load_experiment(path).get_config("cpu,turbo")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("train.lr", -1.0, "config.train.lr must be > 0"),
        ("train.group_size", 1, "config.train.group_size must be >= 2"),
        ("train.algo", "sarsa", "config.train.algo must be one of"),
        ("model.preset", "gpt5", "config.model.preset must be one of"),
        ("sampler.top_p", 0.0, r"config.sampler.top_p must be in \(0, 1\]"),
        ("agent.max_prompt_tokens", 5000, "must fit in model.max_seq_len"),
        ("env.sandbox_backend", "docker", "config.env.sandbox_backend must be one of"),
        ("mesh.sampler", "pod", "config.mesh.sampler must be one of"),
        # The default keeps prefix reuse, which slice-wide sampling cannot join across hosts.
        ("mesh.sampler", "slice", "set sampler.prefix_reuse=False"),
    ],
)
def test_invalid_values_name_the_field(field, value, match):
    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    section, name = field.split(".")
    cfg[section][name] = value
    with pytest.raises(ValueError, match=match):
        validate(cfg)


def tiny_cpu_config(**overrides):
    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    fields = {**SMALL_RUN, "env.max_steps": 4, "agent.max_prompt_tokens": 192}
    return set_fields(cfg, {**fields, **overrides})


def test_cpu_variant_runs_two_iterations(tmp_path):
    from bpo_jax.io.metrics import BRANCH_PARTS_FILE, read_json_lines, read_metrics
    from bpo_jax.train import train_and_evaluate

    summary = train_and_evaluate(tiny_cpu_config(), tmp_path)
    assert summary["iterations"] == 2
    for key in ("success_initial", "success_before_rl", "success_after_rl"):
        assert 0.0 <= summary[key] <= 1.0
    records = read_metrics(tmp_path)
    grad_norms = [r["update/grad_norm"] for r in records if "update/grad_norm" in r]
    assert grad_norms and all(g >= 0 for g in grad_norms)
    iters = [r for r in records if "train/iteration" in r]
    assert [r["train/iteration"] for r in iters] == [1, 2]
    assert all(r["compute/generated_tokens"] > 0 and r["compute/env_steps"] > 0 for r in iters)
    for r in iters:  # Where the time went.
        assert r["time/sampling_seconds"] > 0 and r["time/env_seconds"] > 0
        assert r["time/compile_seconds"] >= 0
        assert r["time/sampling_seconds"] + r["time/env_seconds"] <= r["train/rollout_seconds"]
        # At most num_workers steps run at once, so the rollout cannot beat its env floor.
        assert r["time/env_floor_seconds"] > 0 and r["time/rollout_over_floor"] >= 1.0
    # BPO (a tree) records f's parts per iteration (metrics, branch_parts.jsonl) and over the
    # run (summary.json): the batch's branch points in each.
    parts = read_json_lines(tmp_path / BRANCH_PARTS_FILE)
    assert [p["iteration"] for p in parts] == [1, 2]
    points = [r["train/f_parts/branch_points"] for r in iters]
    assert points == [sum(p["branch_points"]) for p in parts]
    assert points == [r["train/branch_points"] for r in iters]
    assert summary["f_parts"]["all"]["branch_points"] == sum(points)
    assert iters[0]["time/compile_seconds"] > 0  # The first iteration compiles the update.
    assert (tmp_path / "tokenizer.model").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["iterations"] == 2
    # What the job ends with (bpo_jax.report): RL's effect on the evaluation games, its compute,
    # the figure.
    assert summary["rl_effect"]["n"] == summary["eval_tasks"]
    assert summary["rl_spend"]["iterations"] == 2
    assert summary["figure"] == str(tmp_path / "curves.png") and (tmp_path / "curves.png").exists()


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_kl_reference_run_and_resume(tmp_path):
    """kl_coef > 0: the reference policy is kept, checkpointed, and restored on resume."""
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = tiny_cpu_config(**{"train.kl_coef": 0.1, "train.iterations": 1, "eval.num_tasks": 1})
    train_and_evaluate(cfg, tmp_path)
    kls = [r["train/kl_ref_mean"] for r in read_metrics(tmp_path) if "train/kl_ref_mean" in r]
    assert kls and all(k >= 0 for k in kls)
    first = json.loads((tmp_path / "evals.json").read_text())
    cfg.train.iterations = 2  # Resume the finished run for one more iteration.
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 2
    evals = json.loads((tmp_path / "evals.json").read_text())
    # The final evaluation is redone at the new parameters; the earlier ones are kept.
    assert evals["after_rl"]["eval/update_step"] == summary["updates"]
    assert first["after_rl"]["eval/update_step"] < summary["updates"]
    assert evals["before_rl"] == first["before_rl"]
    assert summary["rl_updates"] == summary["updates"] - cfg.bc.steps


@pytest.mark.parametrize("algo", ["bpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_tree_and_critic_algorithms_run(tmp_path, algo):
    """BPO grows trees on the fork-server ALFWorld pool; PPO fits its value head."""
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = tiny_cpu_config(
        **{
            "train.algo": algo,
            "eval.num_tasks": 1,
            "rollout.selector": "interval",  # Branch deterministically: the test must see trees.
            "rollout.interval": 1,
            "rollout.budget": 1e6,
        }
    )
    summary = train_and_evaluate(cfg, tmp_path)
    assert summary["iterations"] == 2
    iters = [r for r in read_metrics(tmp_path) if "train/iteration" in r]
    assert len(iters) == 2
    if algo == "bpo":
        assert all(r["train/branch_points"] > 0 for r in iters)
        assert all(r["train/leaves"] > cfg.rollout.root_group for r in iters)
    else:
        assert all(np.isfinite(r["train/value_loss"]) for r in iters)


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_init_from_and_held_out_splits(tmp_path):
    """RL starts from another run's policy (no BC of its own); every split is reported."""
    from bpo_jax.train import train_and_evaluate

    bc_dir, rl_dir = tmp_path / "bc", tmp_path / "rl"
    bc = tiny_cpu_config(**{"train.iterations": 0, "eval.num_tasks": 1})
    train_and_evaluate(bc, bc_dir)
    bc_evals = json.loads((bc_dir / "evals.json").read_text())
    cfg = tiny_cpu_config(
        **{
            "train.iterations": 1,
            "eval.num_tasks": 1,
            "eval.sampled": True,
            "env.eval_split": "train,valid_seen",
        }
    )
    cfg.init_from = str(bc_dir)
    summary = train_and_evaluate(cfg, rl_dir)
    evals = json.loads((rl_dir / "evals.json").read_text())
    assert "initial" not in evals  # No BC phase of its own.
    assert set(evals) >= {"before_rl/train", "before_rl/valid_seen", "after_rl/valid_seen/sampled"}
    assert summary["eval_tasks_per_split"] == {"train": 1, "valid_seen": 1}
    # The same policy and greedy decoding: the BC run's own evaluation on the same game.
    assert evals["before_rl/train"]["eval/episodes"] == bc_evals["after_rl/train"]["eval/episodes"]
    assert evals["before_rl/train"]["eval/task_ids"] == bc_evals["after_rl/train"]["eval/task_ids"]
    assert evals["before_rl"]["eval/num_episodes"] == 2
    assert (rl_dir / "tokenizer.model").read_bytes() == (bc_dir / "tokenizer.model").read_bytes()
    assert not (rl_dir / "expert_demos.json").exists()
    assert summary["iterations"] == 1


def test_init_from_must_be_a_run(tmp_path):
    cfg = tiny_cpu_config()
    cfg.init_from = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="config.init_from must be a run's workdir"):
        validate(cfg)
