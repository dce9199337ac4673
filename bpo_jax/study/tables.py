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
seed, with their mean and bootstrap CI; empty, with a note, when no record has a probe.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import app, flags

from bpo_jax.study import stats
from bpo_jax.study.records import ProbeRecord, RunRecord, find_probes, find_runs

FINAL = "after_rl"


def rng_for(seed: int, label: str) -> np.random.Generator:
    """A generator per statistic, so that a number does not depend on what else is computed."""
    return np.random.default_rng([seed, zlib.crc32(label.encode())])


def common_splits(runs: Sequence[RunRecord], wanted: Sequence[str] | None = None) -> list[str]:
    """The final evaluation's splits that every run has (or `wanted`, checked)."""
    have = [set(r.splits(FINAL)) for r in runs]
    if any(not h for h in have):
        missing = [str(r.path) for r, h in zip(runs, have, strict=True) if not h]
        raise ValueError(f"runs without a final ('{FINAL}') evaluation: {missing}.")
    common = set.intersection(*have)
    if wanted:
        lacking = sorted(set(wanted) - common)
        if lacking:
            raise ValueError(f"splits {lacking} are not evaluated in every run (common: {common}).")
        return list(wanted)
    if not common:
        raise ValueError(f"the runs share no evaluation split: {[sorted(h) for h in have]}.")
    return sorted(common)


def group_runs(runs: Sequence[RunRecord]) -> dict[str, list[RunRecord]]:
    out: dict[str, list[RunRecord]] = {}
    for r in runs:
        out.setdefault(r.group, []).append(r)
    return out


def success_curve(
    group: Sequence[RunRecord],
    splits: Sequence[str],
    rng: np.random.Generator | None = None,
    num_resamples: int = 2000,
) -> list[dict]:
    """Per evaluation point every seed has: mean success, updates, iteration, tokens; with
    `rng` and per-episode outcomes, `ci95`: a percentile bootstrap of the mean that resamples
    episodes within each seed and split (episode noise; the spread over seeds is Table 1's)."""
    points = [p for p in group[0].eval_points() if all(p in r.eval_points() for r in group)]
    curve = []
    for p in points:
        succ = [r.success(p, splits) for r in group]
        if any(s is None for s in succ):
            continue
        updates = [r.updates_at(p) for r in group]
        tokens = [r.cumulative_tokens().get(r.iteration_of(p)) for r in group]
        eps = [r.episodes(p, splits) for r in group]
        ci = None
        if rng is not None and all(e is not None for e in eps):
            strata = [s for e in eps for s in e]
            ci = list(stats.stratified_bootstrap_ci(strata, rng, _rows_mean, num_resamples))
        curve.append(
            {
                "point": p,
                "iteration": float(np.mean([r.iteration_of(p) for r in group])),
                "success": float(np.mean([s[0] for s in succ])),
                "updates": None if None in updates else float(np.mean(updates)),
                "tokens": None if None in tokens else float(np.mean(tokens)),
                "ci95": ci,
            }
        )
    return curve


def _rows_mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=1)


def updates_to_reach(curve: Sequence[dict], target: float) -> float | None:
    """RL updates at the first evaluation whose mean success reaches `target`."""
    if not any(c["point"].startswith("iter_") for c in curve):
        return None  # Only before and after RL: no curve to read a crossing from.
    for c in curve:
        if c["success"] >= target - 1e-12 and c["updates"] is not None:
            return c["updates"]
    return None


def build_table1(
    runs: Sequence[RunRecord],
    *,
    baseline: str = "rloo",
    reference: str = "bpo",
    seed: int = 0,
    splits: Sequence[str] | None = None,
    num_resamples: int = stats.NUM_RESAMPLES,
) -> tuple[dict, dict]:
    """Table 1, and what results.md adds to it (IQM CIs, curves, the best baseline)."""
    envs = sorted({r.env for r in runs})
    if len(envs) != 1:
        raise ValueError(f"runs of several environments {envs}; point --runs at one sweep.")
    splits = common_splits(runs, splits)
    groups = group_runs(runs)
    algorithms, extra = {}, {"iqm_ci95": {}, "curves": {}, "iqm_degenerate": []}
    episode_counts = set()
    tokens = {
        name: [t for r in g if (t := r.generated_per_task()) is not None]
        for name, g in groups.items()
    }
    base_tokens = np.mean(tokens[baseline]) if tokens.get(baseline) else None
    for name, g in groups.items():
        finals = [r.success(FINAL, splits) for r in g]
        success = [s for s, _ in finals]
        episode_counts.update(n for _, n in finals)
        eps = [r.episodes(FINAL, splits) for r in g]
        strata = [s for e in eps for s in e] if all(e is not None for e in eps) else [success]
        pooled = np.concatenate(strata)
        spend = None
        if base_tokens and len(tokens[name]) == len(g):
            spend = float(np.mean(tokens[name]) / base_tokens)
        algorithms[name] = {
            "seeds": [r.seed for r in g],
            "success": success,
            "mean": float(np.mean(success)),
            "ci95": list(
                stats.bootstrap_mean_ci(success, rng_for(seed, f"ci/{name}"), num_resamples)
            ),
            "iqm": stats.iqm(pooled),
            "spend_ratio": spend,
            "updates": None,
        }
        extra["iqm_ci95"][name] = list(
            stats.stratified_bootstrap_ci(
                strata, rng_for(seed, f"iqm/{name}"), num_resamples=num_resamples
            )
        )
        extra["curves"][name] = success_curve(g, splits, rng_for(seed, f"curve/{name}"))
        # The middle half of 0/1 outcomes is all losses below a quarter won (all wins above
        # three quarters): the IQM is then 0 (1) whatever the success rate.
        if np.isin(pooled, (0.0, 1.0)).all() and 0 < pooled.mean() < 1:
            if algorithms[name]["iqm"] in (0.0, 1.0):
                extra["iqm_degenerate"].append(name)
    others = [n for n in algorithms if n != reference]
    best = max(others, key=lambda n: algorithms[n]["mean"]) if others else None
    extra["best_baseline"] = best
    if best is not None:
        for name in algorithms:
            target = algorithms[best]["mean"]
            algorithms[name]["updates"] = updates_to_reach(extra["curves"][name], target)
    paired = {}
    if reference in algorithms:
        ref = dict(
            zip(algorithms[reference]["seeds"], algorithms[reference]["success"], strict=True)
        )
        for name in others:
            a = algorithms[name]
            diffs = [ref[s] - x for s, x in zip(a["seeds"], a["success"], strict=True) if s in ref]
            if not diffs:
                continue
            label = f"{reference}-{name}"
            paired[label] = {
                "mean": float(np.mean(diffs)),
                "ci95": list(
                    stats.bootstrap_mean_ci(diffs, rng_for(seed, f"paired/{label}"), num_resamples)
                ),
                "prob_improvement": stats.probability_of_improvement(diffs),
            }
            extra.setdefault("pairs", {})[label] = len(diffs)
    table = {
        "env": envs[0],
        "eval_splits": list(splits),
        "episodes_per_seed": episode_counts.pop() if len(episode_counts) == 1 else None,
        "algorithms": algorithms,
        "paired": paired,
    }
    extra["episode_counts"] = sorted(episode_counts | ({table["episodes_per_seed"]} - {None}))
    return table, extra


