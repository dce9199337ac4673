"""A tree that chooses its own shape: the first-order variance model of a design, and the choice.

DESIGN.md ("When the variance claim holds"): at equal tokens no theorem says that a tree's
policy gradient is less noisy than independent groups'; a first-order model says where it is.
This module evaluates that model for candidate designs from measured quantities (`Profile`) and
picks the design with the lowest predicted trace that fits the task's budget (`choose_design`),
falling back to independent groups (K0 = N, no branching) where no tree is predicted to win.
What the profile is measured from, batch by batch, is `bpo_jax.rollout.design_stats`.

Design (`Design`). K0 backbones from the task's initial state; every path that reaches step d_1
branches into K children, every child that reaches d_2 branches again, and so on (nested
levels), while the task's budget lasts. The planner spends the budget in step order (`target`
mode), so a level the budget cannot pay for in full gets the branch points it can pay for, and
the levels below it none (`level_shares`). RLOO(N) is K0 = N with no levels.

Profile (per step t, T the episode's length, sigma^2 = Var(R) within a task):
  f(t) = Var(E[R | h_{min(t, T)}]) / sigma^2: the share of the return variance the history at
         step t explains (an episode that ended before t is explained whole); f(0) = 0, and f
         never decreases (E[R | h_t] is a martingale);
  s(t) = P(T > t), the share of episodes that take step t;
  c(t) = E[1{T > t} ||grad log pi(a_t | h_t)||^2], the score energy of step t;
  cost(t) = E[1{T > t} cost of step t], in the budget's unit.

The model, with sigma^2 = 1. For a segment from a node at step a to the next node at step b,
or to the end of the episode:
  G = E[1{T > a} Var(V | h_a)] = f(b) - f(a) + sum over the n children c of its end node of
      G_c / n^2 (the children are independent given h_b), or 1 - f(a) for a segment that runs to
      the end;
  S = sum of c(t) over the segment's steps.
A node at step a whose n children have path mass w adds
  (w^2 / s(a)) * sum_i E[A_i^2] S_i,   E[A_i^2] = G_i + sum_{j != i} G_j / (n - 1)^2
(leave-one-out baseline); the predicted trace of a task's gradient is the sum over the design's
nodes, counting a node of the design where a path may be (it exists with probability s(a)). It is
first order: it treats a segment's advantage as independent of the score of its own steps and
drops the cross terms between steps; the law of total variance down the tree is exact. For one
level (K0 backbones, all branching into K at step d, fixed length) it reduces to DESIGN.md's
  C_pre (f + (1 - f) / K) / (K0 - 1) + C_suf (1 - f) / (K0 (K - 1)),
and for RLOO(N) to (C_pre + C_suf) / (N - 1) (C_pre, C_suf: the score energy above and below d).
The weights are path masses (`step_weighting=path_mass`); with every episode of length H the
`trajectory` weights are the same divided by H, which cancels in a ratio.

Not modelled: branch points chosen by a score threshold (an entropy rule) rather than a step; a
design here branches at fixed steps (`StepsSelector`), a function of t alone.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bpo_jax.rollout.branching import BranchSelector, register_selector

TREES = ("fixed", "auto")  # rollout.tree: the configured tree, or a design chosen per batch.
DEFAULT_KS = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Measured (or exact) per-step quantities a design's trace is predicted from.

    Attributes:
      explained: float[H + 1], f(t) (see the module docstring); made nondecreasing, in [0, 1],
        with f(0) = 0.
      survival: float[H + 1], s(t) = P(T > t) (s(0) = 1, s(H) = 0).
      energy: float[H], c(t).
      cost: float[H], cost(t) (for env steps, s(t)).
    """

    explained: np.ndarray
    survival: np.ndarray
    energy: np.ndarray
    cost: np.ndarray

    def __post_init__(self):
        f = np.clip(np.asarray(self.explained, np.float64), 0.0, 1.0)
        f[0] = 0.0
        f = np.maximum.accumulate(f)
        arrays = {
            "explained": f,
            "survival": np.clip(np.asarray(self.survival, np.float64), 0.0, 1.0),
            "energy": np.maximum(np.asarray(self.energy, np.float64), 0.0),
            "cost": np.maximum(np.asarray(self.cost, np.float64), 0.0),
        }
        h = len(arrays["energy"])
        for name, size in (("explained", h + 1), ("survival", h + 1), ("cost", h)):
            if arrays[name].shape != (size,):
                raise ValueError(
                    f"Profile.{name} must have shape ({size},) for {h} steps, got "
                    f"{arrays[name].shape}."
                )
        for name, value in arrays.items():
            if not np.all(np.isfinite(value)):
                raise ValueError(f"Profile.{name} must be finite, got {value}.")
            object.__setattr__(self, name, value)

    @property
    def horizon(self) -> int:
        return len(self.energy)

    def remaining(self, t: int) -> float:
        """E[cost of the steps t, t + 1, ... of an episode] (0 where none is alive)."""
        return float(self.cost[t:].sum())

    def score(self, a: int, b: int) -> float:
        """The score energy of steps a .. b - 1."""
        return float(self.energy[a:b].sum())


