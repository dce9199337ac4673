#!/usr/bin/env bash
# Accelerator check for one device (sized for one H200, 141 GB): a LoRA update and one agent
# turn of sampling (a prompt's prefill, then the answer's decode) for the 7B preset in bfloat16
# with random weights (no checkpoint needed), printing tokens/s and model-FLOPs utilisation.
# The paper's ALFWorld turn shape: 2,048-token prompts, 512-token answers; an update of 16 rows
# of 2,560 tokens in microbatches of 4 with per-layer remat and a scanned layer stack.
#
#   bash scripts/device_check_7b.sh                          # qwen2_5_7b, LoRA rank 16
#   bash scripts/device_check_7b.sh --preset=llama3_1_8b      # or qwen3_8b
#   bash scripts/device_check_7b.sh --tiny --full             # CPU smoke test (tiny preset),
#                                                             # LoRA and full fine-tuning
#   bash scripts/device_check_7b.sh --json=out.json           # the figures as JSON too
#
# MFU counts model FLOPs (2 per parameter per token forward, attention included; the backward
# of a LoRA update 2 more, no weight gradients of the frozen base; full fine-tuning 4 more;
# remat's recomputation not counted) against the device's dense bfloat16 peak (H200 / H100:
# 989 TFLOP/s; --peak_tflops for another device; none on the CPU). Not yet run on a device:
# no accelerator was lent to the session that wrote it (2026-12-05).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" - "$@" <<'EOF'
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bpo_jax import learner
from bpo_jax.learner.losses import pg_loss
from bpo_jax.models import config, lora, sharding
from bpo_jax.models.factory import create_model
from bpo_jax.models.llama import init_cache
from bpo_jax.sampler import programs

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0}  # Dense bfloat16, by device kind substring.

p = argparse.ArgumentParser(prog="device_check_7b.sh")
p.add_argument("--preset", default="qwen2_5_7b")
p.add_argument("--tiny", action="store_true", help="the tiny preset at CPU sizes")
p.add_argument("--lora_rank", type=int, default=16)
p.add_argument("--full", action="store_true", help="also time a full fine-tuning update")
p.add_argument("--rows", type=int, default=16, help="update rows")
p.add_argument("--microbatch", type=int, default=4)
p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
p.add_argument("--answer", type=int, default=512, help="answer tokens")
p.add_argument("--sample_rows", type=int, default=64)
p.add_argument("--steps", type=int, default=3, help="timed repetitions of each program")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--peak_tflops", type=float, default=None)
p.add_argument("--json", default=None)
a = p.parse_args()
if a.tiny:
    a.preset = "tiny"
    a.rows, a.microbatch, a.prompt, a.answer, a.sample_rows = 8, 0, 192, 32, 8
    a.dtype = "float32" if a.dtype == "bfloat16" else a.dtype

dev = jax.devices()[0]
peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in dev.device_kind), None)
dtype = jnp.dtype(a.dtype)
length = a.prompt + a.answer
mcfg = config.get_preset(
    a.preset, dtype=dtype, param_dtype=dtype, max_seq_len=max(length, 64)
)
mesh = sharding.make_mesh((1, 1, 1), devices=[dev])
print(f"device: {dev.device_kind} ({dev.platform}), preset {a.preset}, {a.dtype}", flush=True)


def flops_per_token(ctx: float) -> float:
    """Forward model FLOPs of one token at an average attention context `ctx`."""
    d, f, v, n = mcfg.hidden_size, mcfg.intermediate_size, mcfg.vocab_size, mcfg.num_layers
    h, k, e = mcfg.num_heads, mcfg.num_kv_heads, mcfg.resolved_head_dim
    per_layer = d * (h + 2 * k) * e + h * e * d + 3 * d * f
    return 2 * (n * per_layer + d * v) + 4 * n * h * e * ctx


def timed(fn, *args, **kw):
    out = fn(*args, **kw)
    jax.block_until_ready(out)
    return out


report = {"device": dev.device_kind, "preset": a.preset, "dtype": a.dtype, "peak_tflops": peak}


def mfu(flops, seconds):
    return None if peak is None else flops / seconds / (peak * 1e12)


def show(name, tokens, flops, seconds, compile_s):
    rate, util = tokens / seconds, mfu(flops, seconds)
    util_text = "n/a (no peak for this device)" if util is None else f"{100 * util:.1f}%"
    print(
        f"{name}: {tokens} tokens in {seconds:.3f} s = {rate:,.0f} tokens/s, MFU {util_text} "
        f"(compile {compile_s:.0f} s)",
        flush=True,
    )
    report[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": rate, "mfu": util,
                    "compile_seconds": compile_s}


