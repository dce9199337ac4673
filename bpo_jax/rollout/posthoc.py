"""The post-hoc top-k ablation: branch a finished backbone at its highest-entropy steps.

BIASED by design (DESIGN.md, "Two traps"): the backbone's own later actions decide which of its
states get siblings. It is here to measure that bias. The lockstep loop keeps a snapshot before
every step of every backbone (`LivePath.history`); once the backbones have ended, each is cut
at its chosen steps (`ForestBuilder.cut`) and K - 1 new children per cut are forked from the
snapshots and played like any other path.
"""

from __future__ import annotations

import copy


def posthoc_branches(loop) -> list:
    """New live paths (with sandboxes) for every finished backbone's cuts; frees the snapshots.

    Args:
      loop: the `loop.LockstepLoop` that played the backbones.
    """
    planner, builder, pool = loop.planner, loop.builder, loop.pool
    planner.start_posthoc()
    new_paths = []
    for p in loop.finished_backbones:
        steps = builder.segments[p.segments[-1]].steps
        cuts = planner.posthoc_cuts(p, [s.entropies for s in steps])
        for t, children in builder.cut(p, cuts, loop.spec.num_branches - 1):
            handle, episode = p.history[t]
            sids = pool.fork(handle, len(children))
            loop.stats.restores += len(sids)
            for child, sid in zip(children, sids):
                child.sid, child.episode = sid, copy.deepcopy(episode)
                new_paths.append(child)
        for handle, _ in p.history:
            pool.release(handle)
        p.history = []
    return new_paths