@dataclasses.dataclass(frozen=True)
class Design:
    """A tree's shape: K0 backbones and nested branch levels at fixed steps.

    Attributes:
      root_group: K0, the backbones of a task.
      num_branches: K, children per branch point (the engine's `TreeSpec` has one K).
      depths: the steps at which paths branch, increasing (the children's first action is step
        d); empty: independent groups of K0.
    """

    root_group: int
    num_branches: int = 2
    depths: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "depths", tuple(int(d) for d in self.depths))
        if self.root_group < 2:
            raise ValueError(f"Design.root_group must be >= 2, got {self.root_group}.")
        if self.num_branches < 2:
            raise ValueError(f"Design.num_branches must be >= 2, got {self.num_branches}.")
        d = self.depths
        if any(x < 1 for x in d) or any(b <= a for a, b in zip(d, d[1:])):
            raise ValueError(f"Design.depths must be increasing steps >= 1, got {d}.")

    @property
    def branches(self) -> bool:
        return bool(self.depths)

    @property
    def tree(self) -> list[list[int]]:
        """[[0, K0], [d_1, K], ...]: (step, children) of every level, the root first."""
        return [[0, self.root_group]] + [[d, self.num_branches] for d in self.depths]

    def spec_fields(self) -> dict:
        """The `rollout.engine.TreeSpec` fields that give this shape (with `selector`)."""
        k, levels = self.num_branches, len(self.depths)
        return {
            "root_group": self.root_group,
            "num_branches": k,
            "branch_budget": sum(k**j for j in range(levels)),  # The subtree of one backbone.
            "max_depth": levels,
        }

    def selector(self) -> StepsSelector:
        return StepsSelector(self.depths)


