"""The sampler on an agent's turn shape against Hugging Face `generate` (`--shape=turn`).

An agent's turn is prefill-heavy: B rows, each a prompt of P tokens whose first S tokens are
shared by a group of G rows (a task's head: task, goal, first observation), then N new tokens;
T turns, each with new suffixes after the same heads. Per turn, timed as one pass each:
  * ours: `PrefixCache.prefill` (the heads are prefilled once, on the first turn; afterwards
    each row continues its previous turn's context and runs only its new suffix) and
    `generate`, each blocked on its result;
  * ours without reuse (the policy before prefix reuse): every prompt prefilled from a fresh
    cache each turn;
  * HF: `generate(max_new_tokens=N)` on the whole prompts (its own KV cache within a call).
Turn tokens/s = B * N * T / (time of all T turns). Separately, once per round, the prefill of
one whole B x P batch is timed on both sides: ours `Sampler.prefill` from a fresh cache, HF one
forward pass with its cache (`use_cache=True`, `logits_to_keep=1`, as `generate` runs it).

Prefill FLOPs count what the model must do for the tokens run: 2 * (layer matmul parameters)
per token, attention 4 * layers * heads * head_dim * (keys attended) per token (its causal
context), and the LM head for each row's last token. The fraction of peak divides the FLOP/s by
the best float32 jnp matmul (2048^3) timed in each round of the same run.

Two shapes (`bench_sampler.py --shape=...`):
  * `turn` (`TURN`): ALFWorld's CPU setting: a prompt of up to 320 tokens, actions of 8-16.
  * `paper_turn` (`PAPER_TURN`): the paper setting (prompts up to 4,096 tokens, 64-token
    actions, 8 rollouts a task) scaled to the tiny model. Lengths are divided by 4 for the
    prompt (a 1,024-token prompt, the tiny model's position range) and by 2 for the action (32
    tokens: a 64:1 prompt-to-action ratio would leave 16 decode steps, fewer than the turn
    shape's, and measure almost only prefill). Three quarters of the prompt (768 tokens) is
    shared by a group of 8 rows: the task's head and the history its rollouts have in common,
    which dominates a 4,096-token prompt late in a 50-turn episode. 6 turns a round (the
    HF side of one round runs about a minute on 2 cores).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import torch

from bpo_jax.models.llama import init_cache
from bpo_jax.sampler import PrefixCache, Sampler, bucket_length

# Per shape (the defaults of bench_sampler.py's flags): prompt tokens, tokens shared by a group,
# rows per group, new tokens, turns per round. The batch is --batch (16) in both.
TURN = {"prompt_len": 320, "shared": 192, "group": 4, "new_tokens": 16, "turns": 12}
PAPER_TURN = {"prompt_len": 1024, "shared": 768, "group": 8, "new_tokens": 32, "turns": 6}


def turn_prompts(args, vocab: int, turn: int) -> list[np.ndarray]:
    """Turn `turn`'s B prompts: a group's fixed head of S tokens, then a fresh suffix."""
    heads = np.random.default_rng(0).integers(0, vocab, (args.batch // args.group, args.shared))
    suffix = np.random.default_rng(1 + turn).integers(
        0, vocab, (args.batch, args.prompt_len - args.shared)
    )
    return [np.concatenate([heads[b // args.group], suffix[b]]) for b in range(args.batch)]


def hf_sample(hf, ids, attention_mask, num_new: int, temperature: float):
    """HF's `generate` as our sampler samples: exactly `num_new` tokens a row at `temperature`
    (greedy at 0), no top-k or top-p cut."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    with torch.inference_mode():
        return hf.generate(
            ids,
            attention_mask=attention_mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=0,
            **(sampling if temperature > 0 else dict(do_sample=False)),
        )


def layer_matmul_params(cfg) -> int:
    """Parameters of one token's matmuls in the decoder layers (the LM head not included)."""
    d, h, k, e, f = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.resolved_head_dim,
        cfg.intermediate_size,
    )
    return cfg.num_layers * (d * (h + 2 * k) * e + h * e * d + 3 * d * f)


def prefill_flops(cfg, offsets: np.ndarray, new: np.ndarray) -> float:
    """FLOPs a prefill must do for `new[b]` tokens of row b after `offsets[b]` cached ones."""
    per_key = 4 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim
    total = 0.0
    for o, n in zip(offsets.tolist(), new.tolist()):
        if n == 0:
            continue
        keys = (o + 1 + o + n) * n / 2  # Query at position p attends to p + 1 keys.
        total += (
            2 * layer_matmul_params(cfg) * n
            + per_key * keys
            + 2 * cfg.vocab_size * (cfg.hidden_size)
        )
    return total


