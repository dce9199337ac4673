"""Cohorts of a rollout batch: groups of tasks whose turns the lockstep engine pipelines.

`bpo_jax.rollout.engine` plays a batch's tasks in cohorts (contiguous blocks of tasks, every path
of a
task in its task's cohort): while one cohort samples its next actions on the accelerator, the
others' environment steps run in the sandbox workers (`SandboxPool.submit_steps`). Each cohort
has its own PRNG key (one cohort keeps the run's key, so plain lockstep is unchanged) and its
own prefix cache for the policy's prefills.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bpo_jax.rollout.forest_builder import LivePath

__all__ = ["Cohort", "cohort_prefixes", "split_cohorts"]


@dataclasses.dataclass
class Cohort:
    """Tasks whose live paths play turns together; see the module docstring.

    `turn` holds the turn being played between its sampling and its steps' collection.
    """

    index: int
    key: object  # Its PRNG key; each of its turns folds in the turn counter.
    live: list[LivePath] = dataclasses.field(default_factory=list)
    turns: int = 0
    pending: object = None  # `PendingSteps` of the submitted turn.
    turn: tuple = ()  # (prompts, rows, samples, actions) of the submitted turn.
    prefixes: object = None  # Its own prefix cache (`cohort_prefixes`), None: the policy's.


def split_cohorts(
    num_tasks: int, cohorts: int, rng, policy=None
) -> tuple[list[Cohort], np.ndarray]:
    """`min(cohorts, num_tasks)` cohorts of contiguous tasks, and each task's cohort index.

    Cohort c's key is `fold_in(rng, 2**21 + c)`, or `rng` itself when there is one cohort.
    """
    import jax  # Local: keeps this module importable without initialising JAX.

    if cohorts < 1:
        raise ValueError(f"cohorts must be >= 1, got {cohorts}.")
    n = max(1, min(cohorts, num_tasks))
    keys = [rng] if n == 1 else [jax.random.fold_in(rng, 2**21 + c) for c in range(n)]
    caches = cohort_prefixes(policy, n)
    out = [Cohort(c, keys[c], prefixes=caches[c]) for c in range(n)]
    cohort_of = np.zeros((num_tasks,), np.int64)
    for c, block in enumerate(np.array_split(np.arange(num_tasks), n)):
        cohort_of[block] = c
    return out, cohort_of


def cohort_prefixes(policy, n: int) -> list:
    """Per cohort, the prefix cache its prefills continue (None: the policy's own).

    A `PrefixCache` keeps only its previous call's rows, so cohorts taking turns through one
    cache would each continue the other's prompts and reuse nothing. Cohort 0 keeps the
    policy's own cache; the others get empty ones like it.
    """
    own = getattr(policy, "prefixes", None)
    if own is None or n == 1:
        return [None] * n
    from bpo_jax.sampler.prefixes import PrefixCache  # Local: JAX only where a policy has one.

    return [None] + [
        PrefixCache(
            own.sampler, own.new_cache, min_shared=own.min_shared, batch_rows=own.batch_rows
        )
        for _ in range(n - 1)
    ]