def parse_steps(steps) -> tuple[int, ...]:
    """Branch steps from "3" or "2,6" (`rollout.branch_steps`) or a sequence: increasing, >= 1
    (none: a design that does not branch).

    Raises:
      ValueError: naming what is wrong with `steps`.
    """
    if isinstance(steps, str):
        try:
            steps = [int(x) for x in steps.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(
                f"branch steps must be integers like '3' or '2,6', got {steps!r}."
            ) from None
    out = tuple(int(t) for t in steps)
    if any(t < 1 for t in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"branch steps must be increasing steps >= 1, got {steps!r}.")
    return out


@register_selector("steps")
class StepsSelector(BranchSelector):
    """Branch every path at the given steps (earlier steps served first): a function of t.

    As `rollout.selector=steps` it plays a fixed `Design` from the config: the steps are
    `rollout.branch_steps`, K0 `root_group`, K `num_branches`, and `branch_budget` /
    `max_depth` as `Design.spec_fields` gives them (`branch_schedule=threshold`).
    """

    def __init__(self, steps=(), **_):
        self.steps = np.asarray(parse_steps(steps), np.int64)

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        steps = np.asarray(steps)
        return np.where(np.isin(steps, self.steps), -steps.astype(np.float64), np.nan)


def level_shares(design: Design, profile: Profile, budget: float = math.inf) -> list[float]:
    """Per level, the share of its paths that branch when the planner spends `budget` in step
    order: 1 for the levels paid in full, then one level paid in part, then 0.

    A task cannot spend another's slack: where some episodes end before the first level's step,
    its share is the mean over the number of backbones still running there (`_first_level`).
    """
    k = design.num_branches
    slack = budget - design.root_group * profile.remaining(0)
    paths, out = design.root_group, []
    for j, d in enumerate(design.depths):
        full = paths * (k - 1) * profile.remaining(d)
        if j == 0 and 0.0 < profile.survival[d] < 1.0 and math.isfinite(budget):
            share, slack = _first_level(design, profile, budget)
        elif full <= 0.0 or slack >= full * (1.0 - 1e-9):
            share = 1.0
            slack -= full
        else:
            share = max(slack, 0.0) / full
        out.append(share)
        if share < 1.0 - 1e-9:
            break
        paths *= k
    return out + [0.0] * (len(design.depths) - len(out))


def _first_level(design: Design, profile: Profile, budget: float) -> tuple[float, float]:
    """(share, slack left) of the first level when episodes may end before its step d: a task
    whose a ~ Binomial(K0, s(d)) backbones still run at d has the slack its budget leaves after
    the ended ones' costs and the running ones' expected costs, and branches min(a, slack /
    cost of a branch) of them (the planner's `target` rule, in expectation)."""
    k0, d = design.root_group, design.depths[0]
    s = float(profile.survival[d])
    alive = profile.survival[:d] > 0
    before = float(np.sum(profile.cost[:d][alive] / profile.survival[:d][alive]))
    rest = profile.remaining(d) / s  # Expected cost of a running path from d on.
    ended = (profile.remaining(0) - s * before - profile.remaining(d)) / (1.0 - s)
    per_branch = (design.num_branches - 1) * rest
    branched, left = 0.0, 0.0
    for a in range(k0 + 1):
        weight = math.comb(k0, a) * s**a * (1.0 - s) ** (k0 - a)
        slack = budget - (k0 - a) * ended - a * (before + rest)
        points = min(max(slack / per_branch, 0.0), a)
        branched += weight * points
        left += weight * max(slack - points * per_branch, 0.0)
    return min(branched / (k0 * s), 1.0), left


def expected_cost(design: Design, profile: Profile, budget: float = math.inf) -> float:
    """A task's expected spend under `design` and `budget` (in the profile's cost unit)."""
    k, paths = design.num_branches, design.root_group
    total = paths * profile.remaining(0)
    for d, share in zip(design.depths, level_shares(design, profile, budget)):
        total += share * paths * (k - 1) * profile.remaining(d)
        paths *= k
    return total


def _trace(design: Design, profile: Profile, shares: list[float]) -> float:
    """The model's trace (module docstring) with `shares[j]` of the level-j paths branching at
    `depths[j]` (level 0: the backbones); the levels after the first share of 0 are unused."""
    f, k, k0, h = profile.explained, design.num_branches, design.root_group, profile.horizon
    used = 0
    while used < len(shares) and shares[used] > 0:
        used += 1
    share = [*shares[:used], 0.0]  # Level `used` runs out.
    starts = [0, *design.depths[:used]]  # The step at which each level's segments start.
    # Per level, bottom-up: (G, S) of a segment that branches and of one that runs out.
    branched, run_out = [(0.0, 0.0)] * (used + 1), [(0.0, 0.0)] * (used + 1)
    for j in range(used, -1, -1):
        a = starts[j]
        run_out[j] = (1.0 - f[a], profile.score(a, h))
        if j < used:
            b, p = design.depths[j], share[j + 1]
            g_kids = p * branched[j + 1][0] + (1.0 - p) * run_out[j + 1][0]
            branched[j] = (f[b] - f[a] + g_kids / k, profile.score(a, b))
    total, nodes = 0.0, 1.0  # `nodes`: the design's nodes whose children are level j.
    for j in range(used + 1):
        n, w, s, p = (k0 if j == 0 else k), 1.0 / (k0 * k**j), profile.survival[starts[j]], share[j]
        if nodes > 0 and s > 0:
            (gb, sb), (gn, sn) = branched[j], run_out[j]
            sum_gs = n * (p * gb * sb + (1.0 - p) * gn * sn)
            sum_g = n * (p * gb + (1.0 - p) * gn)
            sum_s = n * (p * sb + (1.0 - p) * sn)
            c = 1.0 / (n - 1) ** 2
            total += nodes * w * w / s * ((1.0 - c) * sum_gs + c * sum_g * sum_s)
        nodes *= n * p
    return total


def predicted_trace(design: Design, profile: Profile, budget: float = math.inf) -> float:
    """The model's trace of one task's gradient under `design` and `budget`, in units of
    Var(R) (module docstring). A level paid in part has floor or ceil of its expected number of
    branch points (the planner's coin): the trace is that mixture's."""
    shares = level_shares(design, profile, budget)
    partial = next((j for j, p in enumerate(shares) if 0 < p < 1), None)
    if partial is None:
        return _trace(design, profile, shares)
    paths = design.root_group * design.num_branches**partial
    count = shares[partial] * paths
    lo = math.floor(count)
    mix = count - lo

    def at(points: int) -> float:
        return _trace(design, profile, [*shares[:partial], points / paths, 0.0])

    return (1.0 - mix) * at(lo) + (mix * at(lo + 1) if mix > 0 else 0.0)


def predicted_ratio(design: Design, profile: Profile, n: int, budget: float | None = None):
    """Predicted trace of `design` over that of RLOO(n), at `budget` (default: n episodes)."""
    budget = n * profile.remaining(0) if budget is None else budget
    return predicted_trace(design, profile, budget) / predicted_trace(Design(n), profile)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A chosen design: `design`, its predicted trace over RLOO(n)'s (`ratio`), its expected
    spend over the budget (`spend`), and the best tree's ratio when none was chosen."""

    design: Design
    ratio: float
    spend: float
    best_tree_ratio: float


def candidate_depths(profile: Profile, max_depths: int = 24) -> list[int]:
    """Steps a design may branch at: those some episode reaches, at most `max_depths` of them
    (evenly spread over the episode)."""
    live = [t for t in range(1, profile.horizon) if profile.survival[t] > 0]
    if len(live) <= max_depths:
        return live
    idx = np.unique(np.round(np.linspace(0, len(live) - 1, max_depths)).astype(int))
    return [live[i] for i in idx]


def candidates(n: int, depths: list[int], ks=DEFAULT_KS, max_levels: int = 2) -> list[Design]:
    """Every tree with K0 in 2 .. n - 1, K in `ks`, and 1 .. `max_levels` levels at `depths`."""
    sets = [(d,) for d in depths]
    if max_levels >= 2:
        sets += [(a, b) for i, a in enumerate(depths) for b in depths[i + 1 :]]
    if max_levels >= 3:
        raise ValueError(f"max_levels must be 1 or 2, got {max_levels}.")
    return [Design(k0, k, ds) for k0 in range(2, n) for k in ks for ds in sets]


def choose_design(
    profile: Profile,
    n: int,
    budget: float | None = None,
    *,
    ks=DEFAULT_KS,
    max_levels: int = 2,
    margin: float = 0.05,
    max_depths: int = 24,
) -> Choice:
    """The design with the lowest predicted trace at `budget`, against RLOO(n).

    Args:
      profile: the measured quantities.
      n: the baseline's group size N; the budget defaults to N episodes.
      budget: the task's budget in the profile's cost unit.
      ks, max_levels, max_depths: the candidates (`candidates`, `candidate_depths`).
      margin: a tree is chosen only if predicted below 1 - margin (the model is first order
        and the profile measured); otherwise independent groups of N.

    Returns:
      A `Choice`; its design is `Design(n)` (no branching) where no tree is predicted to win.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}.")
    budget = n * profile.remaining(0) if budget is None else float(budget)
    rloo = predicted_trace(Design(n), profile)
    best, best_ratio = None, math.inf
    for design in candidates(n, candidate_depths(profile, max_depths), ks, max_levels):
        ratio = predicted_trace(design, profile, budget) / rloo
        if ratio < best_ratio:
            best, best_ratio = design, ratio
    if best is None or not best_ratio < 1.0 - margin:
        fallback = Design(n)
        spend = expected_cost(fallback, profile) / budget if budget > 0 else 1.0
        return Choice(fallback, 1.0, spend, best_ratio)
    spend = expected_cost(best, profile, budget) / budget if budget > 0 else 1.0
    return Choice(best, best_ratio, spend, best_ratio)
