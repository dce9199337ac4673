r"""What a saved policy does: greedy transcripts of a few evaluation games, and where it goes wrong.

Plays one greedy episode of each of the first `--tasks` games of an evaluation split with a
run's latest policy, prints every turn (action, whether the game executed it, the reply), and
sums up, over all the turns played:

  executed      the game executed the action (ALFWorld replies "Nothing happens." otherwise);
  in_room       a `go to X` / `open X` / `take Y from X` names a receptacle of the room's
                first observation (the policy copied a name that exists);
  repeats       the action repeats the previous one (a policy stuck in a loop);
  parse_fail    no action could be parsed from the generated text.

  python bench/play_transcripts.py --source=/work/runs/start_policy/search_s1200_m32 \
      --set env.eval_split=dev --tasks=4 --json=/tmp/transcripts.json

`--source` is a run directory with `config.json` and `checkpoints/`; its saved config is used
(its splits, step limit and turn format) over today's `--config` defaults, with `--set`
overrides on top.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import jax

from bpo_jax.config import validate
from bpo_jax.evaluation import make_agent
from bpo_jax.experiment import load_experiment
from bpo_jax.rollout.engine import play
from bpo_jax.train import open_run, setup
from envs.alfworld.inadmissible import room_receptacles

_TARGET = re.compile(r"^(?:go to|open|close|examine) (.+)$|^(?:take|move) .+ (?:from|to) (.+)$")


def in_room(target: str, room: dict[str, int]) -> bool:
    """Whether 'drawer 3' is a receptacle of a room whose highest drawer is `room['drawer']`."""
    cls, _, number = target.rpartition(" ")
    return number.isdigit() and 1 <= int(number) <= room.get(cls, 0)


def action_target(action: str | None) -> str | None:
    """The receptacle an action names ('go to cabinet 1' -> 'cabinet 1'), or None."""
    if not action:
        return None
    m = _TARGET.match(action.strip().lower())
    return (m.group(1) or m.group(2)) if m else None


def summarise(episodes: list[dict]) -> dict:
    turns = [t for e in episodes for t in e["turns"]]
    named = [t for t in turns if t["target"] is not None]
    n = max(len(turns), 1)
    return {
        "episodes": len(episodes),
        "won": sum(e["won"] for e in episodes),
        "turns": len(turns),
        "executed": sum(t["executed"] for t in turns) / n,
        "in_room": sum(t["in_room"] for t in named) / max(len(named), 1),
        "repeats": sum(t["repeat"] for t in turns) / n,
        "parse_fail": sum(t["action"] is None for t in turns) / n,
    }


def saved_run_config(source: Path, config: str, sets=()):
    """The validated config that replays a saved run's policy: today's config of `config`
    (path[:variant]) with every field the run saved (an older run's config may lack fields added
    since; they keep today's defaults), `init_from` the run, no training, every evaluation task,
    then the `sets` ("SECTION.FIELD=VALUE") on top.

    Raises:
      ValueError: `source` is not a run directory, or a `sets` item names no config field.
    """
    if not (source / "checkpoints").is_dir() or not (source / "config.json").is_file():
        raise ValueError(f"--source={source} needs config.json and a checkpoints/ folder")
    saved = json.loads((source / "config.json").read_text())
    path, _, variant = config.partition(":")
    raw = load_experiment(path).get_config(variant)
    for section, value in saved.items():
        if section not in raw:
            continue
        if isinstance(value, dict):
            for name, v in value.items():
                if name in raw[section]:
                    raw[section][name] = tuple(v) if isinstance(v, list) else v
        else:
            raw[section] = value
    raw.init_from = str(source)
    raw.train.iterations = 0
    raw.eval.num_tasks = 0
    raw.bc.steps = 0  # The policy is the checkpoint's; no demos are needed.
    for item in sets:
        field, eq, value = item.partition("=")
        section, _, name = field.partition(".")
        if not eq or not name or section not in raw or name not in raw[section]:
            raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE naming a config field")
        old = raw[section][name]
        raw[section][name] = value.lower() == "true" if isinstance(old, bool) else type(old)(value)
    return validate(raw)


def source_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a script that replays a saved run's policy (`saved_run_config`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--source", required=True, help="run directory whose policy is replayed")
    ap.add_argument("--config", default="experiments/alfworld.py:cpu")
    ap.add_argument("--json", default="")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    return ap


def parse_source(ap: argparse.ArgumentParser, argv=None):
    """(args, the source run's directory, its replay config); a bad flag exits with usage."""
    args = ap.parse_args(argv)
    source = Path(args.source).absolute()
    try:
        return args, source, saved_run_config(source, args.config, args.set)
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    ap = source_parser(__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=4, help="first N games of the first split")
    ap.add_argument("--quiet", action="store_true", help="print the summary only")
    args, source, cfg = parse_source(ap, argv)
    with tempfile.TemporaryDirectory() as tmp, open_run(cfg, Path(tmp)) as (run, mcfg, params):
        state = setup(run, mcfg, params)
        run.policy.params = state.train.params
        split, tasks = next(iter(run.eval_tasks.items()))
        tasks = tasks[: args.tasks]
        trajs, _ = play(
            run.pool,
            run.policy,
            tasks,
            1,
            rng=jax.random.key(0),
            greedy=True,
            agent=make_agent(cfg, run.policy.tokenizer),
        )
    episodes = []
    for traj in trajs:
        room = traj.steps[0].state_text if traj.steps else ""
        names = room_receptacles(room)
        turns, prev = [], None
        for s in traj.steps:
            target = action_target(s.action_text)
            turns.append(
                {
                    "action": s.action_text,
                    "executed": not s.invalid,
                    "target": target,
                    "in_room": in_room(target, names) if target else False,
                    "repeat": s.action_text is not None and s.action_text == prev,
                    "observation": s.observation[:160],
                }
            )
            prev = s.action_text
        episodes.append({"task": traj.task_id, "won": bool(traj.won), "turns": turns})
        if not args.quiet:
            print(f"\n== {traj.task_id} ({'won' if traj.won else 'lost'})\n   room: {room[:300]}")
            for i, t in enumerate(turns):
                mark = "ok " if t["executed"] else "-- "
                print(f"  {i:2d} {mark}{t['action']!s:40.40} | {t['observation'][:90]}")
    summary = summarise(episodes)
    print(
        f"\n{split}: "
        + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
        )
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"split": split, "summary": summary, "episodes": episodes}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
