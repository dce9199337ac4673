"""One process of the branch-rule x shares matrix for `test_branch_rules_shares.py`.

    python tests/branch_rules_worker.py OUT DEVICES MODE [COORDINATOR NUM_PROCESSES PROCESS_ID]

Gives JAX `DEVICES` CPU devices, starts its distributed runtime when a coordinator is named,
builds the tiny ALFWorld BPO run (`experiments/alfworld.py:cpu,algo=bpo`, shrunk: `CONFIG`;
no behaviour cloning) and, for every registered branch rule, plays rollout batches
(`rl.play_batch`, stage 1 of an RL iteration) from a fresh rollout state:
  MODE "one" (one process): one batch in one share, and `BATCHES` batches in two shares
    (`mesh.task_shards=2`); before each two-share batch, each of its shares is also played
    as a one-share batch of its own tasks with its key, on a copy of the rollout state the
    batch starts from (the rule's random stream started from the key, as a share's is:
    `rl.stream_seed`): what the two shares should measure;
  MODE "two" (each of several processes): the `BATCHES` two-share batches.
Process 0 writes `{rule: {"1" | "2" | "alone": [batch record (`record`), ...]}}` to OUT as
JSON ("alone": per batch, the two one-share records).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import tempfile

import jax

BATCHES = 2
# The tiny CPU config, shrunk to a few short episodes: 2 tasks per batch (one per share), trees
# that may branch twice per backbone, and returns that differ (an invalid action costs).
CONFIG = {
    "env.num_train_tasks": 2,
    "env.max_steps": 4,
    "env.num_workers": 1,
    "env.invalid_action_penalty": 0.1,
    "eval.num_tasks": 1,
    "bc.steps": 0,
    "train.tasks_per_iter": 2,
    "agent.max_prompt_tokens": 192,
    "model.max_seq_len": 256,
    # One length bucket for every prompt: fewer programs to compile.
    "sampler.length_bucket": 256,
}
# Fields a rule needs beyond the base config: `steps` branches at fixed steps it is given.
RULE_FIELDS = {"steps": {"branch_steps": "2"}}


def record(forest, rollout) -> dict:
    """What a batch played and the running statistics after it, as JSON data (the discrete
    parts exact; the floats as Python floats)."""
    return {
        "task_ids": list(forest.task_ids),
        "node_task": [int(x) for x in forest.node_task],
        "segments": [
            [
                int(s.task),
                int(s.parent),
                int(s.child),
                [[int(t) for t in step.action_ids] for step in s.steps],
                [float(step.reward) for step in s.steps],
            ]
            for s in forest.segments
        ],
        "leaves": [[int(leaf.task), list(leaf.segments), bool(leaf.won)] for leaf in forest.leaves],
        "branch_points": int(forest.num_branch_points),
        "stats": forest.stats.as_dict(),
        "task_cost": [float(x) for x in forest.task_cost],
        "budget": [float(x) for x in forest.budget],
        "rollout": json.loads(json.dumps(rollout.dump())),
    }


def main(argv):
    out_path, devices, mode, rest = argv[0], int(argv[1]), argv[2], argv[3:]
    # Global switches before any other JAX call (as bpo_jax.main does).
    jax.config.update("jax_num_cpu_devices", devices)
    from bpo_jax.parallel import distributed

    if rest:
        address, num, pid = rest
        distributed.initialize(address, int(num), int(pid))
    from bpo_jax.config import validate
    from bpo_jax.experiment import load_experiment
    from bpo_jax.rl import RolloutState, play_batch
    from bpo_jax.rollout.branching import SELECTORS
    from bpo_jax.train import open_run, setup

    raw = load_experiment("experiments/alfworld.py").get_config("cpu,algo=bpo")
    for key, value in CONFIG.items():
        section, field = key.split(".")
        raw[section][field] = value
    base = validate(raw)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp, open_run(base, tmp) as (run, mcfg, params):
        state = setup(run, mcfg, params)
        run.policy.params = state.train.params
        tasks = run.train_tasks[: base.train.tasks_per_iter]
        for rule in sorted(SELECTORS):
            results[rule] = {}
            for shares in (1, 2) if mode == "one" else (2,):
                cfg = dataclasses.replace(
                    base,
                    rollout=dataclasses.replace(
                        base.rollout, selector=rule, **RULE_FIELDS.get(rule, {})
                    ),
                    mesh=dataclasses.replace(base.mesh, task_shards=shares),
                )
                rollout = RolloutState.create(cfg)
                batches, alone = [], []
                for b in range(BATCHES if shares == 2 else 1):
                    key = jax.random.fold_in(jax.random.key(7), b)
                    if mode == "one" and shares == 2:
                        alone.append(_alone(run, tasks, cfg, rollout, key))
                    forest, _ = play_batch(run.pool, run.policy, tasks, cfg, rollout, key)
                    batches.append(record(forest, rollout))
                results[rule][str(shares)] = batches
                if alone:
                    results[rule]["alone"] = alone
                points = [b["branch_points"] for b in batches]
                print(f"{rule}, {shares} shares: branch points {points}", flush=True)
    if distributed.is_lead():
        with open(out_path, "w") as f:
            json.dump(results, f)


def _alone(run, tasks, cfg, rollout, key) -> list[dict]:
    """Each of the batch's two shares played as a one-share batch of its own tasks with its own
    key (`distributed.share_key`), on a copy of `rollout`: what the shares should measure."""
    from bpo_jax.parallel import distributed
    from bpo_jax.rl import play_batch, stream_seed

    one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, task_shards=1))
    out = []
    for s, part in enumerate(distributed.share_slices(len(tasks), 2)):
        sub = distributed.share_key(key, s, 2)
        local = copy.deepcopy(rollout)
        local.selector.reseed(stream_seed(sub))  # A share's rule draws from its key's stream.
        forest, _ = play_batch(run.pool, run.policy, tasks[part], one, local, sub)
        out.append(record(forest, local))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
