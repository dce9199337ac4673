r"""f for a run: how much of the return variance the branch points' histories explain.

  python -m bpo_jax.study.fshare --run=RUN_DIR [--json=PATH] [--seed=0]

prints, per branch-point depth (agent steps from the root) and over all depths, the branch
points, the bootstrap units and `f = Var(E[R | h]) / Var(R)` pooled over them (a ratio of sums,
`estimators.decomposition`) with its 95% percentile-bootstrap CI; and Table 2a
(`bpo_jax.study.table2a`: the per-decision E[A^2] of the sibling and the trajectory baseline on
the same trees) when the run recorded its per-(task, depth) parts (`branch_parts.jsonl`, which
every tree algorithm's run writes). The units are then tasks (each iteration's task one unit:
its branch points share backbones). A run with only the metrics' per-iteration sums gets f per
depth with a CI over iterations instead, and no Table 2a. The run may still be running (no
`summary.json` needed).

`bpo_jax.study.tables` adds the same tables per algorithm to results.md and table2.json when
the runs recorded f (`f_tables`, `f_markdown`).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import flags

from bpo_jax import cli
from bpo_jax.estimators import PART_SUMS
from bpo_jax.io.metrics import BRANCH_PARTS_FILE, METRICS_FILE, read_json_lines
from bpo_jax.study.records import RunRecord, f_parts_of
from bpo_jax.study.table2a import markdown, ratio_ci, table2a


def _units(parts_list: Sequence[dict]) -> np.ndarray:
    """Per row of the concatenated columns, its unit: the (column set, task) pair's number."""
    pairs = [(i, t) for i, p in enumerate(parts_list) for t in p["task"]]
    if not pairs:
        return np.zeros(0, np.int64)
    return np.unique(np.asarray(pairs), axis=0, return_inverse=True)[1].ravel()


def f_rows(
    parts_list: Sequence[dict],
    *,
    level: float = 0.95,
    num_resamples: int = 2000,
    rng: np.random.Generator | None = None,
) -> list[dict]:
    """f per depth and over all ("all"), with a bootstrap CI over units.

    Args:
      parts_list: per iteration, columns with task, depth, branch_points, between and
        var_return (`records.f_parts_of`); a (column set, task) pair is one unit.
      level, num_resamples: the CI's coverage and resamples.
      rng: the resamples' generator (default seed 0).

    Returns:
      Rows: depth, branch_points, units, between and var_return (sums), f, f_ci.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    unit = _units(parts_list)
    col = {
        k: np.concatenate([np.asarray(p[k], np.float64) for p in parts_list] or [np.zeros(0)])
        for k in ("depth", "branch_points", "between", "var_return")
    }
    rows = []
    for depth in [*np.unique(col["depth"]).astype(int).tolist(), "all"]:
        keep = np.ones(unit.size, bool) if depth == "all" else col["depth"] == depth
        if not keep.any():
            continue
        units, inverse = np.unique(unit[keep], return_inverse=True)
        sums = {
            k: np.bincount(inverse, col[k][keep], minlength=len(units))
            for k in ("branch_points", "between", "var_return")
        }
        f, ci = ratio_ci(
            sums["between"],
            sums["var_return"],
            method="bootstrap",
            level=level,
            num_resamples=num_resamples,
            rng=rng,
        )
        rows.append(
            {
                "depth": depth,
                "branch_points": int(sums["branch_points"].sum()),
                "units": int(len(units)),
                # Units whose backbones' returns varied: only these inform f (a ratio of sums).
                "units_with_variance": int(np.count_nonzero(sums["var_return"] > 0)),
                "between": float(sums["between"].sum()),
                "var_return": float(sums["var_return"].sum()),
                "f": f,
                "f_ci": ci,
            }
        )
    return rows


def f_tables(
    parts_list: Sequence[dict],
    unit: str,
    *,
    num_resamples: int = 2000,
    seed: int = 0,
    label: str = "",
) -> dict:
    """{"unit", "f": `f_rows`, "table2a": `table2a` rows or None}: Table 2a needs every part
    per task (unit "tasks"); each table draws from its own generator of (`seed`, `label`)."""
    rng = lambda stream: np.random.default_rng([seed, zlib.crc32(label.encode()), stream])
    out = {"unit": unit, "f": f_rows(parts_list, num_resamples=num_resamples, rng=rng(0))}
    full = unit == "tasks" and all(k in p for p in parts_list for k in PART_SUMS)
    has_rows = any(len(p["depth"]) for p in parts_list)
    out["table2a"] = None
    if full and has_rows:
        out["table2a"] = table2a(parts_list, num_resamples=num_resamples, rng=rng(1))
    return out


def _per_iteration(parts: dict) -> dict:
    """A column set's rows summed over its tasks: one row per depth, task 0."""
    depth = np.asarray(parts["depth"], np.int64)
    depths, inverse = np.unique(depth, return_inverse=True)
    out = {"task": [0] * len(depths), "depth": depths.tolist()}
    for name in ("branch_points", "between", "var_return"):
        out[name] = np.bincount(inverse, np.asarray(parts[name], np.float64), len(depths)).tolist()
    return out


