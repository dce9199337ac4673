"""A batch of tasks played in shares, one host per share: the rollout side of multi-host runs.

Each host plays its shares of the batch (`distributed.my_shares`: contiguous slices of the task
list, each one batch with its own key) with its own sandbox pool; a tree never spans hosts. Where
it samples is `mesh.sampler` (`SAMPLER_MODES`): "host", on its own devices (the policy holds a
copy of the parameters there), or "slice", in programs over the whole mesh that every host's
calls join in lockstep (`bpo_jax.multihost.slice_sampler`), as TPU slices with limited ICI routing
(v5e,
v6e) require: they refuse programs on a subset of their chips. The hosts then exchange what
they played, so every host holds the whole batch's forest in task order (`merge_forests`),
computes the same advantages and metrics, and feeds the same global update. The rollouts'
running statistics (branch rule, lengths, costs) are read as they stood at the start of the
batch by every share; each share's `play` returns what it measured as plain data
(`bpo_jax.rollout.branching.Measurements`) with its result, and the caller feeds those to the
running statistics in share order (`rl.RolloutState.absorb`), so the outcome depends on the
number of shares, not on which process played which.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from bpo_jax.parallel import distributed
from bpo_jax.rollout.forest import ComputeStats, RolloutForest

# Where a multi-host run samples (`config.mesh.sampler`; module docstring).
SAMPLER_MODES = ("host", "slice")


def play_in_shares(
    tasks: Sequence, shares: int, rng, policy, play: Callable[[list, object, int, object], object]
) -> list[tuple[slice, object]]:
    """`play(tasks of share s, key of share s, s, policy)` for this process's shares, gathered.

    With a slice-wide policy (`Policy.slice_wide`) in a multi-process run, `play` gets a
    `lockstep.LockstepPolicy` in `policy`'s place and runs in a worker thread, its sampling
    joined with the other hosts' (`slice_sampler.play_slice_wide`).

    Returns:
      [(slice of `tasks`, result)] for every non-empty share, in share order, on every process.
      A collective: every process must call it at the same point.
    """
    slices = distributed.share_slices(len(tasks), shares)

    def play_mine(policy_) -> list:
        mine = []
        for s in distributed.my_shares(shares):
            if slices[s].stop > slices[s].start:
                key = distributed.share_key(rng, s, shares)
                mine.append((s, play(list(tasks[slices[s]]), key, s, policy_)))
        return mine

    if getattr(policy, "slice_wide", False) and distributed.process_count() > 1:
        from bpo_jax.multihost.slice_sampler import play_slice_wide  # Local: imports the sampler.

        rng = distributed.local_key(rng)
        mine = play_slice_wide(policy, play_mine)
    else:
        with distributed.on_local_mesh():
            rng = distributed.local_key(rng)
            mine = play_mine(policy)
    gathered = [item for part in distributed.allgather_objects(mine) for item in part]
    return [(slices[s], result) for s, result in sorted(gathered, key=lambda x: x[0])]


def merge_forests(forests: Sequence[RolloutForest]) -> RolloutForest:
    """One forest of several batches' forests, their tasks concatenated in order.

    Node numbering stays the forest convention (every task's root first, then branch points in
    creation order): the batches' roots, then the first batch's branch points, then the
    second's, ...; segments and leaves are renumbered to match. Seconds are summed over the
    batches (host-seconds).
    """
    forests = list(forests)
    if len(forests) == 1:
        return forests[0]
    num_tasks = sum(len(f.task_ids) for f in forests)
    # Each task keeps the budget its share measured for it (budgets are per task).
    budget = np.concatenate(
        [np.broadcast_to(np.asarray(f.budget, np.float64), (len(f.task_ids),)) for f in forests]
    )
    segments, leaves, node_task, task_cost = [], [], [], []
    stats, seconds = ComputeStats(), collections.Counter()
    task_off, branch_off = 0, num_tasks
    roots = []
    for f in forests:
        t, b = len(f.task_ids), f.num_branch_points

        def node(i, t=t, task_off=task_off, branch_off=branch_off):
            if i < 0:
                return i
            return task_off + i if i < t else branch_off + i - t

        seg_off = len(segments)
        segments += [
            dataclasses.replace(
                s, task=s.task + task_off, parent=node(s.parent), child=node(s.child)
            )
            for s in f.segments
        ]
        leaves += [
            dataclasses.replace(
                leaf, task=leaf.task + task_off, segments=[i + seg_off for i in leaf.segments]
            )
            for leaf in f.leaves
        ]
        roots += [task_off + f.node_task[i] for i in range(t)]
        node_task += [task_off + x for x in f.node_task[t:]]
        task_cost.append(np.asarray(f.task_cost, np.float64))
        stats.add(f.stats)
        seconds.update(f.seconds)
        task_off += t
        branch_off += b
    return RolloutForest(
        task_ids=[i for f in forests for i in f.task_ids],
        segments=segments,
        leaves=leaves,
        node_task=roots + node_task,
        stats=stats,
        task_cost=np.concatenate(task_cost),
        budget=budget,
        seconds=dict(seconds),
    )
