"""Benchmark on a real size: SmolLM2-135M-Instruct (30 layers, width 576, vocabulary 49,152),
ours against Hugging Face transformers on the same GGUF weights, float32, the same CPU cores.

(a) An agent turn: a batch of prompts, their prefill, then N new tokens decoded greedily (no
stop token, so every row decodes all N). Ours: `bpo_jax.sampler.Sampler` (`prefill`, then
`generate` at temperature 0) as the main job's CPU variant runs it, one program over the batch.
HF: `generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`, and `generate` of one
token (prefill and the first token), whose difference is HF's decode of the other N - 1. Same
prompts (random token ids, fixed seed), same N; the greedy tokens of both are compared.

(b) The update's training tokens/s on one batch of sequences: ours is the learner's update
(`learner.RLUpdater.update`: the behaviour log-prob pass, then the jitted forward + backward
and AdamW step of the clipped policy gradient) with the main job's CPU settings for this model
(`experiments/alfworld.py:cpu,model=smollm2_135m`, one minibatch of all rows, every advantage
nonzero); its log-prob pass is also timed alone, so the train step alone (update minus that
pass) is reported too. Torch: forward + backward of the same model on the same tokens (a
cross-entropy over every position: the same matmuls), gradients zeroed between rounds, no
optimizer step, so the torch side does less than ours' train step.

FLOP/s count 2 per matmul parameter per token plus attention (4 * layers * heads * head_dim
per attended key); backward counts twice the forward. The matmul peak is the best float32
2048^3 `jnp` matmul timed in each round of this run. The sides run in interleaved rounds and
are summarised by their median, because machines are shared; the load average is recorded at
the start, after each round and at the end. Only ratios measured in the same run compare.

    nice -n 19 .venv/bin/python bench/bench_smollm2.py \
        --json bench/results/smollm2_$(date +%F)_loaded.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from bench_sampler import check_parity, matmul_peak  # noqa: E402  (bench/ is the script's folder)
from bench_sampler_turns import hf_sample, layer_matmul_params  # noqa: E402
from flax import nnx  # noqa: E402

from bpo_jax import learner  # noqa: E402
from bpo_jax.config import validate  # noqa: E402
from bpo_jax.experiment import load_experiment  # noqa: E402
from bpo_jax.io import gguf_file  # noqa: E402
from bpo_jax.models.gguf import load_gguf  # noqa: E402
from bpo_jax.models.kv_cache import init_cache  # noqa: E402
from bpo_jax.sampler import Sampler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GGUF = "smollm2_135m_instruct"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4, help="turn: prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="turn: tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=16, help="turn: greedy tokens per row")
    p.add_argument("--update-rows", type=int, default=4, help="update: sequences")
    p.add_argument("--update-len", type=int, default=128, help="update: tokens per sequence")
    p.add_argument("--action-len", type=int, default=32, help="update: trained tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_params(cfg) -> int:
    """Parameters of one token's matmuls: the decoder layers' projections and the LM head."""
    return layer_matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size


def forward_flops(cfg, rows: int, start: int, tokens: int) -> float:
    """Forward FLOPs of `tokens` positions per row after `start` cached ones (causal)."""
    keys = np.arange(start + 1, start + tokens + 1).sum()  # Keys each position attends.
    per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim
    return float(rows * (2 * matmul_params(cfg) * tokens + per_key * keys))


def settle(seconds: float = 0.3) -> None:
    """Lets the other side's thread pool go idle before a timed run."""
    time.sleep(seconds)


