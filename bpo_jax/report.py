"""What a finished run shows: success before and after RL with their intervals, whether the
difference is more than the evaluation's noise, the compute RL spent, and `curves.png`.

The evaluation plays each game once, greedily, before and after RL, so the two are paired: the
difference is RL's effect on those games, and a game won both times (or lost both times) says
nothing about it. The difference's 95% interval is a paired bootstrap over the games, and
its test the exact McNemar test (a binomial test on the games whose outcome changed). A
difference counts as more than noise only when both say so (the interval excludes 0 and
p < 0.05): at a few dozen games the bootstrap's percentile interval is the narrower of the two
(5 games lost of 24, none won: interval -0.375 to -0.042, McNemar p = 0.06). At that size only a
large change is distinguishable from noise, and the final lines say so.
"""

from __future__ import annotations

import io

import numpy as np
import scipy.stats

from bpo_jax.io import files
from bpo_jax.io.metrics import read_metrics

FIGURE = "curves.png"
LEVEL = 0.95
ALPHA = 1 - LEVEL
NUM_RESAMPLES = 10_000


def wilson(wins: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a success rate (not degenerate at 0 or n wins)."""
    ci = scipy.stats.binomtest(wins, n).proportion_ci(level, method="wilson")
    return float(ci.low), float(ci.high)


def paired_effect(before: dict, after: dict, seed: int = 0) -> dict | None:
    """RL's effect on the evaluation games: after - before, paired by game.

    Args:
      before, after: evaluation records (`evals.json`'s "before_rl" and "after_rl"), with
        per-episode wins (`eval/episodes`) and game ids (`eval/task_ids`).
      seed: seed of the bootstrap's resamples.

    Returns:
      None when the two records do not hold the same games; else the games `n`, the success
      rates and their Wilson intervals, the difference `diff` and its paired-bootstrap interval
      `diff_ci`, the games newly won (`gained`) and lost (`lost`), McNemar's exact `p_value`,
      and `significant` (the interval excludes 0 and p < 0.05).
    """
    ids_b, ids_a = before.get("eval/task_ids"), after.get("eval/task_ids")
    if not ids_b or sorted(ids_b) != sorted(ids_a or []):
        return None
    won_b = dict(zip(ids_b, before["eval/episodes"], strict=True))
    won_a = dict(zip(ids_a, after["eval/episodes"], strict=True))
    b = np.array([won_b[t] for t in ids_b], np.float64)
    a = np.array([won_a[t] for t in ids_b], np.float64)
    n = len(b)
    gained, lost = int(np.sum((a == 1) & (b == 0))), int(np.sum((a == 0) & (b == 1)))
    diff = float(np.mean(a - b))
    if gained + lost == 0:
        diff_ci, p_value = (0.0, 0.0), 1.0  # Every game played as before: no resample differs.
    else:
        res = scipy.stats.bootstrap(
            (a - b,),
            np.mean,
            confidence_level=LEVEL,
            n_resamples=NUM_RESAMPLES,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
        diff_ci = (float(res.confidence_interval.low), float(res.confidence_interval.high))
        p_value = float(scipy.stats.binomtest(gained, gained + lost, 0.5).pvalue)
    return {
        "n": n,
        "before": float(b.mean()),
        "after": float(a.mean()),
        "before_ci": wilson(int(b.sum()), n),
        "after_ci": wilson(int(a.sum()), n),
        "diff": diff,
        "diff_ci": diff_ci,
        "gained": gained,
        "lost": lost,
        "p_value": p_value,
        "significant": p_value < ALPHA and not diff_ci[0] <= 0.0 <= diff_ci[1],
    }


def rl_records(workdir) -> list[dict]:
    """The RL iterations' metrics from `metrics.jsonl`, one per iteration (a resumed run's
    repeated iteration keeps its last record), in order."""
    try:
        records = read_metrics(workdir)
    except FileNotFoundError:
        return []
    by_it = {int(r["train/iteration"]): r for r in records if "train/iteration" in r}
    return [by_it[i] for i in sorted(by_it)]


def spend(records: list[dict]) -> dict:
    """RL's compute: iterations, tokens generated, environment steps, and for tree algorithms
    the batches' spend / budget (mean, min, max)."""
    out = {
        "iterations": len(records),
        "generated_tokens": int(sum(r.get("compute/generated_tokens", 0) for r in records)),
        "env_steps": int(sum(r.get("compute/env_steps", 0) for r in records)),
        "rl_seconds": float(sum(r.get("train/iteration_seconds", 0.0) for r in records)),
    }
    ratios = [r["compute/spend_ratio"] for r in records if "compute/spend_ratio" in r]
    if ratios:
        out["spend_ratio"] = float(np.mean(ratios))
        out["spend_ratio_range"] = (float(np.min(ratios)), float(np.max(ratios)))
    return out


def title(cfg) -> str:
    """The figure's title: the algorithm and the setting."""
    t = cfg.train
    return (
        f"{t.algo} on {cfg.env.name}, {cfg.model.preset} policy: {t.iterations} iterations of "
        f"{t.tasks_per_iter} tasks x {t.group_size}, lr {t.lr:g}, seed {cfg.seed}"
    )


def write_curves(workdir, records: list[dict], evals: dict, heading: str):
    """`curves.png`: rollout success per RL iteration, and the greedy evaluations (before RL at
    0, every `eval.every`, after RL) with their Wilson intervals. Returns its path, or None
    with nothing to draw."""
    points = []  # (iteration, success, wins, episodes)
    last = len(records)
    named = [("before_rl", 0), *((f"iter_{i}", i) for i in range(1, last)), ("after_rl", last)]
    for name, it in named:
        r = evals.get(name)
        if r and r.get("eval/num_episodes"):
            n = int(r["eval/num_episodes"])
            points.append((it, r["eval/success"], round(r["eval/success"] * n), n))
    if not records and not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if records:
        its = [int(r["train/iteration"]) for r in records]
        ys = [r["train/success"] for r in records]
        ax.plot(its, ys, "o-", label="rollout success (sampled, the iteration's tasks)")
    if points:
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        cis = [wilson(p[2], p[3]) for p in points]
        err = [[y - lo for y, (lo, _) in zip(ys, cis)], [hi - y for y, (_, hi) in zip(ys, cis)]]
        label = f"greedy evaluation, {points[0][3]} games (95% Wilson CI)"
        ax.errorbar(xs, ys, yerr=err, fmt="s", capsize=4, label=label)
    ax.set_xlabel("RL iteration (0: before RL)")
    ax.set_ylabel("success")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(heading, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path = files.as_path(workdir) / FIGURE
    files.write_bytes(path, buf.getvalue())
    return path


def summarise(cfg, workdir, evals: dict) -> dict:
    """The summary's report entries: `rl_effect` (`paired_effect`, None without both
    evaluations), `rl_spend` (`spend`) and `figure` (the curves' path, or None)."""
    records = rl_records(workdir)
    effect = None
    if "before_rl" in evals and "after_rl" in evals:
        effect = paired_effect(evals["before_rl"], evals["after_rl"], seed=cfg.seed)
    figure = write_curves(workdir, records, evals, title(cfg))
    return {
        "rl_effect": effect,
        "rl_spend": spend(records),
        "figure": None if figure is None else str(figure),
    }


def final_lines(summary: dict) -> list[str]:
    """The lines the main job ends with (see the module's docstring)."""
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    e = summary.get("rl_effect")
    lines = []
    head = f"Evaluation success (greedy, {summary['eval_tasks']} {summary['eval_split']} tasks): "
    if e is None:
        lines.append(
            head + f"initial {fmt(summary['success_initial'])} | before RL "
            f"{fmt(summary['success_before_rl'])} | after RL {fmt(summary['success_after_rl'])}"
        )
    else:
        lo_b, hi_b = e["before_ci"]
        lo_a, hi_a = e["after_ci"]
        lines.append(
            head + f"initial {fmt(summary['success_initial'])} | before RL {e['before']:.3f} "
            f"(95% CI {lo_b:.2f}-{hi_b:.2f}) | after RL {e['after']:.3f} "
            f"(95% CI {lo_a:.2f}-{hi_a:.2f})"
        )
        lo, hi = e["diff_ci"]
        if summary.get("iterations", 0) == 0:
            verdict = "no RL iteration ran"
        elif e["significant"]:
            verdict = "RL helped" if e["diff"] > 0 else "RL hurt"
        else:
            verdict = (
                f"within noise: on {e['n']} games this difference is not distinguishable from "
                "chance, so this run cannot tell whether RL helped or hurt"
            )
        lines.append(
            f"RL's effect: {e['diff']:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, paired bootstrap over "
            f"the same {e['n']} games; {e['gained']} newly won, {e['lost']} lost, exact McNemar "
            f"p = {e['p_value']:.2f}): {verdict}."
        )
    s = summary.get("rl_spend") or {}
    if s.get("iterations"):
        text = (
            f"RL spent {s['iterations']} iterations, {s['generated_tokens']:,} generated tokens, "
            f"{s['env_steps']:,} environment steps in {s['rl_seconds'] / 60:.1f} min"
        )
        if "spend_ratio" in s:
            lo, hi = s["spend_ratio_range"]
            text += (
                f"; spend / budget {s['spend_ratio']:.2f} per batch (range {lo:.2f}-{hi:.2f}; "
                "budget: group_size independent episodes per task)"
            )
        lines.append(text + ".")
    if summary.get("figure"):
        lines.append(f"Figure: {summary['figure']}")
    return lines
