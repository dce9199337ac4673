"""Tables 1 and 2 read from run records: success per algorithm over seeds with bootstrap CIs,
IQMs, spend and updates to reach, paired differences (Table 1), and the probes' gradient-variance
ratios (Table 2).

The records it reads and the tables' fields are described in `bpo_jax.study.tables`, which writes
the tables (JSON, results.md) and the figures.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bpo_jax.study import stats
from bpo_jax.study.records import ProbeRecord, RunRecord

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


def probe_group(path: Path) -> str:
    """The configuration a probe folder measured: its name without a seed (`probe/shared`,
    `probe/seed_3` -> ""; `probe/design`, `probe/design_seed_3` -> "design")."""
    name = re.sub(r"(^|_)seed_\d+$", "", Path(path).name)
    return "" if name == "shared" else name


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
    relative to `root` (the `--runs` folder) where given.

    The probes of the sweep's own configuration make the table; a probe of its own
    configuration (`Sweep.probe` with a name, e.g. a fixed design a pilot chose) gets a table of
    its own under `designs` (name -> its `design` record, `algorithms`, and per tree algorithm
    `explained`: f per depth and Table 2a over the probe's batches)."""
    groups: dict[str, list] = {}
    for r in runs:
        if r.probe is not None:
            groups.setdefault(probe_group(r.path), []).append(r)
    table = _ratio_table(groups.pop("", []), baseline, seed, num_resamples, root, "")
    for name, members in sorted(groups.items()):
        sub = _ratio_table(members, baseline, seed, num_resamples, root, name)
        sub["design"] = members[0].probe.get("design")
        for algo, row in sub["algorithms"].items():
            explained = [m.probe["results"].get(algo, {}).get("explained") for m in members]
            if len(members) == 1 and explained[0] is not None:
                row["explained"] = explained[0]
        table.setdefault("designs", {})[name] = sub
    return table


def _ratio_table(probe_runs, baseline, seed, num_resamples, root, group: str) -> dict:
    """`build_table2`'s table of one configuration's probes (at most one per seed)."""
    probes: dict[int, RunRecord | ProbeRecord] = {}
    notes = []
    for r in probe_runs:
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
            label = f"t2/{group}/{name}" if group else f"t2/{name}"
            ci = list(stats.bootstrap_mean_ci(ratios, rng_for(seed, label), num_resamples))
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
