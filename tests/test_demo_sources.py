"""Choosing what behaviour cloning clones (`bc.demos`) and the development split
(`env.dev_fraction`): validation, the split itself, and a run that clones search demos."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest

from bpo_jax.builders import is_dev_task, select_tasks
from bpo_jax.config import validate
from bpo_jax.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]


def cpu_config(**overrides):
    cfg = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    for k, v in overrides.items():
        section, name = k.split(".")
        cfg[section][name] = v
    return cfg


def test_defaults_are_unchanged():
    v = validate(cpu_config())
    assert v.bc.demos == "walkthrough" and v.env.dev_fraction == 0 and v.eval.initial
    assert validate(cpu_config(**{"bc.demos": "search"})).bc.demos == "search"


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"bc.demos": "planner"}, r"config.bc.demos must be one of \('walkthrough', 'search'\)"),
        (
            {"bc.demos": "search", "env.task_types": ("pick_heat_then_place_in_recep",)},
            r"config.bc.demos='search' .* set env.task_types",
        ),
        ({"bc.demos": "search", "env.task_types": ()}, r"config.bc.demos='search'"),
        ({"env.dev_fraction": 1.0}, r"config.env.dev_fraction must be in \[0, 1\)"),
        ({"env.eval_split": "dev"}, r"config.env.eval_split names the 'dev' split"),
        ({"env.train_split": "dev"}, r"config.env.train_split names the 'dev' split"),
    ],
)
def test_bad_demo_and_dev_settings_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate(cpu_config(**overrides))


def test_search_demos_need_an_environment_with_a_searcher():
    cfg = load_experiment(ROOT / "experiments" / "webshop.py").get_config("cpu")
    cfg.bc.demos = "search"
    with pytest.raises(ValueError, match=r"config.bc.demos='search' needs a searching"):
        validate(cfg)
    cfg.bc.steps = 0  # Nothing is cloned: nothing to check.
    validate(cfg)


def test_dev_split_is_by_task_id_disjoint_and_seed_independent():
    assert not is_dev_task("train/x/y", 0.0)
    ids = [f"train/game-{i}/trial" for i in range(2000)]
    share = sum(is_dev_task(t, 0.3) for t in ids) / len(ids)
    assert 0.27 < share < 0.33
    assert all(is_dev_task(t, 0.5) for t in ids if is_dev_task(t, 0.3))  # Nested shares.

    def split(seed):
        over = {"env.dev_fraction": 0.3, "env.num_train_tasks": 0, "eval.num_tasks": 0}
        over |= {"env.eval_split": "dev,train"}
        cfg = validate(cpu_config(**over))
        return select_tasks(dataclasses.replace(cfg, seed=seed))

    train, evals = split(0)
    dev = evals["dev"]
    assert len(train) + len(dev) == 162  # The two CPU task types' training games.
    assert 35 <= len(dev) <= 65
    assert not {t.task_id for t in train} & {t.task_id for t in dev}
    assert all(t.split == "train" for t in dev)
    assert [t.task_id for t in evals["train"]] == [t.task_id for t in train]
    train2, evals2 = split(7)
    assert [t.task_id for t in evals2["dev"]] == [t.task_id for t in dev]
    assert sorted(t.task_id for t in train2) == sorted(t.task_id for t in train)


def test_training_on_the_dev_games_evaluates_on_them():
    """`env.train_split="dev"` (choosing settings in-distribution without the games a default
    run reports): the run trains on dev games, and its "dev" evaluation is its training games."""
    over = {"env.dev_fraction": 0.3, "env.train_split": "dev", "env.eval_split": "dev"}
    train, evals = select_tasks(validate(cpu_config(**over)))
    assert len(train) == 24 and all(is_dev_task(t.task_id, 0.3) for t in train)
    assert [t.task_id for t in evals["dev"]] == [t.task_id for t in train]


def test_behaviour_cloning_examples_from_search_demos():
    """The BC corpus of a search episode: one example per step, the expert's action last."""
    from bpo_jax.agent import SPECIAL_SYMBOLS
    from bpo_jax.agent.demos import bc_examples, corpus
    from bpo_jax.tokenizer import train_sentencepiece
    from envs.alfworld.search_expert import SearchExpert

    room = "You are in the middle of a room. Looking quickly around you, you see a desk 1.\n\n"
    goal = "Your task is to: look at cd under the desklamp."
    replies = [
        "You arrive at desk 1. On the desk 1, you see a cd 1, and a desklamp 1.",
        "You pick up the cd 1 from the desk 1.",
        "You turn on the desklamp 1.",
    ]
    expert, actions = SearchExpert(room + goal, goal), []
    for reply in replies:
        actions.append(expert.act())
        expert.observe(reply)
    demo = {
        "task_id": "t",
        "first_obs": room + goal,
        "goal": goal,
        "actions": actions,
        "observations": replies,
        "won": True,
    }
    assert actions == ["go to desk 1", "take cd 1 from desk 1", "use desklamp 1"]
    with tempfile.TemporaryDirectory() as d:
        texts = corpus([demo] * 4, 2)
        tok = train_sentencepiece(texts, Path(d) / "tok", 300, SPECIAL_SYMBOLS)
        examples = bc_examples([demo, {**demo, "won": False}], tok, 2, 256)
    assert len(examples) == 3  # The lost copy is not cloned.
    for (seq, start), action in zip(examples, actions):
        assert tok.decode(seq[start:-1]).strip() == action and seq[-1] == tok.eos_id


@pytest.mark.slow
def test_a_run_clones_search_demos(tmp_path):
    """Behaviour cloning from the searching demonstrator, end to end, on two training games."""
    from bpo_jax.io.metrics import read_metrics
    from bpo_jax.train import train_and_evaluate

    cfg = cpu_config(
        **{
            "bc.demos": "search",
            "bc.steps": 3,
            "bc.batch_size": 8,
            "env.num_train_tasks": 2,
            "env.max_steps": 40,
            "env.dev_fraction": 0.3,
            "env.eval_split": "dev",
            "eval.num_tasks": 1,
            "eval.initial": False,
            "train.iterations": 0,
            "agent.max_prompt_tokens": 192,
            "model.max_seq_len": 256,
        }
    )
    summary = train_and_evaluate(cfg, tmp_path)
    demos = json.loads((tmp_path / "search_demos.json").read_text())
    assert len(demos) == 2 and all(d["won"] for d in demos)
    assert not (tmp_path / "expert_demos.json").exists()
    assert summary["success_initial"] is None and summary["updates"] == 3
    assert summary["eval_tasks_per_split"] == {"dev": 1}
    assert [r["bc/loss"] for r in read_metrics(tmp_path) if "bc/loss" in r]


def test_wilson_ci_matches_hand_computed_values():
    from bpo_jax.study.stats import wilson_ci

    # 10 of 50: the textbook Wilson interval [0.1124, 0.3304]; 0 of n: [0, z^2 / (n + z^2)].
    assert wilson_ci(10, 50) == pytest.approx((0.11244, 0.33037), abs=1e-5)
    assert wilson_ci(0, 55) == pytest.approx((0.0, 1.95996**2 / (55 + 1.95996**2)), abs=1e-6)
    assert wilson_ci(55, 55)[1] == 1.0 and wilson_ci(0, 55)[0] == 0.0
    with pytest.raises(ValueError, match="0 <= wins <= n"):
        wilson_ci(3, 2)