def run(args, cfg, graphdef, params, hf, mesh, replicated, matmul_peak, settle):
    """Times the turn shape on both sides in interleaved rounds; returns the results dict."""
    b, n, turns = args.batch, args.new_tokens, args.turns
    if b % args.group or not 0 < args.shared < args.prompt_len:
        raise SystemExit("--batch must be a multiple of --group and 0 < --shared < --prompt-len.")
    capacity = bucket_length(args.prompt_len + n, 64)
    sampler = Sampler(
        graphdef, eos_ids=(), pad_id=0, max_new_tokens=n, temperature=args.temperature
    )
    weights = replicated if mesh is not None else params
    prompts = [turn_prompts(args, cfg.vocab_size, t) for t in range(turns)]

    def new_cache(rows):
        return init_cache(cfg, rows, capacity, mesh=mesh)

    def ours(seed, reuse):
        prefixes = PrefixCache(sampler, new_cache)
        pre_s = dec_s = 0.0
        tokens = flops = 0
        for t in range(turns):
            settle(0.05)
            cache = None if reuse else jax.block_until_ready(new_cache(b))
            start = time.perf_counter()
            if reuse:
                state = prefixes.prefill(weights, prompts[t])
            else:
                state = sampler.prefill(weights, cache, prompts[t])
            jax.block_until_ready(state.last_logits)
            mid = time.perf_counter()
            out = sampler.generate(weights, state, jax.random.key(seed * 1000 + t))
            end = time.perf_counter()
            if out.num_generated != b * n:
                raise SystemExit(f"Our sampler generated {out.num_generated}, not {b * n}.")
            pre_s, dec_s = pre_s + mid - start, dec_s + end - mid
            tokens += state.prefilled_tokens
            flops += _turn_flops(cfg, args, t, reuse, state, prefixes)
        return {"prefill_s": pre_s, "decode_s": dec_s, "prefilled": tokens, "flops": flops}

    def hf_turns():
        total = 0.0
        for t in range(turns):
            ids = torch.from_numpy(np.stack(prompts[t]))
            settle(0.05)
            start = time.perf_counter()
            out = hf_sample(hf, ids, torch.ones_like(ids), n, args.temperature)
            total += time.perf_counter() - start
            if out.shape != (b, args.prompt_len + n):
                raise SystemExit(f"HF generated shape {tuple(out.shape)}.")
        return total

    whole = np.stack(prompts[0])

    def ours_whole_prefill():
        cache = jax.block_until_ready(new_cache(b))
        settle(0.2)
        start = time.perf_counter()
        jax.block_until_ready(sampler.prefill(weights, cache, whole).last_logits)
        return time.perf_counter() - start

    def hf_whole_prefill():
        ids = torch.from_numpy(whole)
        settle(0.2)
        start = time.perf_counter()
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    # Warm-up (compiles every shape the timed rounds use), then interleaved rounds.
    ours(0, True)
    ours(0, False)
    hf_turns()
    ours_whole_prefill()
    hf_whole_prefill()
    rounds = {"ours": [], "ours_no_reuse": [], "hf": [], "ours_prefill": [], "hf_prefill": []}
    peaks = []
    for r in range(args.repeats):
        rounds["ours"].append(ours(r + 1, True))
        rounds["ours_no_reuse"].append(ours(r + 1, False))
        rounds["hf"].append(hf_turns())
        rounds["ours_prefill"].append(ours_whole_prefill())
        rounds["hf_prefill"].append(hf_whole_prefill())
        peaks.append(matmul_peak(repeats=2))
        print(
            f"round {r + 1}/{args.repeats}: {turns} turns ours "
            f"{_total(rounds['ours'][-1]):.2f} s (prefill {rounds['ours'][-1]['prefill_s']:.2f}),"
            f" without reuse {_total(rounds['ours_no_reuse'][-1]):.2f} s, HF "
            f"{rounds['hf'][-1]:.2f} s; whole prefill ours {rounds['ours_prefill'][-1]:.3f} s, "
            f"HF {rounds['hf_prefill'][-1]:.3f} s",
            flush=True,
        )
    med = statistics.median
    peak = max(peaks)
    gen = b * n * turns

    def side(rows):
        total = med(_total(x) for x in rows)
        pre = med(x["prefill_s"] for x in rows)
        return {
            "turn_s": total / turns,
            "prefill_s_per_turn": pre / turns,
            "decode_s_per_turn": med(x["decode_s"] for x in rows) / turns,
            "tokens_per_s": gen / total,
            "prefilled_tokens_per_turn": rows[0]["prefilled"] / turns,
            "prefill_flops_per_s": rows[0]["flops"] / pre,
            "prefill_fraction_of_peak": rows[0]["flops"] / pre / peak,
        }

    o, o_plain = side(rounds["ours"]), side(rounds["ours_no_reuse"])
    hf_tps = gen / med(rounds["hf"])
    whole_flops = prefill_flops(cfg, np.zeros(b, np.int64), np.full(b, args.prompt_len))
    o_pre, h_pre = med(rounds["ours_prefill"]), med(rounds["hf_prefill"])
    results = {
        "shape": args.shape,
        "setup": {
            "batch": b,
            "prompt_len": args.prompt_len,
            "shared_prefix": args.shared,
            "group": args.group,
            "new_tokens": n,
            "turns": turns,
            "repeats": args.repeats,
            "capacity": capacity,
            "replicas": args.replicas,
        },
        "ours": o,
        "ours_no_reuse": o_plain,
        "hf": {"turn_s": med(rounds["hf"]) / turns, "tokens_per_s": hf_tps},
        "turn_speedup": o["tokens_per_s"] / hf_tps,
        "turn_speedup_no_reuse": o_plain["tokens_per_s"] / hf_tps,
        "prefilled_tokens_per_turn": o["prefilled_tokens_per_turn"],
        "prompt_tokens_per_turn": b * args.prompt_len,
        "prefill_fraction_of_peak": o["prefill_fraction_of_peak"],
        "whole_prefill": {
            "ours_s": o_pre,
            "hf_s": h_pre,
            "speedup_vs_hf": h_pre / o_pre,
            "ours_fraction_of_peak": whole_flops / o_pre / peak,
            "hf_fraction_of_peak": whole_flops / h_pre / peak,
        },
        "matmul_peak_flops_per_s": peak,
        "raw": rounds,
    }
    print()
    print(
        f"turn shape: batch {b}, prompt {args.prompt_len} ({args.shared} shared by {args.group} "
        f"rows), {n} new tokens, {turns} turns; median of {args.repeats} rounds"
    )
    print(f"{'':28}{'tok/s':>9}{'ratio':>8}{'prefilled/turn':>16}{'prefill % peak':>16}")
    for name, s in (("ours (prefix reuse)", o), ("ours, no reuse (before)", o_plain)):
        print(
            f"{name:28}{s['tokens_per_s']:9.0f}{s['tokens_per_s'] / hf_tps:8.2f}"
            f"{s['prefilled_tokens_per_turn']:16.0f}{100 * s['prefill_fraction_of_peak']:15.1f}%"
        )
    print(f"{'HF generate':28}{hf_tps:9.0f}{1.0:8.2f}{b * args.prompt_len:16d}{'-':>16}")
    w = results["whole_prefill"]
    print(
        f"whole {b} x {args.prompt_len} prefill: ours {o_pre:.3f} s "
        f"({100 * w['ours_fraction_of_peak']:.1f}% of peak), HF forward {h_pre:.3f} s "
        f"({100 * w['hf_fraction_of_peak']:.1f}%): {w['speedup_vs_hf']:.2f}x HF; matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s"
    )
    return results


def _turn_flops(cfg, args, turn, reuse, state, prefixes) -> float:
    """The FLOPs the prefill of this turn had to do, by the tokens it ran at their offsets."""
    new = state.prefilled_b.astype(np.int64)
    offsets = np.full(args.batch, args.prompt_len) - new
    flops = prefill_flops(cfg, offsets, new)
    if reuse and prefixes.last_shared_tokens:
        # The heads prefilled once (one row per group), counted on the first row above.
        heads = args.batch // args.group
        new = new.copy()
        new[0] -= prefixes.last_shared_tokens
        offsets = np.full(args.batch, args.prompt_len) - new
        flops = prefill_flops(cfg, offsets, new) + prefill_flops(
            cfg, np.zeros(heads, np.int64), np.full(heads, args.shared)
        )
    return flops


def _total(x) -> float:
    return x["prefill_s"] + x["decode_s"]