def group_f_tables(
    runs: Sequence[RunRecord], *, seed: int = 0, num_resamples: int = 2000
) -> dict[str, dict]:
    """Per group (algorithm) whose runs recorded f: `f_tables` over all its runs' iterations.

    The units are tasks when every such run wrote its per-(task, depth) parts, else
    iterations (every run's parts summed per iteration).
    """
    groups: dict[str, list] = {}
    for r in runs:
        parts_list, unit = r.f_parts()
        if parts_list:
            groups.setdefault(r.group, []).append((parts_list, unit))
    out = {}
    for name, got in sorted(groups.items()):
        unit = "tasks" if all(u == "tasks" for _, u in got) else "iterations"
        parts = [p if unit == "tasks" else _per_iteration(p) for lst, _ in got for p in lst]
        out[name] = f_tables(parts, unit, num_resamples=num_resamples, seed=seed, label=name)
    return out


def section_markdown(tables: dict[str, dict]) -> list[str]:
    """results.md's section on f: per group its f table and Table 2a (lines)."""
    lines = [
        "## f: the share of return variance the branch points' histories explain",
        "",
        "f = Var(E[R|h]) / Var(R) at each branch-point depth (agent steps from the root), pooled "
        "over every run of the algorithm (a ratio of sums; `bpo_jax.study.fshare`), with 95% "
        "percentile-bootstrap CIs over tasks (an iteration's task is one unit) or, for runs "
        "without per-task records, over iterations. Table 2a compares each decision's E[A²] "
        "under the sibling baseline and under a trajectory baseline of m episodes, on the same "
        "trees (`bpo_jax.study.table2a`).",
    ]
    for name, t in tables.items():
        lines += ["", f"### {name}", "", f_markdown(t["f"], t["unit"]).rstrip("\n")]
        if t["table2a"] is not None:
            lines += ["", f"Table 2a ({name}):", "", markdown(t["table2a"]).rstrip("\n")]
    return lines + [""]


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def f_markdown(rows: Sequence[dict], unit: str) -> str:
    """The f table as Markdown."""
    lines = [
        f"| depth | branch points | {unit} | {unit} with Var(R) > 0 | f | 95% CI |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["f_ci"]
        ci = "n/a" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:.3f}, {hi:.3f}]"
        informative = r.get("units_with_variance", "n/a")
        lines.append(
            f"| {r['depth']} | {r['branch_points']} | {r['units']} | {informative} | "
            f"{_num(r['f'])} | {ci} |"
        )
    return "\n".join(lines) + "\n"


def jsonable(x):
    """Rows for JSON: tuples as lists, NaN and infinities as null."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def read_run_parts(run_dir: str | Path) -> tuple[list[dict], str]:
    """A run folder's f parts (`records.f_parts_of`) from its metrics and branch parts.

    Raises:
      ValueError: no such folder, no run files in it, or no f recorded.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"--run={run_dir}: no such folder.")
    metrics_path, parts_path = run / METRICS_FILE, run / BRANCH_PARTS_FILE
    if not metrics_path.is_file() and not parts_path.is_file():
        raise ValueError(
            f"--run={run_dir}: no {METRICS_FILE} or {BRANCH_PARTS_FILE}: not a run's folder."
        )
    metrics = read_json_lines(metrics_path) if metrics_path.is_file() else []
    parts = read_json_lines(parts_path) if parts_path.is_file() else []
    parts_list, unit = f_parts_of(metrics, parts)
    if not parts_list:
        algo = _algo(run)
        raise ValueError(
            f"--run={run_dir}: no f recorded (train.algo={algo}: only tree algorithms record "
            "it, and only runs made since f was recorded)."
        )
    return parts_list, unit


def _algo(run: Path) -> str:
    try:
        return str(json.loads((run / "config.json").read_text())["train"]["algo"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def report(run_dir: str | Path, *, seed: int = 0, num_resamples: int = 2000) -> tuple[str, dict]:
    """(the text the command prints, the tables as JSON-able data) for a run folder."""
    parts_list, unit = read_run_parts(run_dir)
    tables = f_tables(parts_list, unit, num_resamples=num_resamples, seed=seed)
    points = sum(int(np.sum(p["branch_points"])) for p in parts_list)
    head = (
        f"f = Var(E[R|h]) / Var(R) at the branch points of {run_dir} (train.algo="
        f"{_algo(Path(run_dir))}): {len(parts_list)} iterations, {points} branch points; "
        f"depth = agent steps from the root; 95% percentile-bootstrap CIs over {unit}."
    )
    text = [head, "", f_markdown(tables["f"], unit)]
    if tables["table2a"] is not None:
        text += ["Table 2a: per-decision E[A²], sibling against trajectory baseline", ""]
        text += [markdown(tables["table2a"])]
    else:
        text += [
            "No Table 2a: the run recorded only per-iteration sums (no branch_parts.jsonl)."
            if unit != "tasks"
            else "No Table 2a: no branch points."
        ]
    return "\n".join(text).rstrip("\n") + "\n", jsonable({"run": str(run_dir), **tables})


FLAGS = flags.FLAGS
PROG = "python -m bpo_jax.study.fshare"


def define_flags() -> None:
    flags.DEFINE_string("run", None, "A run's folder (metrics.jsonl, branch_parts.jsonl).")
    flags.DEFINE_string("json", None, "Also write the tables to this JSON file.")
    flags.DEFINE_integer("seed", 0, "Seed of the bootstrap resamples.")
    flags.DEFINE_integer("resamples", 2000, "Bootstrap resamples per CI.")


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; flags are --name=value", PROG)
    with cli.start_up_errors(PROG):
        if FLAGS.run is None:
            raise ValueError("--run is required.")
        read_run_parts(FLAGS.run)
    text, data = report(FLAGS.run, seed=FLAGS.seed, num_resamples=FLAGS.resamples)
    print(text, end="", flush=True)
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    from bpo_jax.study import fshare as _fshare

    _fshare.define_flags()
    cli.run(_fshare.main, PROG)
