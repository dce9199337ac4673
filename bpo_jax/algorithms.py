"""RL algorithms as registry entries: a rollout topology, an advantage estimator, and checks.

Every algorithm goes through one pipeline (DESIGN.md, "Data flow"): rollouts are a forest
(independent groups are depth-1 forests, trees are deeper), a registered estimator
(`bpo_jax.estimators`) gives every step an advantage, and one clipped policy-gradient loss
updates the policy. An algorithm is therefore only a choice of topology and estimator, the
estimator's options from `config.train`, and whether a critic must be fitted first (PPO):

  ALGORITHMS["rloo"].topology            -> "independent"
  ALGORITHMS["rloo"].estimator_options(cfg.train) -> {"normalize": "none", "eps": 1e-6}

A new algorithm is one `register_algorithm(Algorithm(...))` call; `config.train.algo` accepts
every registered name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

TOPOLOGIES = ("independent", "tree")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One RL algorithm.

    Attributes:
      name: the `config.train.algo` value.
      topology: "independent" (`train.group_size` forks of each task's reset) or "tree" (the
        `config.rollout` trees: a root group of backbones plus online branch points).
      estimator: the name of the registered estimator (`bpo_jax.estimators.get_estimator`).
      needs_critic: fit a value head before the estimator runs (its values are an input).
      uses_obs_ids: the estimator groups steps by the observation they act on (GiGPO).
      uses_normalize: `train.normalize` applies (sibling-baseline estimators).
      options: `fn(train_spec) -> dict` of the estimator's keyword options.
      summary: one line for `--help`-style listings and the README.
    """

    name: str
    topology: str
    estimator: str
    options: Callable[[Any], dict] = lambda t: {}
    needs_critic: bool = False
    uses_obs_ids: bool = False
    uses_normalize: bool = False
    summary: str = ""

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}.")

    @property
    def branches(self) -> bool:
        return self.topology == "tree"

    def estimator_options(self, train) -> dict:
        """The estimator's keyword options under `train` (a `config.TrainSpec`)."""
        return self.options(train)

    def check(self, cfg) -> None:
        """Refuses settings that mean nothing for this algorithm (a `config.ExperimentConfig`).

        Raises:
          ValueError: naming the field.
        """
        if cfg.train.normalize != "none" and not self.uses_normalize:
            users = sorted(n for n, a in ALGORITHMS.items() if a.uses_normalize)
            raise ValueError(
                f"config.train.normalize={cfg.train.normalize!r} has no effect on "
                f"train.algo={self.name!r} (only {users} use it); set it to 'none'."
            )
        if self.branches and cfg.rollout.root_group < 2:
            raise ValueError(
                f"config.rollout.root_group must be >= 2 for train.algo={self.name!r} (without "
                "a root group the steps before the first branch point have no siblings and get "
                f"no gradient), got {cfg.rollout.root_group!r}."
            )


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algo: Algorithm) -> Algorithm:
    if algo.name in ALGORITHMS:
        raise ValueError(f"algorithm {algo.name!r} is already registered.")
    ALGORITHMS[algo.name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}.") from None


def _sibling_options(t) -> dict:
    return {"normalize": t.normalize, "eps": t.adv_eps}


register_algorithm(
    Algorithm(
        "grpo",
        "independent",
        "grpo",
        options=lambda t: {"eps": t.adv_eps},
        summary="(return - group mean) / group std",
    )
)
register_algorithm(
    Algorithm(
        "rloo",
        "independent",
        "rloo",
        options=_sibling_options,
        uses_normalize=True,
        summary="return - leave-one-out group mean",
    )
)
register_algorithm(
    Algorithm(
        "gigpo",
        "independent",
        "gigpo",
        options=lambda t: {"eps": t.adv_eps},
        uses_obs_ids=True,
        summary="episode-level plus step-level groups of identical observations",
    )
)
register_algorithm(
    Algorithm(
        "ppo",
        "independent",
        "gae",
        options=lambda t: {"gamma": t.gamma, "lam": t.gae_lambda, "eps": t.adv_eps},
        needs_critic=True,
        summary="turn-level GAE from a value head on the policy's features",
    )
)
register_algorithm(
    Algorithm(
        "bpo",
        "tree",
        "bpo",
        options=_sibling_options,
        uses_normalize=True,
        summary="segment value minus its siblings' leave-one-out mean",
    )
)
register_algorithm(
    Algorithm(
        "treerl",
        "tree",
        "treerl",
        summary="V(s) - V(root) plus V(s) - V(parent), scaled by 1/sqrt(leaves below)",
    )
)
register_algorithm(
    Algorithm(
        "bpo_traj",
        "tree",
        "bpo_traj",
        summary="BPO's tree, each segment against the task's other backbones (return from start)",
    )
)
register_algorithm(
    Algorithm(
        "bpo_shrink",
        "tree",
        "bpo_shrink",
        # lam stays the estimator's default (estimators.DEFAULT_SHRINK) until a run feeds it
        # from earlier batches' measured f (estimators.lambda_from_parts).
        summary="lam * bpo + (1 - lam) * bpo_traj advantages (lam from earlier batches' f)",
    )
)
