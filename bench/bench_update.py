"""The RL update with and without the rows whose advantage is zero (`train.skip_zero_advantage`).

The CPU tables' update (`experiments/alfworld.py:cpu`: the tiny policy, 1,024-token vocabulary,
minibatches of 64 sequences, length buckets of 64) on batches shaped like the sweep's: each
batch takes the number of sequences and the fraction of them with a nonzero advantage of one
training iteration recorded under `results/alfworld_cpu/` (drawn with a fixed seed), random
tokens, prompt + action lengths uniform in [--min_len, --max_len] (the agent's prompts are
capped at 448 tokens, its actions at 16). Every batch is updated from the same parameters with
the rows kept (`skip_zero_advantage=False`) and left out (`True`), the order alternating, after
one unrecorded pass over all batches in both modes (compilation: leaving rows out pads them to
up to four row buckets, so more programs compile; their seconds are reported). Per batch:
update seconds in each mode, their ratio, the largest parameter difference between the two
results and their difference's norm over the norm of the kept update (float rounding, which
Adam's normalisation amplifies where a gradient coordinate is mostly rounding). Prints a table
and writes JSON.

  python bench/bench_update.py --batches 6 --out bench/results/update_skip.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bpo_jax import learner  # noqa: E402
from bpo_jax.config import validate  # noqa: E402
from bpo_jax.experiment import load_experiment  # noqa: E402
from bpo_jax.models import config as model_config  # noqa: E402
from bpo_jax.models.factory import create_model  # noqa: E402
from bpo_jax.rollout.timing import CompileClock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def recorded_batches(runs: Path) -> list[tuple[int, float]]:
    """(sequences, fraction with signal) of every recorded training iteration under `runs`."""
    out = []
    for path in sorted(runs.glob("*/seed_*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "train/num_sequences" in rec:
                out.append((int(rec["train/num_sequences"]), float(rec["train/steps_with_signal"])))
    if not out:
        raise SystemExit(f"No training records (metrics.jsonl with train/*) under {runs}.")
    return out


def make_examples(n, signal, rng, min_len, max_len, vocab, max_action):
    rows = rng.permutation(n)[: round(signal * n)]
    adv = np.zeros(n)
    adv[rows] = rng.choice([-1.0, 1.0], size=len(rows)) * rng.uniform(0.2, 1.0, size=len(rows))
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        action = int(rng.integers(2, max_action + 1))
        tokens = rng.integers(1, vocab, size=length).tolist()
        out.append(learner.Example(tokens, length - action, float(adv[i]), 1.0))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(ROOT / "results" / "alfworld_cpu"))
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--min_len", type=int, default=256)
    ap.add_argument("--max_len", type=int, default=464)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    recorded = recorded_batches(Path(args.runs))
    rng = np.random.default_rng(args.seed)
    picks = [recorded[i] for i in rng.choice(len(recorded), args.batches, replace=False)]
    base = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu")
    vocab, max_seq = base.model.tokenizer_vocab_size, base.model.max_seq_len
    mcfg = model_config.get_preset(base.model.preset, vocab_size=vocab, max_seq_len=max_seq)
    graphdef, params = nnx.split(create_model(mcfg, seed=0))
    batches = [
        make_examples(n, f, rng, args.min_len, args.max_len, vocab, base.agent.max_action_tokens)
        for n, f in picks
    ]
    updaters = {}
    for skip in (False, True):
        cfg = base.copy_and_resolve_references()
        cfg.train.skip_zero_advantage = skip
        updaters[skip] = learner.RLUpdater(graphdef, validate(cfg), 0, lambda *_: None)

    def run(skip, examples, b):
        updater = updaters[skip]
        p = jax.tree.map(jnp.array, params)
        state = learner.TrainState(p, updater.optimizer.init(p), jnp.zeros((), jnp.int32))
        c0, t0 = CompileClock.total(), time.perf_counter()
        state, _ = updater.update(state, examples, seed=(args.seed, b, 1))
        jax.block_until_ready(state.params)
        return state.params, time.perf_counter() - t0, CompileClock.total() - c0

    compile_s = {False: 0.0, True: 0.0}
    for b, examples in enumerate(batches):  # Warm-up: every shape compiles here.
        for skip in (False, True):
            compile_s[skip] += run(skip, examples, b)[2]
    rows = []
    for b, examples in enumerate(batches):
        order = (False, True) if b % 2 == 0 else (True, False)
        got = {skip: run(skip, examples, b) for skip in order}
        kept_p, skip_p, init_p = (jax.tree.leaves(t) for t in (got[False][0], got[True][0], params))
        diff = max(float(jnp.abs(x - y).max()) for x, y in zip(kept_p, skip_p))
        # The two updates' difference over the kept update's size (both as flat vectors).
        gap = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(kept_p, skip_p))
        moved = sum(float(jnp.sum((x - p0) ** 2)) for x, p0 in zip(kept_p, init_p))
        rows.append(
            {
                "sequences": picks[b][0],
                "signal": picks[b][1],
                "kept_s": got[False][1],
                "skipped_s": got[True][1],
                "ratio": got[False][1] / got[True][1],
                "compile_in_timed_s": got[False][2] + got[True][2],
                "max_param_diff": diff,
                "update_rel_diff": (gap / moved) ** 0.5 if moved else 0.0,
            }
        )
    print(
        f"{'sequences':>9} {'signal':>6} {'kept s':>7} {'skipped s':>9} {'ratio':>7} "
        f"{'max |dp|':>8} {'rel':>8}"
    )
    for r in rows:
        print(
            f"{r['sequences']:>9} {r['signal']:>6.2f} {r['kept_s']:>7.2f} {r['skipped_s']:>9.2f} "
            f"{r['ratio']:>7.2f} {r['max_param_diff']:>8.1e} {r['update_rel_diff']:>8.1e}"
        )
    kept = sum(r["kept_s"] for r in rows)
    skipped = sum(r["skipped_s"] for r in rows)
    summary = {
        "batches": rows,
        "kept_s_total": kept,
        "skipped_s_total": skipped,
        "ratio_total": kept / skipped,
        "warmup_compile_s": {"kept": compile_s[False], "skipped": compile_s[True]},
        "recorded_mean_signal": float(np.mean([f for _, f in recorded])),
        "recorded_mean_sequences": float(np.mean([n for n, _ in recorded])),
        "recorded_iterations": len(recorded),
        "lengths": [args.min_len, args.max_len],
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"total {kept:.1f} s kept, {skipped:.1f} s skipped: {kept / skipped:.2f}x; warm-up "
        f"compilation {compile_s[False]:.1f} s kept, {compile_s[True]:.1f} s skipped; recorded "
        f"signal fraction {summary['recorded_mean_signal']:.2f} over {len(recorded)} iterations"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
