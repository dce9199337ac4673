"""Benchmark: the jitted forest estimator against the plain Python/NumPy reference.

A random forest of 2,000 tasks (K = 4, depth up to 3), padded to 65,536 segments and 2^20 steps.
Timed: values + advantages + segment weights + per-step expansion of both (the work the learner
needs per batch). The jitted pipeline is warmed (compiled) first and timed as the median of
`--repeats` runs, inputs already on the device; the reference runs the same work once per
repeat (median). Both outputs are compared before any number is printed.

    .venv/bin/python bench/bench_estimator.py --json bench/results/bench_estimator.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_estimator as ref  # noqa: E402

from bpo_jax import estimators as est  # noqa: E402


def _time(fn, repeats):
    times = []
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--segments", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=2**20)
    parser.add_argument("--branch-prob", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=10, help="jitted runs (median)")
    parser.add_argument("--ref-repeats", type=int, default=3, help="reference runs (median)")
    parser.add_argument(
        "--extra", action="store_true", help="also time treerl, gigpo and trajectory_weights"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    f = ref.random_forest(
        rng, args.tasks, k=4, max_depth=3, branch_prob=args.branch_prob,
        num_segments=args.segments, num_steps=int(args.steps * 0.95),
    )  # fmt: skip
    # Pad the steps too (5%), as a real batch would be.
    pad = args.steps - f["step_segment"].size
    for key, fill in (("step_segment", -1), ("step_reward", 0.0), ("step_obs_id", -1)):
        f[key] = np.concatenate([f[key], np.full(pad, fill, f[key].dtype)])
    num_nodes = f["num_nodes"]
    real_segments = int((f["seg_parent"] >= 0).sum())
    real_steps = int((f["step_segment"] >= 0).sum())
    est.Forest(**f).validate()

    @jax.jit
    def pipeline(seg_parent, seg_child, seg_reward, step_segment):
        values, adv = est.tree_advantages(seg_parent, seg_child, seg_reward, num_nodes)
        weights = est.segment_weights(seg_parent, seg_child, num_nodes)
        steps = (est.expand_to_steps(x, step_segment) for x in (adv, weights))
        return values, adv, weights, *steps

    def reference():
        values, adv = ref.tree_advantages(
            f["seg_parent"], f["seg_child"], f["seg_reward"], num_nodes
        )
        weights = ref.segment_weights(f["seg_parent"], f["seg_child"], num_nodes)
        steps = (ref.expand(x, f["step_segment"]) for x in (adv, weights))
        return values, adv, weights, *steps

    device_args = [
        jnp.asarray(f[k]) for k in ("seg_parent", "seg_child", "seg_reward", "step_segment")
    ]
    start = time.perf_counter()
    jax.block_until_ready(pipeline(*device_args))
    compile_s = time.perf_counter() - start
    jit_s, jit_out = _time(lambda: pipeline(*device_args), args.repeats)
    ref_s, ref_out = _time(reference, args.ref_repeats)
    names = ("values", "advantages", "weights", "step_advantages", "step_weights")
    max_err = {
        n: float(np.max(np.abs(np.asarray(a) - b))) for n, a, b in zip(names, jit_out, ref_out)
    }
    for name, err in max_err.items():
        if not err <= 1e-4:
            raise SystemExit(f"jitted {name} differ from the reference by {err}")

    rows = [("values+advantages+weights+per-step", jit_s, ref_s)]
    if args.extra:
        forest = est.Forest(**{k: jnp.asarray(v) if k != "num_nodes" else v for k, v in f.items()})
        ref_args = (f["seg_parent"], f["seg_child"], f["seg_reward"], num_nodes)
        steps = (f["step_segment"], f["step_obs_id"], f["step_reward"])
        for name, ref_fn in (
            ("treerl", lambda: ref.treerl(*ref_args)),
            ("gigpo", lambda: ref.gigpo(*ref_args, *steps)),
        ):
            fn = jax.jit(lambda forest, name=name: est.get_estimator(name)(forest))
            jax.block_until_ready(fn(forest))
            t_jit, out = _time(lambda fn=fn: fn(forest), args.repeats)
            t_ref, expected = _time(ref_fn, 1)
            max_err[name] = float(np.max(np.abs(np.asarray(out) - expected)))
            if not max_err[name] <= 1e-4:
                raise SystemExit(f"jitted {name} differs from the reference by {max_err[name]}")
            rows.append((name, t_jit, t_ref))
        real_t = f["step_segment"] >= 0
        seg_len = np.bincount(f["step_segment"][real_t], minlength=args.segments)
        traj = jax.jit(lambda p, c, n: est.trajectory_weights(p, c, n, num_nodes))
        traj_args = (device_args[0], device_args[1], jnp.asarray(seg_len))
        jax.block_until_ready(traj(*traj_args))
        t_jit, out = _time(lambda: traj(*traj_args), args.repeats)
        ref_traj = (f["seg_parent"], f["seg_child"], seg_len, num_nodes)
        t_ref, expected = _time(lambda: ref.trajectory_weights(*ref_traj), 1)
        max_err["trajectory_weights"] = float(np.max(np.abs(np.asarray(out) - expected)))
        if not max_err["trajectory_weights"] <= 1e-4:
            raise SystemExit(f"jitted trajectory weights differ by {max_err['trajectory_weights']}")
        rows.append(("trajectory_weights", t_jit, t_ref))

    print(
        f"forest: {args.tasks} tasks, {real_segments}/{args.segments} segments, "
        f"{num_nodes} nodes, {real_steps}/{args.steps} steps; backend {jax.default_backend()}"
    )
    print(f"compile (first call): {compile_s:.2f} s")
    print(f"{'work':<38}{'jitted ms':>12}{'reference ms':>15}{'speed-up':>11}")
    for name, t_jit, t_ref in rows:
        print(f"{name:<38}{t_jit * 1e3:>12.2f}{t_ref * 1e3:>15.1f}{t_ref / t_jit:>10.0f}x")
    print("max |jitted - reference|: " + ", ".join(f"{k} {v:.1e}" for k, v in max_err.items()))

    if args.json:
        result = {
            "tasks": args.tasks,
            "segments": args.segments,
            "real_segments": real_segments,
            "nodes": num_nodes,
            "steps": args.steps,
            "real_steps": real_steps,
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0]),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "compile_s": compile_s,
            "timings": [
                {"work": n, "jitted_s": tj, "reference_s": tr, "speedup": tr / tj}
                for n, tj, tr in rows
            ],
            "speedup": ref_s / jit_s,
            "max_abs_error": max_err,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