def build_table2(
    runs: Sequence[RunRecord | ProbeRecord],
    *,
    baseline: str = "rloo",
    seed: int = 0,
    num_resamples: int = stats.NUM_RESAMPLES,
    root: str | Path | None = None,
) -> dict:
    """Gradient-variance ratios against `baseline` from probe records (`find_probes`), with
    each probe's batches and measured spend against the baseline; `probes` names the records
    relative to `root` (the `--runs` folder) where given."""
    probes: dict[int, RunRecord | ProbeRecord] = {}
    notes = []
    for r in runs:
        if r.probe is None:
            continue
        results = r.probe.get("results", {})
        if baseline not in results:
            notes.append(f"{r.path / 'probe.json'} has no {baseline} (it has {sorted(results)}).")
        elif r.seed in probes:
            notes.append(f"seed {r.seed}: using {probes[r.seed].path}, not {r.path}.")
        else:
            probes[r.seed] = r
    table = {
        "reference": baseline,
        "probes": [
            str(p.path.resolve().relative_to(Path(root).resolve()) if root else p.path)
            for p in probes.values()
        ],
        "algorithms": {},
        "note": None,
    }
    if not probes:
        table["note"] = (
            f"no probe record with {baseline} (probe.json, from bpo_jax.study.probe) under --runs: "
            "no gradient-variance table."
        )
        if notes:
            table["note"] += " " + " ".join(notes)
        return table
    names = sorted({a for p in probes.values() for a in p.probe["results"]} - {baseline})
    for name in names:
        rows = {
            "seeds": [],
            "trace_var_ratio": [],
            "norm_var_ratio": [],
            "batches": [],
            "spend_ratio": [],
        }
        single_ci = None
        for s, p in sorted(probes.items()):
            res = p.probe["results"]
            if name not in res:
                continue
            base = res[baseline]
            rows["seeds"].append(s)
            rows["trace_var_ratio"].append(res[name]["trace_var"] / max(base["trace_var"], 1e-30))
            rows["norm_var_ratio"].append(res[name]["norm_var"] / max(base["norm_var"], 1e-30))
            rows["batches"].append(res[name].get("batches"))
            rows["spend_ratio"].append(res[name].get("spend_ratio"))
            if res[name].get("spend_warning"):  # The probe's own check of matched spend.
                notes.append(res[name]["spend_warning"])
            single_ci = res[name].get("trace_var_ratio_ci95")
        if not rows["seeds"]:
            continue
        ratios = rows["trace_var_ratio"]
        if len(ratios) > 1:
            ci = list(stats.bootstrap_mean_ci(ratios, rng_for(seed, f"t2/{name}"), num_resamples))
        else:
            ci = list(single_ci) if single_ci is not None else None
        table["algorithms"][name] = {
            **rows,
            "mean": float(np.mean(ratios)),
            "ci95": ci,
            "norm_var_mean": float(np.mean(rows["norm_var_ratio"])),
        }
    if notes:
        table["note"] = " ".join(notes)
    return table


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


def results_markdown(
    t1: dict, extra: dict, t2: dict, figures: dict, baseline: str, ref: str
) -> str:
    """results.md: both tables with their CIs, a sentence per comparison, and the figures."""
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
    if not t2["algorithms"]:
        lines.append(t2["note"])
    else:
        lines += [
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
    written = figures.write_figures(runs, extra["curves"], out)
    (out / "table1.json").write_text(json.dumps(t1, indent=2) + "\n")
    (out / "table2.json").write_text(json.dumps(t2, indent=2) + "\n")
    md = results_markdown(t1, extra, t2, written, baseline, reference)
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.runs is None or FLAGS.out is None:
        raise app.UsageError("--runs and --out are required.")
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
    app.run(_tables.main)
