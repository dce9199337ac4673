"""Tokens generated and prefilled per leaf: BPO trees against independent trajectories.

Plays ALFWorld tasks on the fork-server pool with the tiny policy (random, sharpened weights,
so that actions and entropies vary) as BPO trees (root group 2; branch points chosen by the
entropy rule, and at a fixed interval of 3 steps for comparison) and as independent groups with
as many trajectories per task as the entropy trees had leaves. A tree's leaves share their
prefixes: shared steps are generated once, and a branch point's prompt is prefilled once for
all of its children. Prints a table and writes JSON (`--out`).

  python bench/bench_tree_tokens.py --tasks 4 --out runs/bench_tree_tokens.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bpo_jax.agent import SPECIAL_SYMBOLS  # noqa: E402
from bpo_jax.models import config as model_config  # noqa: E402
from bpo_jax.models.llama import Transformer  # noqa: E402
from bpo_jax.rollout.branching import CostModel, LengthModel, make_selector  # noqa: E402
from bpo_jax.rollout.engine import TreeSpec, play_forest, prompt_encoder  # noqa: E402
from bpo_jax.sampler.policy import Policy  # noqa: E402
from bpo_jax.tokenizer import train_sentencepiece  # noqa: E402
from envs.alfworld import load_tasks  # noqa: E402
from envs.sandbox import SandboxPool  # noqa: E402


def make_policy(texts, workdir: Path, max_steps: int):
    tok = train_sentencepiece(texts, workdir / "sp", 512, user_defined_symbols=SPECIAL_SYMBOLS)
    cfg = model_config.tiny(vocab_size=tok.vocab_size, max_seq_len=512)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.tree.map_with_path(
        lambda p, x: x * (4.0 if "embed" in jax.tree_util.keystr(p) else 1.0), params
    )
    return Policy(graphdef, params, tok, cfg, max_new_tokens=12, cache_len=448, temperature=1.0)


def _mean_branch_step(forest) -> float:
    """Mean number of steps taken before a branch point (its depth in env steps)."""
    into = {seg.child: s for s, seg in enumerate(forest.segments) if seg.child >= 0}
    steps = []
    for node in into:
        n, seg = 0, into[node]
        while True:
            n += len(forest.segments[seg].steps)
            parent = forest.segments[seg].parent
            if parent not in into:
                break
            seg = into[parent]
        steps.append(n)
    return float(np.mean(steps)) if steps else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--branches", type=int, default=4, help="K children per branch point")
    ap.add_argument("--branch-budget", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_tree_tokens.json")
    args = ap.parse_args()
    root = os.environ.get("ALFWORLD_DATA")
    tasks = load_tasks(root, "train", limit=args.tasks, seed=0)
    workdir = Path(args.out).parent
    workdir.mkdir(parents=True, exist_ok=True)
    rows = {}
    with SandboxPool("alfworld", {"max_steps": args.max_steps}, backend="fork") as pool:
        texts = [obs for _, obs, _ in pool.reset_many(tasks)]
        texts += [" ".join(t.walkthrough) for t in tasks]
        for sid in pool.live():
            pool.close_sandbox(sid)
        policy = make_policy(texts * 20, workdir, args.max_steps)
        encode = prompt_encoder(policy.tokenizer, history_turns=2, max_prompt_tokens=384)
        lengths, costs = LengthModel(args.max_steps), CostModel("tokens")
        selector = make_selector("entropy", quantile=0.6, min_history=8)
        tree_spec = TreeSpec(
            root_group=2,
            num_branches=args.branches,
            branch_budget=args.branch_budget,
            max_depth=2,
        )
        # Warm the entropy threshold and length model with one batch of independent episodes,
        # as training does from its second iteration on; otherwise the first turns, where the
        # running quantile has barely any history, take the whole branch budget.
        warm = play_forest(
            pool, policy, encode, tasks, TreeSpec(root_group=2), rng=jax.random.key(2),
            lengths=lengths, costs=costs,
        )  # fmt: skip
        selector.observe([float(s.entropies[0]) for s in warm.steps() if s.entropies.size])
        for name, sel in (
            ("bpo_entropy", selector),
            ("bpo_interval3", make_selector("interval", interval=3)),
        ):
            t0 = time.time()
            tree = play_forest(
                pool, policy, encode, tasks, tree_spec, rng=jax.random.key(0), selector=sel,
                lengths=lengths, costs=costs,
            )  # fmt: skip
            rows[name] = (tree, time.time() - t0)
        tree = rows["bpo_entropy"][0]
        leaves = Counter(leaf.task for leaf in tree.leaves)
        group = max(2, round(np.mean(list(leaves.values()))))
        t0 = time.time()
        indep = play_forest(
            pool, policy, encode, tasks, TreeSpec(root_group=group), rng=jax.random.key(1)
        )
        rows["independent"] = (indep, time.time() - t0)
    report = {}
    print(
        f"{'topology':12} {'leaves':>6} {'branch@':>7} {'gen/leaf':>9} {'prefill/leaf':>13} "
        f"{'steps/leaf':>10}"
    )
    for name, (forest, seconds) in rows.items():
        n = len(forest.leaves)
        r = {
            "leaves": n,
            "branch_points": forest.num_branch_points,
            "mean_branch_step": _mean_branch_step(forest),
            "generated_per_leaf": forest.stats.generated_tokens / n,
            "prefilled_per_leaf": forest.stats.prefilled_tokens / n,
            "env_steps_per_leaf": forest.stats.env_steps / n,
            "seconds": seconds,
        }
        report[name] = r
        print(
            f"{name:12} {n:6d} {r['mean_branch_step']:7.2f} {r['generated_per_leaf']:9.1f} "
            f"{r['prefilled_per_leaf']:13.1f} "
            f"{r['env_steps_per_leaf']:10.2f}"
        )
    for name in rows:
        if name == "independent":
            continue
        savings = {
            key: 1.0 - report[name][key] / report["independent"][key]
            for key in ("generated_per_leaf", "prefilled_per_leaf", "env_steps_per_leaf")
        }
        report[name]["savings_vs_independent"] = savings
        print(
            "{}: {:.0%} fewer generated, {:.0%} fewer prefilled tokens, {:.0%} fewer env steps "
            "per leaf".format(
                name,
                savings["generated_per_leaf"],
                savings["prefilled_per_leaf"],
                savings["env_steps_per_leaf"],
            )
        )
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
