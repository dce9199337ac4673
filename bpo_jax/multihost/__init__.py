"""How the hosts of a slice play one batch: task shares, lockstep rounds, slice-wide sampling.

Above the rollout engine: it runs the engine once per share and merges what the hosts played.

May import: models, parallel, rollout, sampler.

Modules: `shares` (a batch played in shares, forests merged in task order), `lockstep` (the
hosts' policy calls turned into rounds every host runs alike), `slice_sampler` (those rounds as
SPMD programs over the whole mesh).
"""
