r"""The paper's tables and figures from a folder of run records.

  python -m bpo_jax.study.tables --runs=results/alfworld_cpu --out=docs/results/alfworld_cpu \
      [--baseline=rloo] [--reference=bpo] [--seed=0] [--splits=valid_seen,valid_unseen]

writes `table1.json`, `table2.json`, `results.md` and PNG figures into --out.

The record it reads: every folder under --runs (recursively) with `config.json` and
`summary.json` is one run.
  - `config.json`: the run's full ConfigDict. Read: `seed`, `env.name`, `env.eval_split`,
    `train.algo`, `train.tasks_per_iter`, `bc.steps`.
  - `summary.json`: read `iterations`, `updates` (the update step at the end, behaviour-cloning
    steps included), `eval_split`.
  - `evals.json`: {name: result}; names are `before_rl`, `iter_<N>`, `after_rl`, either plain
    (one evaluation, on `summary.eval_split`) or per split (`after_rl/valid_seen`,
    `after_rl/valid_unseen`, ...). A result has `eval/success` and `eval/num_episodes`, and
    optionally `eval/episodes`, the per-episode successes [0/1, ...]: when every split of a
    run has them, success is their pooled mean and the IQM is taken over episodes; otherwise
    the success means weighted by `eval/num_episodes`.
  - `metrics.jsonl`: per RL iteration a record with `step`, `train/iteration`,
    `compute/generated_tokens`, `compute/task_cost_mean`, `train/budget_per_task`,
    `train/branch_points` and `train/branch_step/<t>` (the batch's branch points at step t,
    for the branch-step histogram); per update `update/grad_norm`; per evaluation
    `eval_<name>/success` at the update step it was taken at.
  - f's parts (optional; tree algorithms' runs record them): per RL iteration the metrics'
    `train/f_parts/...` sums and `branch_parts.jsonl`, the batch's branch points summed per
    (task, depth) (`bpo_jax.rollout.explained`; `records.f_parts_of` reads them).
  - `probe.json` (optional): {"results": {algo: {"trace_var", "norm_var", ...}}} from
    `bpo_jax.study.probe`; optional per-algorithm `trace_var_ratio_ci95` is used for a single probe.
    Table 2 reads every `probe.json` under --runs beside a `config.json` (its seed): in a run's
    folder, or a sweep's probe of its start (`probe/shared`, no summary: not a run).
The group (row) of a run is its sweep folder (`<group>/seed_<n>`, e.g. `bpo_k4`), else
`train.algo`.

Table 1 (`table1.json`):
  {"env", "eval_splits", "episodes_per_seed",
   "algorithms": {NAME: {"seeds", "success" (one per seed), "mean", "ci95", "iqm",
                         "spend_ratio", "updates"}},
   "paired": {"<reference>-NAME": {"mean", "ci95", "prob_improvement"}}}
success is the final (`after_rl`) evaluation; ci95 a percentile bootstrap over seeds; iqm the
interquartile mean over seeds x episodes (its stratified-bootstrap CI is in results.md);
spend_ratio the mean generated tokens per task over the baseline's; updates the RL updates
after which the mean success over seeds first reaches the best non-reference algorithm's final
mean success (null without per-iteration evaluations, or if never reached). Paired differences
use the seeds both algorithms have; prob_improvement is P(reference > NAME) over those pairs,
ties 1/2. Every bootstrap uses 10,000 resamples from `numpy.random.default_rng([seed, label])`.

Table 2 (`table2.json`): the probe's gradient-variance ratios against the baseline (RLOO) per
seed, with their mean and bootstrap CI; empty, with a note, when no record has a probe. When
runs recorded f, also `f` ({NAME: {"unit", "rows"}}: f per branch-point depth with bootstrap
CIs) and `table2a` ({NAME: rows}, `bpo_jax.study.table2a`), and results.md a section on them
(`bpo_jax.study.fshare`); nothing of it for runs without f.

Reading the records into the tables is `bpo_jax.study.tables_build`; this module writes them
(JSON, results.md) and the figures (`bpo_jax.study.figures`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from bpo_jax import cli
from bpo_jax.study import fshare, stats
from bpo_jax.study.records import find_probes, find_runs
from bpo_jax.study.table2a import markdown as table2a_markdown
from bpo_jax.study.tables_build import build_table1, build_table2, success_curve

# What tests and callers use from the command's module.
__all__ = [
    "build_table1",
    "build_table2",
    "find_probes",
    "find_runs",
    "results_markdown",
    "success_curve",
    "write_tables",
]


def _pts(x: float) -> str:
    x = 0.0 if abs(x) < 1e-12 else x  # A sum of equal and opposite wins, not "-0.0".
    return f"{100 * x:+.1f}"


def _ci_pts(ci) -> str:
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def comparison_sentence(ref: str, name: str, row: dict, pairs: int) -> str:
    """One plain sentence per paired comparison, in success points."""
    r, n = ref.upper(), name.upper()
    lo, hi = row["ci95"]
    tail = (
        f"{_pts(row['mean'])} points, 95% CI {_ci_pts(row['ci95'])}, "
        f"P({r} > {n}) = {row['prob_improvement']:.2f} over {pairs} paired seeds."
    )
    if pairs < 2:
        return (f"{r} against {n}: {_pts(row['mean'])} points on a single paired seed; "
                "no confidence interval, no conclusion.")  # fmt: skip
    if lo > 0:
        return f"{r} beats {n} here: {tail}"
    if hi < 0:
        return f"{r} is worse than {n} here: {tail}"
    return f"{r} does not beat {n} here: {tail}"


def table2_lines(t2: dict) -> list[str]:
    """Table 2's rows (one configuration's probes), its notes and how to read its CIs."""
    if not t2["algorithms"]:
        return [t2["note"]]
    lines = [
        "| algorithm | seeds | batches | trace-variance ratio | 95% CI | norm-variance ratio "
        "| spend vs " + t2["reference"].upper() + " |",
        "|---|---|---|---|---|---|---|",
    ]

    def listed(xs, fmt):
        return ", ".join("n/a" if x is None else format(x, fmt) for x in xs) or "n/a"

    for name, row in t2["algorithms"].items():
        ci = "n/a" if row["ci95"] is None else f"[{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]"
        lines.append(
            f"| {name} | {len(row['seeds'])} | {listed(row.get('batches', []), 'd')} | "
            f"{row['mean']:.2f} | {ci} | {row['norm_var_mean']:.2f} | "
            f"{listed(row.get('spend_ratio', []), '.3f')} |"
        )
    lines += [
        "",
        "The 95% CI of a single probe resamples its batches (`bpo_jax.study.probe`); "
        "over several "
        "probes (one per seed) it resamples their ratios. Spend: the algorithm's measured "
        "cost per task over the reference's, in the same probe.",
    ]
    if t2["note"]:
        lines += ["", t2["note"]]
    return lines


def results_markdown(
    t1: dict,
    extra: dict,
    t2: dict,
    figures: dict,
    baseline: str,
    ref: str,
    f_tables: dict | None = None,
) -> str:
    """results.md: both tables with their CIs, a sentence per comparison, and the figures;
    with `f_tables` (`fshare.group_f_tables`, runs that recorded f) a section on f before the
    figures."""
    lines = [f"# Results: {t1['env']}", ""]
    eps = t1["episodes_per_seed"] or f"varies: {extra['episode_counts']}"
    lines += [
        f"Final evaluation on {', '.join(t1['eval_splits'])} ({eps} episodes per seed). "
        "Means over seeds with 95% percentile-bootstrap CIs over seeds; IQM over seeds x "
        "episodes with a stratified bootstrap CI; spend = generated tokens per task over "
        f"{baseline.upper()}'s; updates = RL updates to reach the best baseline's final "
        f"success ({(extra['best_baseline'] or 'none').upper()}).",
        "",
        "## Table 1: success",
        "",
        "| algorithm | seeds | success | 95% CI | IQM [95% CI] | spend | updates |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in t1["algorithms"].items():
        iqm_ci = extra["iqm_ci95"][name]
        spend = "n/a" if a["spend_ratio"] is None else f"{a['spend_ratio']:.2f}"
        has_curve = any(c["point"].startswith("iter_") for c in extra["curves"][name])
        upd = f"{a['updates']:.0f}" if a["updates"] is not None else "n/a"
        upd = "not reached" if a["updates"] is None and has_curve else upd
        lines.append(
            f"| {name} | {len(a['seeds'])} | {a['mean']:.3f} | [{a['ci95'][0]:.3f}, "
            f"{a['ci95'][1]:.3f}] | {a['iqm']:.3f} [{iqm_ci[0]:.3f}, {iqm_ci[1]:.3f}] | "
            f"{spend} | {upd} |"
        )
    if extra["iqm_degenerate"]:
        lines += [
            "",
            f"The IQM of {', '.join(extra['iqm_degenerate'])} is 0 or 1 by construction: its "
            "episodes score 0 or 1, and with under a quarter (over three quarters) of them won "
            "the middle half holds only losses (wins). Read the mean and its CI.",
        ]
    lines += ["", "## Paired differences against " + ref.upper(), ""]
    if not t1["paired"]:
        lines.append(f"No paired comparison: no {ref} runs, or no seed shared with them.")
    for label, row in t1["paired"].items():
        name = label.split("-", 1)[1]
        lines.append("- " + comparison_sentence(ref, name, row, extra["pairs"][label]))
    best = extra["best_baseline"]
    ref_upd = t1["algorithms"].get(ref, {}).get("updates")
    best_upd = t1["algorithms"][best]["updates"] if best else None
    if ref_upd is not None and best_upd:
        target = t1["algorithms"][best]["mean"]
        lines.append(
            f"- {ref.upper()} reaches {best.upper()}'s final success ({target:.3f}) after "
            f"{ref_upd:.0f} RL updates, {best.upper()} after {best_upd:.0f} "
            f"({100 * (1 - ref_upd / best_upd):.0f}% fewer; read at the evaluation points only)."
        )
    elif best and t1["algorithms"].get(ref) and ref_upd is None:
        lines.append(
            f"- {ref.upper()} does not reach {best.upper()}'s final success at any evaluation "
            "point (or the runs have no per-iteration evaluations)."
        )
    spend = t1["algorithms"].get(ref, {}).get("spend_ratio")
    if spend is not None and abs(spend - 1) > 0.05:
        lines.append(
            f"- Compute is not matched: {ref.upper()} generated {spend:.2f}x "
            f"{baseline.upper()}'s tokens per task."
        )
    lines += ["", f"## Table 2: gradient variance against {t2['reference'].upper()}", ""]
    lines += table2_lines(t2)
    for name, sub in t2.get("designs", {}).items():
        design = sub.get("design") or {}
        tree = design.get("tree", "as configured")
        lines += ["", f"### Table 2, probe `{name}`: tree {tree}", ""]
        if design.get("predicted_ratio") is not None:
            lines.append(
                f"Predicted BPO/{t2['reference'].upper()} trace ratio (first-order model, from "
                f"the pilot): {design['predicted_ratio']:.2f}."
            )
        if design.get("reason"):
            lines.append(f"Why this design: {design['reason']}")
        lines += ["", *table2_lines(sub)]
        for algo, row in sub["algorithms"].items():
            explained = row.get("explained")
            if explained:
                lines += ["", f"f per depth on `{algo}`'s probe batches:", ""]
                lines.append(fshare.f_markdown(explained["f"], explained["unit"]).rstrip("\n"))
                if explained.get("table2a"):
                    lines += ["", f"Table 2a on `{algo}`'s probe batches:", ""]
                    lines.append(table2a_markdown(explained["table2a"]).rstrip("\n"))
    if f_tables:
        lines += ["", *fshare.section_markdown(f_tables)]
    lines += ["", "## Figures", ""]
    for name, what in figures.items():
        lines.append(f"- {what}" if name.startswith("note:") else f"- ![{what}]({name})")
    return "\n".join(lines) + "\n"


def write_tables(
    runs_dir: str | Path,
    out_dir: str | Path,
    *,
    baseline: str = "rloo",
    reference: str = "bpo",
    seed: int = 0,
    splits: Sequence[str] | None = None,
    num_resamples: int = stats.NUM_RESAMPLES,
) -> dict:
    """Reads the records under `runs_dir`, writes the tables and figures to `out_dir`."""
    from bpo_jax.study import figures

    # Runs without RL iterations (a sweep's shared behaviour-cloning starts) are no results.
    runs = [r for r in find_runs(runs_dir) if r.summary.get("iterations", 1) != 0]
    if not runs:
        raise ValueError(f"no run under {runs_dir} trained any RL iteration.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t1, extra = build_table1(
        runs,
        baseline=baseline,
        reference=reference,
        seed=seed,
        splits=splits,
        num_resamples=num_resamples,
    )
    t2 = build_table2(
        find_probes(runs_dir),
        baseline=baseline,
        seed=seed,
        num_resamples=num_resamples,
        root=runs_dir,
    )
    f_tables = fshare.group_f_tables(runs, seed=seed, num_resamples=num_resamples)
    if f_tables:  # Runs that recorded f: its table per algorithm, and Table 2a where it can.
        t2["f"] = {name: {"unit": t["unit"], "rows": t["f"]} for name, t in f_tables.items()}
        t2["table2a"] = {n: t["table2a"] for n, t in f_tables.items() if t["table2a"] is not None}
        t2 = fshare.jsonable(t2)
    written = figures.write_figures(runs, extra["curves"], out)
    (out / "table1.json").write_text(json.dumps(t1, indent=2) + "\n")
    (out / "table2.json").write_text(json.dumps(t2, indent=2) + "\n")
    md = results_markdown(t1, extra, t2, written, baseline, reference, f_tables)
    (out / "results.md").write_text(md)
    return {"table1": t1, "table2": t2, "figures": written}


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("runs", None, "Folder of run records (searched recursively).")
    flags.DEFINE_string(
        "out", None, "Output folder for table1.json, table2.json, results.md, PNGs."
    )
    flags.DEFINE_string("baseline", "rloo", "Spend and gradient-variance reference algorithm.")
    flags.DEFINE_string("reference", "bpo", "The algorithm compared against every other.")
    flags.DEFINE_integer("seed", 0, "Seed of the bootstrap resamples.")
    flags.DEFINE_list("splits", None, "Evaluation splits to pool (default: all that runs share).")


PROG = "python -m bpo_jax.study.tables"


def check_arguments(runs_dir: str | None, out: str | None, baseline: str, reference: str) -> None:
    """The command line's mistakes, before any table is built: a missing flag, a --runs folder
    that does not exist or holds no run record, a --baseline or --reference no run has.

    Raises:
      ValueError: naming the flag and what it holds.
    """
    if runs_dir is None or out is None:
        raise ValueError("--runs and --out are required.")
    if not Path(runs_dir).is_dir():
        raise ValueError(f"--runs={runs_dir}: no such folder.")
    groups = sorted({r.group for r in find_runs(runs_dir)})  # ValueError when there are none.
    for flag, name in (("baseline", baseline), ("reference", reference)):
        if name not in groups:
            raise ValueError(
                f"--{flag}={name}: no run of that algorithm (or ablation) under {runs_dir}; "
                f"the runs' groups: {', '.join(groups)}."
            )


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; flags are --name=value", PROG)
    with cli.start_up_errors(PROG):
        check_arguments(FLAGS.runs, FLAGS.out, FLAGS.baseline, FLAGS.reference)
    result = write_tables(
        FLAGS.runs,
        FLAGS.out,
        baseline=FLAGS.baseline,
        reference=FLAGS.reference,
        seed=FLAGS.seed,
        splits=FLAGS.splits,
    )
    print((Path(FLAGS.out) / "results.md").read_text(), end="", flush=True)
    pngs = [k for k in result["figures"] if not k.startswith("note:")]
    print(f"wrote table1.json, table2.json, results.md and {len(pngs)} figure(s) to {FLAGS.out}")


if __name__ == "__main__":
    from bpo_jax.study import tables as _tables

    _tables.define_flags()
    cli.run(_tables.main, PROG)
