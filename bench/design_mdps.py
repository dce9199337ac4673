"""Tabular MDPs with a chosen f at a chosen step, for the variance map's designs.

`split_mdp(horizon, d, f)`: the return is paid at the last step and is
`g(a_0 .. a_{d-1}) + beta * eps(a_0 .. a_{H-1})` (g, eps independent N(0, 1) tables; `binary`:
1 when that sum is > 0, a success like ALFWorld's), with `beta` solved so that the share of the
return variance the history at step d explains, `f(d) = Var(E[R | h_d]) / Var(R)`, is `f` under
the map's policy (`random_logits(seed=1, scale=0.7)`). Before d, f rises from 0; after d it rises
to 1 at the end.
"""

from __future__ import annotations

import functools

import numpy as np

from envs.tabular import TreeMDP, random_logits
from envs.tabular.profile import step_profile

LOGIT_SEED, LOGIT_SCALE = 1, 0.7  # The map's policy.


def _split_rewards(horizon: int, num_actions: int, d: int, beta: float, binary: bool, seed: int):
    rng = np.random.default_rng(seed)
    a = num_actions
    num_states = (a**horizon - 1) // (a - 1)
    g = rng.normal(size=a**d)  # One value per history of d actions.
    eps = rng.normal(size=a**horizon)  # One value per whole episode.
    rewards = np.zeros((num_states, a))
    first_last = num_states - a ** (horizon - 1)
    leaves = num_states + np.arange(a**horizon)  # Heap ids of the leaves, in order.
    anc = leaves.copy()
    for _ in range(horizon - d):
        anc = (anc - 1) // a
    first_at_d = (a**d - 1) // (a - 1)
    value = g[anc - first_at_d] + beta * eps
    if binary:
        value = (value > 0).astype(np.float64)
    rewards[first_last:] = value.reshape(-1, a)
    return rewards


def split_f(horizon: int, d: int, beta: float, binary: bool, seed: int, num_actions: int = 2):
    mdp = TreeMDP(
        "split", num_actions, horizon, _split_rewards(horizon, num_actions, d, beta, binary, seed)
    )
    logits = random_logits(mdp, seed=LOGIT_SEED, scale=LOGIT_SCALE)
    return step_profile(mdp, logits)["explained"][d]


@functools.cache
def split_mdp(
    horizon: int, d: int, f: float, binary: bool = False, seed: int = 0, num_actions: int = 2
) -> TreeMDP:
    """The split MDP whose f at step d is `f` (within 1e-3; 0.03 for `binary`, whose f moves in
    steps as beta flips single episodes); f = 1 gives beta = 0."""
    if f >= 1.0:
        beta = 0.0
    else:
        lo, hi = -6.0, 6.0  # log beta; f falls as beta grows.
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if split_f(horizon, d, float(np.exp(mid)), binary, seed, num_actions) > f:
                lo = mid
            else:
                hi = mid
        beta = float(np.exp(0.5 * (lo + hi)))
    got = split_f(horizon, d, beta, binary, seed, num_actions)
    if abs(got - f) > (0.03 if binary else 1e-3):
        raise ValueError(f"no beta gives f={f} at step {d} (closest {got:.4f})")
    kind = "binary" if binary else "gauss"
    name = f"split(H={horizon},d={d},f={got:.3f},{kind},seed={seed},beta={beta:.4g})"
    rewards = _split_rewards(horizon, num_actions, d, beta, binary, seed)
    return TreeMDP(name, num_actions, horizon, rewards)