with jax.set_mesh(mesh), sharding.axis_rules(sharding.DEFAULT_RULES):
    start = time.perf_counter()
    model = create_model(mcfg, mesh=mesh, seed=0)
    base_graphdef = nnx.graphdef(model)
    if a.lora_rank:
        lcfg = lora.LoraConfig(a.lora_rank, 2.0 * a.lora_rank)
        lora.apply_lora(model, lcfg, seed=0, mesh=mesh)
    graphdef, params = nnx.split(model)
    del model
    jax.block_until_ready(params)
    print(f"random weights in {time.perf_counter() - start:.0f} s", flush=True)

    # ---- the update: PPO-clipped policy gradient on random tokens, the answer masked in.
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, mcfg.vocab_size, (a.rows, length)), jnp.int32)
    mask = jnp.zeros((a.rows, length), jnp.float32).at[:, a.prompt:].set(1.0)
    batch = learner.Batch(
        tokens=tokens,
        loss_mask=mask,
        advantages=jnp.asarray(rng.normal(size=(a.rows, length)), jnp.float32) * mask,
        old_logprobs=jnp.full((a.rows, length), -5.0, jnp.float32) * mask,
        weights=jnp.ones((a.rows,), jnp.float32),
    )

    def loss(fn, params, batch):
        return pg_loss(fn, params, batch, clip_eps=0.2, loss_agg="token_mean")

    def update(label, state_params, graphdef):
        opt = learner.make_optimizer(1e-5)
        shardings = learner.state_shardings(
            opt, state_params, jax.tree.map(lambda x: x.sharding, state_params)
        )
        step = learner.make_train_step(
            graphdef, opt, loss, microbatch_size=a.microbatch, remat="full",
            logits_chunk=0 if a.tiny else 512, scan_layers=True, shardings=shardings,
        )
        state = learner.TrainState(state_params, opt.init(state_params), jnp.zeros((), jnp.int32))
        t0 = time.perf_counter()
        state, _ = timed(step, state, batch)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(a.steps):
            state, _ = timed(step, state, batch)
        seconds = (time.perf_counter() - t0) / a.steps
        # LoRA: forward and the activations' backward; full: the weights' gradients too.
        passes = 3 if label == "update_full" else 2
        ntok = a.rows * length
        show(label, ntok, passes * ntok * flops_per_token(length / 2), seconds, compile_s)
        return state.params

    if a.lora_rank:
        params = update("update_lora", params, graphdef)
    if a.full:
        full = lora.split_adapters(params)[1] if a.lora_rank else params
        # Master weights in float32, a copy (the step donates them).
        full = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), full)
        update("update_full", full, base_graphdef)
        del full

    # ---- a turn of sampling: each row's prompt prefilled, then the answer decoded.
    cap = length
    prefill = programs.prefill_program(graphdef, None, donate=True)
    decode = programs.generate_program(graphdef, None, eos_ids=(), pad_id=0, donate=True)
    prompts = jnp.asarray(rng.integers(1, mcfg.vocab_size, (a.sample_rows, a.prompt)), jnp.int32)
    num_new = jnp.full((a.sample_rows,), a.prompt, jnp.int32)
    one, temp = jnp.float32(1.0), jnp.float32(1.0)

    def turn():
        cache = init_cache(mcfg, a.sample_rows, capacity=cap)
        last = jnp.zeros((a.sample_rows, mcfg.vocab_size), jnp.float32)
        t0 = time.perf_counter()
        cache, last = timed(prefill, params, cache, last, prompts, num_new, offset_bound=cap)
        t1 = time.perf_counter()
        out = timed(decode, params, cache, last, jax.random.key(1), temp, one,
                    num_new=a.answer, greedy=False, nucleus=False)
        return t1 - t0, time.perf_counter() - t1, int(out["num_steps"])

    c_pre, c_dec, _ = turn()  # Compiles both.
    pre, dec = [], []
    for _ in range(a.steps):
        x, y, steps = turn()
        pre.append(x)
        dec.append(y)
    assert steps == a.answer, f"the decode stopped after {steps} of {a.answer} tokens"
    n_pre, n_dec = a.sample_rows * a.prompt, a.sample_rows * a.answer
    show("prefill", n_pre, n_pre * flops_per_token(a.prompt / 2), float(np.mean(pre)), c_pre)
    ctx = a.prompt + a.answer / 2
    show("decode", n_dec, n_dec * flops_per_token(ctx), float(np.mean(dec)), c_dec)
    turn_s = float(np.mean(pre) + np.mean(dec))
    print(f"turn ({a.sample_rows} rows): {turn_s:.2f} s", flush=True)
    report["turn_seconds"] = turn_s

if a.json:
    with open(a.json, "w") as fh:
        json.dump(report, fh, indent=2)
EOF
