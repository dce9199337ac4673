"""The RL update on the real SmolLM2-135M-Instruct with and without LoRA, on this machine.

Both updaters come from the experiment config (`experiments/alfworld.py:cpu,model=smollm2_135m`)
through `builders.build_model`, as a run builds them: full fine-tuning (every weight in
`model.param_dtype`, AdamW over all of them) and `model.lora.rank=R` (adapters on every
projection over a base frozen in `model.dtype`, AdamW over the adapters only). Each times
`learner.RLUpdater.update` (the behaviour log-prob pass, then the jitted forward and backward
and the optimizer step) on the same batch of random ordinary-vocabulary tokens, in interleaved
rounds after one untimed update each (compilation); the median over rounds is reported as
trained tokens/s (`--action-len` tokens per row carry the loss) and whole tokens/s.

    nice -n 19 .venv/bin/python bench/bench_lora_update.py --rows 4 --length 128 \
        --json bench/results/lora_update_smollm2_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_smollm2 import cpu_name  # noqa: E402
from flax import nnx  # noqa: E402

from bpo_jax import builders, learner  # noqa: E402
from bpo_jax.config import validate  # noqa: E402
from bpo_jax.experiment import load_experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4, help="sequences in the batch")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--action-len", type=int, default=32, help="trained tokens per row")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def updater_for(rank: int, rows: int, length: int):
    """(updater, parameters, vocabulary size) of the real model at LoRA `rank` (0: full)."""
    raw = load_experiment(ROOT / "experiments" / "alfworld.py").get_config("cpu,model=smollm2_135m")
    raw.train.minibatch_size = rows
    raw.sampler.length_bucket = length
    raw.model.max_seq_len = max(raw.model.max_seq_len, length)
    raw.model.lora.rank = rank
    cfg = validate(raw)
    mcfg, model = builders.build_model(cfg, None, None)
    graphdef, params = nnx.split(model)
    updater = learner.RLUpdater(graphdef, cfg, 0, lambda *_: None)
    return updater, params, mcfg.vocab_size


def main():
    args = parse_args()
    rows, length = args.rows, args.length
    load_start = os.getloadavg()
    rng = np.random.default_rng(0)
    sides = {
        "full": updater_for(0, rows, length),
        f"lora{args.rank}": updater_for(args.rank, rows, length),
    }
    vocab = sides["full"][2]
    tokens = rng.integers(100, vocab, (rows, length), dtype=np.int64)
    signs = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
    examples = [
        learner.Example(tokens[i].tolist(), length - args.action_len, float(signs[i]), 1.0)
        for i in range(rows)
    ]

    def timed(name):
        updater, params, _ = sides[name]
        copy = jax.tree.map(jnp.array, params)
        state = learner.TrainState(copy, updater.optimizer.init(copy), jnp.zeros((), jnp.int32))
        jax.block_until_ready(state)
        time.sleep(0.3)
        start = time.perf_counter()
        state, metrics = updater.update(state, examples, seed=(0, 0))
        jax.block_until_ready(state.params)
        seconds = time.perf_counter() - start
        if not metrics or not metrics[0]["grad_norm"] > 0:
            raise SystemExit(f"{name}: the update had no gradient: {metrics}")
        return seconds

    warm = {name: timed(name) for name in sides}  # Compilation.
    seconds = {name: [] for name in sides}
    for r in range(args.repeats):
        for name in sides if r % 2 == 0 else reversed(list(sides)):
            seconds[name].append(timed(name))
    trainable = {
        name: int(sum(x.size for x in jax.tree.leaves(learner.trainable(params))))
        for name, (_, params, _) in sides.items()
    }
    out = {
        "what": "learner.RLUpdater.update on SmolLM2-135M-Instruct (GGUF), CPU",
        "machine": {
            "cpu": cpu_name(),
            "cores": len(os.sched_getaffinity(0)),
            "load_before": load_start,
            "load_after": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": rows,
        "length": length,
        "action_len": args.action_len,
        "first_update_s": warm,
        "seconds": seconds,
        "median_s": {k: statistics.median(v) for k, v in seconds.items()},
        "trained_tokens_per_s": {
            k: rows * args.action_len / statistics.median(v) for k, v in seconds.items()
        },
        "tokens_per_s": {k: rows * length / statistics.median(v) for k, v in seconds.items()},
        "trainable_params": trainable,
    }
    lora = f"lora{args.rank}"
    out["lora_over_full_time"] = out["median_s"][lora] / out["median_s"]["full"]
    print(
        f"SmolLM2-135M update, {rows} x {length} tokens ({args.action_len} trained per row), "
        f"median of {args.repeats} on {out['machine']['cpu']}: full "
        f"{out['tokens_per_s']['full']:.0f} tok/s ({trainable['full']:,} trained parameters), "
        f"LoRA r{args.rank} {out['tokens_per_s'][lora]:.0f} tok/s ({trainable[lora]:,}); "
        f"LoRA / full time {out['lora_over_full_time']:.2f}; first updates (compile) "
        f"{warm['full']:.0f} / {warm[lora]:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