def main():
    args = parse_args()
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    rows, length = args.update_rows, args.update_len
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    t_start = time.perf_counter()

    # ------------------------------------------------------------ the same weights on both sides
    path = gguf_file.locate(GGUF)
    cfg, model = load_gguf(GGUF, max_seq_len=max(p + n, length))
    graphdef, params = nnx.split(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(gguf_file=path.name, dequantize=True),
    ).eval()
    rng = np.random.default_rng(0)
    # Ordinary vocabulary ids (the first ids are special tokens).
    prompts = rng.integers(100, cfg.vocab_size, (b, p), dtype=np.int64)
    parity = check_parity(hf, model, prompts[:2])

    # ------------------------------------------------------------ (a) the turn
    sampler = Sampler(graphdef, eos_ids=(), pad_id=0, max_new_tokens=n, temperature=0.0)
    input_ids = torch.from_numpy(prompts)
    attention_mask = torch.ones_like(input_ids)

    def ours_turn():
        cache = jax.block_until_ready(init_cache(cfg, b, p + n))
        settle()
        start = time.perf_counter()
        state = sampler.prefill(params, cache, prompts)
        jax.block_until_ready(state.last_logits)
        mid = time.perf_counter()
        out = sampler.generate(params, state, jax.random.key(0))  # Host arrays: it has waited.
        end = time.perf_counter()
        if out.num_generated != b * n:
            raise SystemExit(f"Our sampler generated {out.num_generated} tokens, not {b * n}.")
        return (mid - start, end - mid), out.tokens, out.num_steps

    def hf_generate(num_new):
        return hf_sample(hf, input_ids, attention_mask, num_new, temperature=0.0)

    def hf_turn():
        settle()
        start = time.perf_counter()
        out = hf_generate(n)
        full = time.perf_counter() - start
        settle()
        start = time.perf_counter()
        hf_generate(1)
        return (full, time.perf_counter() - start), out[:, p:].numpy()

    # ------------------------------------------------------------ (b) the update
    base = load_experiment(ROOT / "experiments" / "alfworld.py").get_config(
        "cpu,model=smollm2_135m"
    )
    base.train.minibatch_size = rows
    base.sampler.length_bucket = length
    ucfg = validate(base)
    updater = learner.RLUpdater(graphdef, ucfg, 0, lambda *_: None)
    tokens = rng.integers(100, cfg.vocab_size, (rows, length), dtype=np.int64)
    signs = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
    examples = [
        learner.Example(tokens[i].tolist(), length - args.action_len, float(signs[i]), 1.0)
        for i in range(rows)
    ]
    tokens_j = jnp.asarray(tokens, jnp.int32)

    def ours_update():
        copy = jax.tree.map(jnp.array, params)
        state = learner.TrainState(copy, updater.optimizer.init(copy), jnp.zeros((), jnp.int32))
        jax.block_until_ready(state)
        settle()
        start = time.perf_counter()
        state, metrics = updater.update(state, examples, seed=(0, 0))
        jax.block_until_ready(state.params)
        whole = time.perf_counter() - start
        settle()
        start = time.perf_counter()
        jax.block_until_ready(updater.logprob_fn(state.params, tokens_j))
        scoring = time.perf_counter() - start
        if not metrics or not metrics[0]["grad_norm"] > 0:
            raise SystemExit(f"Our update had no gradient: {metrics}")
        return whole, scoring

    hf_train = hf  # The same module: Llama has no dropout, so eval mode trains the same way.
    input_train = torch.from_numpy(tokens)

    def torch_update():
        hf_train.zero_grad(set_to_none=True)
        settle()
        start = time.perf_counter()
        loss = hf_train(input_train, labels=input_train).loss
        loss.backward()
        return time.perf_counter() - start

    # ------------------------------------------------------------ warm-up, then interleave
    warm = {}
    t0 = time.perf_counter()
    _, ours_tokens, steps = ours_turn()
    warm["ours_turn_s"] = time.perf_counter() - t0
    (_, _), hf_tokens = hf_turn()
    t0 = time.perf_counter()
    ours_update()
    warm["ours_update_s"] = time.perf_counter() - t0
    torch_update()
    matmul_peak(repeats=1)
    print(f"warm-up done in {time.perf_counter() - t_start:.0f} s (load and compile)", flush=True)
    raw = {"ours_turn": [], "hf_turn": [], "ours_update": [], "torch_update": []}
    peaks, loads = [], []
    for r in range(args.repeats):
        raw["ours_turn"].append(ours_turn()[0])
        raw["hf_turn"].append(hf_turn()[0])
        raw["ours_update"].append(ours_update())
        raw["torch_update"].append(torch_update())
        peaks.append(matmul_peak())
        loads.append(os.getloadavg()[0])
        print(
            f"round {r + 1}/{args.repeats}: ours prefill/decode "
            f"{raw['ours_turn'][-1][0]:.2f}/{raw['ours_turn'][-1][1]:.2f} s, HF generate({n})/(1) "
            f"{raw['hf_turn'][-1][0]:.2f}/{raw['hf_turn'][-1][1]:.2f} s; ours update/scoring "
            f"{raw['ours_update'][-1][0]:.2f}/{raw['ours_update'][-1][1]:.2f} s, torch fwd+bwd "
            f"{raw['torch_update'][-1]:.2f} s; matmul {peaks[-1] / 1e9:.1f} GFLOP/s; "
            f"load average {loads[-1]:.1f}",
            flush=True,
        )
    load_end = os.getloadavg()
    peak = max(peaks)
    med = statistics.median

    o_pre = med(t[0] for t in raw["ours_turn"])
    o_dec = med(t[1] for t in raw["ours_turn"])
    h_full = med(t[0] for t in raw["hf_turn"])
    h_first = med(t[1] for t in raw["hf_turn"])
    h_dec = med(t[0] - t[1] for t in raw["hf_turn"])
    pre_flops = forward_flops(cfg, b, 0, p)
    # Decode: our generate runs `steps` forward passes (N: the first token comes from the
    # prefill's logits, the last pass puts the N-th token in the cache); HF's generate(N) minus
    # generate(1) is N - 1 passes. Decode tokens/s count forward passes x rows on each side.
    dec_flops = forward_flops(cfg, b, p + 1, steps)
    turn_flops = forward_flops(cfg, b, 0, p) + dec_flops
    ours_tps = b * n / (o_pre + o_dec)
    hf_tps = b * n / h_full
    o_upd = med(t[0] for t in raw["ours_update"])
    o_score = med(t[1] for t in raw["ours_update"])
    o_step = med(t[0] - t[1] for t in raw["ours_update"])
    t_upd = med(raw["torch_update"])
    train_tokens = rows * length
    fwd = forward_flops(cfg, rows, 0, length)
    agree = float(np.mean(ours_tokens == hf_tokens))
    results = {
        "setup": {
            "model": GGUF,
            "matmul_params": matmul_params(cfg),
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size,
            "dtype": "float32",
            "turn": {"batch": b, "prompt_len": p, "new_tokens": n, "greedy": True},
            "update": {"rows": rows, "len": length, "action_len": args.action_len},
            "repeats": args.repeats,
            "parity_max_abs_logit_diff": parity,
            "greedy_tokens_identical_fraction": agree,
            "machine": {
                "cpu": cpu_name(),
                "cores": threads,
                "loadavg_start": load_start,
                "loadavg_end": load_end,
                "loadavg_1min_per_round": loads,
                "loaded": True,
            },
            "torch_threads": threads,
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "wall_s": time.perf_counter() - t_start,
        },
        "matmul_peak_flops_per_s": peak,
        "turn": {
            "ours": {
                "prefill_s": o_pre,
                "decode_s": o_dec,
                "tokens_per_s": ours_tps,
                "decode_steps": steps,
                "decode_tokens_per_s": b * steps / o_dec,
                "prefill_fraction_of_peak": pre_flops / o_pre / peak,
                "decode_fraction_of_peak": dec_flops / o_dec / peak,
                "turn_fraction_of_peak": turn_flops / (o_pre + o_dec) / peak,
                "first_call_s": warm["ours_turn_s"],
            },
            "hf": {
                "generate_s": h_full,
                "prefill_and_first_token_s": h_first,
                "decode_s": h_dec,
                "tokens_per_s": hf_tps,
                "decode_tokens_per_s": b * (n - 1) / h_dec,
                "turn_fraction_of_peak": turn_flops / h_full / peak,
            },
            "speedup": ours_tps / hf_tps,
            "decode_speedup": (b * steps / o_dec) / (b * (n - 1) / h_dec),
        },
        "update": {
            "ours": {
                "update_s": o_upd,
                "scoring_s": o_score,
                "step_s": o_step,
                "update_tokens_per_s": train_tokens / o_upd,
                "step_tokens_per_s": train_tokens / o_step,
                "step_fraction_of_peak": 3 * fwd / o_step / peak,
                "first_call_s": warm["ours_update_s"],
            },
            "torch_forward_backward": {
                "s": t_upd,
                "tokens_per_s": train_tokens / t_upd,
                "fraction_of_peak": 3 * fwd / t_upd / peak,
            },
            "step_speedup": t_upd / o_step,
            "update_speedup": t_upd / o_upd,
        },
        "raw_s": raw,
    }
    t, u = results["turn"], results["update"]
    print()
    print(
        f"SmolLM2-135M float32 on {cpu_name()} ({threads} cores), median of {args.repeats}; "
        f"load average {load_start[0]:.1f} -> {load_end[0]:.1f}; matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s; parity {parity:.1e}, greedy tokens identical {agree:.0%}"
    )
    print(
        f"turn ({b} x {p} + {n} greedy): ours {ours_tps:.1f} tok/s "
        f"({t['ours']['turn_fraction_of_peak']:.0%} of peak; prefill "
        f"{t['ours']['prefill_fraction_of_peak']:.0%}, decode "
        f"{t['ours']['decode_fraction_of_peak']:.0%}), HF {hf_tps:.1f} tok/s "
        f"({t['hf']['turn_fraction_of_peak']:.0%}): {t['speedup']:.2f}x; decode alone "
        f"{t['decode_speedup']:.2f}x"
    )
    print(
        f"update ({rows} x {length} tokens): ours {u['ours']['update_tokens_per_s']:.0f} tok/s "
        f"whole update, {u['ours']['step_tokens_per_s']:.0f} tok/s train step "
        f"({u['ours']['step_fraction_of_peak']:.0%} of peak); torch fwd+bwd "
        f"{u['torch_forward_backward']['tokens_per_s']:.0f} tok/s "
        f"({u['torch_forward_backward']['fraction_of_peak']:.0%}): step {u['step_speedup']:.2f}x, "
        f"whole update {u['update_speedup']:.2f}x"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
