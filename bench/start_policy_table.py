r"""The start-policy table: demos x BC steps -> success on the development games, with CIs.

Reads BC-only runs (`train.iterations=0`, `env.eval_split=dev`) from `--runs` (each a workdir
with config.json and evals.json) and writes a markdown table and its JSON:

  PYTHONPATH=$PWD python bench/start_policy_table.py --runs=/work/runs/start_policy \
      --json=results/start_policy/table.json

Greedy and sampled success of the "before_rl" evaluation (the policy BC ended with) on split
`dev`, each with a Wilson 95% interval over its episodes (one per game).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bpo_jax.study.stats import wilson_ci

SORT_KEYS = ("demos", "bc_steps", "max_steps", "recovery", "history_turns", "notes", "digits")


def row(run: Path) -> dict | None:
    cfg = json.loads((run / "config.json").read_text())
    evals_path = run / "evals.json"
    if not evals_path.exists():
        return None
    evals = json.loads(evals_path.read_text())
    out = {
        "run": run.name,
        "demos": cfg["bc"].get("demos", "walkthrough"),
        "bc_steps": cfg["bc"]["steps"],
        "max_steps": cfg["env"]["max_steps"],
        "recovery": cfg["bc"].get("recovery", 0.0),  # Runs before bc.recovery had none.
        "history_turns": cfg["agent"]["history_turns"],
        "notes": cfg["agent"].get("notes", False),  # Runs before agent.notes had none.
        # The tokenizer's digits: "split" one piece each (the default), "joined" " 3" a piece.
        "digits": "split" if cfg["model"].get("tokenizer_split_digits", True) else "joined",
    }
    for kind, key in (("greedy", "before_rl/dev"), ("sampled", "before_rl/dev/sampled")):
        if key not in evals:
            continue
        episodes = evals[key]["eval/episodes"]
        wins, n = int(sum(episodes)), len(episodes)
        out[kind] = {"wins": wins, "n": n, "success": wins / n, "ci95": wilson_ci(wins, n)}
        out[f"{kind}_episode_len"] = evals[key].get("eval/episode_len")
    return out if "greedy" in out else None


def markdown(rows: list[dict]) -> str:
    lines = [
        "| demos | BC steps | max_steps | recovery | history | notes | digits "
        "| greedy dev success (95% CI) | sampled (95% CI) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for kind in ("greedy", "sampled"):
            if kind in r:
                g = r[kind]
                lo, hi = g["ci95"]
                cells.append(f"{g['wins']}/{g['n']} = {g['success']:.3f} ({lo:.3f}-{hi:.3f})")
            else:
                cells.append("n/a")
        lines.append(
            f"| {r['demos']} | {r['bc_steps']} | {r['max_steps']} | {r['recovery']} "
            f"| {r['history_turns']} | {'yes' if r['notes'] else 'no'} | {r['digits']} "
            f"| {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", required=True)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = [r for d in sorted(Path(args.runs).iterdir()) if (d / "config.json").exists()
            for r in [row(d)] if r is not None]  # fmt: skip
    rows.sort(key=lambda r: tuple(r[k] for k in SORT_KEYS))
    print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
