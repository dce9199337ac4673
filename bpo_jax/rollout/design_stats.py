"""What a tree's shape is chosen from (`rollout.tree=auto`): measurements of earlier batches.

`DesignStats` keeps, for a window of recent batches, sums over each batch's tasks from which a
`design.Profile` is estimated; `TreeChooser` picks each batch's design from the batches before
it (`design.choose_design`), never from the batch it plays, so whether and where a task branches
does not depend on the returns it is about to sample (the design is fixed before the batch
starts; every branch rule below is a function of the step alone): the estimator stays unbiased.

Per batch, with w the path mass of a leaf or a segment (a task's leaves' masses sum to 1, so a
mass-weighted sum over a task's leaves is an unbiased estimate of an expectation over one
episode; so is K0 w summed over the leaves below one backbone), T a leaf's length, R its return:
- alive[t] = sum over leaves of w 1{T > t}: s(t) = alive[t] / tasks;
- pairs[t] = per task, the mean over ordered pairs of different backbones b, b' of
  sum over leaves l below b and m below b' of K0 w_l K0 w_m 1{T_l > t} (R_l - R_m)^2: two
  backbones are independent episodes, so its mean is E[1{T > t} (R - J)^2] + s(t) Var(R)
  (unbiased, unlike a spread around the task's own mean return); pairs[0] = 2 Var(R);
- energy[t] = sum over the steps at t of w(segment) * sum over the action's tokens of
  (1 - p(token)): for a softmax over logits, E[1 - p(sampled)] = 1 - ||p||^2 = E||d log p /
  d logits||^2, so this is unbiased for the score energy c(t) in logit space (the parameter-space
  energy is assumed proportional to it);
- cost[t] = the same with the step's cost (generated tokens, or 1 per env step);
- between[t], var_return[t], points[t]: the branch points at step t, summed over the batch's
  tasks (`estimators.branch_stats`, `task_depth_parts(by="step")`): f among the paths alive at t
  is between / var_return.
f(t) of the profile (the share explained by h_{min(t, T)}, ended episodes explained whole) is
1 - E[1{T > t} Var(R | h_t)] / Var(R) = 1 - E[1{T > t} (R - J)^2] / Var(R) + s(t) f_alive(t)
at the steps with branch points, made
nondecreasing (weighted isotonic regression, weights = branch points) between f(0) = 0 and
f = 1 at the longest measured length, and linear in t between the steps measured. With an
entropy rule (the `fixed` prior) the branch points are where the rule fired, not every path at
t, so f there is f of the paths the rule picked.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from bpo_jax.rollout.design import DEFAULT_KS, Choice, Profile, choose_design

SUMS = ("alive", "pairs", "energy", "cost", "between", "var_return", "points")


def _step_of_nodes(forest) -> dict[int, int]:
    """The step every node of the forest comes before (roots: 0)."""
    ending = {seg.child: seg for seg in forest.segments if seg.child >= 0}
    steps = {root: 0 for root in range(len(forest.task_ids))}

    def step_of(node: int) -> int:
        if node not in steps:
            seg = ending[node]
            steps[node] = step_of(seg.parent) + len(seg.steps)
        return steps[node]

    for node in ending:
        step_of(node)
    return steps


def branch_parts(forest) -> dict[str, np.ndarray]:
    """The forest's branch points summed per step (`estimators.task_depth_parts`, by step)."""
    from bpo_jax.estimators import branch_stats, task_depth_parts

    arrays = forest.arrays()
    if not forest.num_branch_points:
        return {"depth": np.zeros(0, np.int64)}
    stats = branch_stats(arrays.forest, arrays.seg_len)
    return task_depth_parts(stats, by="step")


def batch_sums(forest, max_steps: int, unit: str, parts: dict | None = None) -> dict:
    """One batch's sums (module docstring), as lists; `parts` as `branch_parts` (default: of
    `forest`)."""
    h = max_steps
    parts = branch_parts(forest) if parts is None else parts
    mass = forest.arrays().segment_mass()
    out = {name: np.zeros(h + 1) for name in SUMS}
    by_task = collections.defaultdict(list)
    for leaf in forest.leaves:
        segs = [forest.segments[s] for s in leaf.segments]
        length = sum(len(s.steps) for s in segs)
        ret = sum(s.reward for s in segs)
        by_task[leaf.task].append((mass[leaf.segments[-1]], length, ret, leaf.segments[0]))
    for rows in by_task.values():
        w, length, ret = (np.array(x, np.float64) for x in list(zip(*rows))[:3])
        backbone = np.array([r[3] for r in rows])
        alive = np.arange(h + 1)[None, :] < np.minimum(length, h + 1)[:, None]  # [leaf, t]
        out["alive"] += w @ alive
        k0 = len(set(backbone.tolist()))
        if k0 >= 2:  # Pairs of leaves below different backbones, each weighted K0 w.
            cross = (backbone[:, None] != backbone[None, :]) * np.outer(w, w) * k0 * k0
            sq = cross * (ret[:, None] - ret[None, :]) ** 2 / (k0 * (k0 - 1))
            out["pairs"] += sq.sum(axis=1) @ alive
    node_step = _step_of_nodes(forest)
    for s, seg in enumerate(forest.segments):
        t0 = node_step[seg.parent]
        for i, step in enumerate(seg.steps):
            t = min(t0 + i, h - 1)
            p = np.exp(np.asarray(step.logprobs, np.float64))
            out["energy"][t] += mass[s] * float(np.sum(1.0 - p))
            out["cost"][t] += mass[s] * (len(step.action_ids) if unit == "tokens" else 1.0)
    depth = np.minimum(np.asarray(parts["depth"], np.int64), h)
    for name, key in (("between", "between"), ("var_return", "var_return")):
        if depth.size:
            np.add.at(out[name], depth, np.asarray(parts[key], np.float64))
    if depth.size:
        np.add.at(out["points"], depth, np.asarray(parts["branch_points"], np.float64))
    return {"tasks": len(forest.task_ids), **{k: v.tolist() for k, v in out.items()}}


def _isotonic(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares nondecreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for xi, wi in zip(x, w):
        blocks.append([float(xi), float(wi), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(c, m) for m, _, c in blocks])


class DesignStats:
    """The sums of the last `window` batches (module docstring) and the profile they give.

    Args:
      max_steps: H, the episode's step limit (longer paths count at step H - 1).
      unit: the budget's unit ("tokens" or "env_steps").
      window: batches kept.
    """

    def __init__(self, max_steps: int, unit: str = "tokens", window: int = 8):
        self.max_steps, self.unit = int(max_steps), unit
        self.batches: collections.deque[dict] = collections.deque(maxlen=window)

    def add(self, forest, parts: dict | None = None) -> None:
        """Adds a played batch (`parts`: its branch points per step, default measured)."""
        self.batches.append(batch_sums(forest, self.max_steps, self.unit, parts))

    def totals(self) -> tuple[int, dict[str, np.ndarray]]:
        tasks = sum(b["tasks"] for b in self.batches)
        return tasks, {k: np.sum([b[k] for b in self.batches], axis=0) for k in SUMS}

    def profile(self) -> Profile | None:
        """The profile of the kept batches; None without a branch point at a measurable step
        (f is then unknown) or without any return variance."""
        if not self.batches:
            return None
        tasks, sums = self.totals()
        h = self.max_steps
        alive = sums["alive"]
        survival = alive / tasks
        var_return = sums["pairs"][0] / (2.0 * tasks)
        if not var_return > 0:
            return None
        ok = (sums["points"] > 0) & (sums["var_return"] > 0) & (alive > 0)
        ok[0] = False
        steps = np.flatnonzero(ok)
        if not steps.size:
            return None
        # E[1{T > t} (R - J)^2] / Var(R), and f among the paths alive at t.
        alive_sq = sums["pairs"][steps] / tasks / var_return - survival[steps]
        f_alive = np.clip(sums["between"][steps] / sums["var_return"][steps], 0.0, 1.0)
        f_steps = np.clip(1.0 - alive_sq + survival[steps] * f_alive, 0.0, 1.0)
        longest = int(np.flatnonzero(alive > 0).max()) + 1  # f = 1 once every episode ended.
        xs = np.concatenate([[0], steps[steps < longest], [longest]])
        heavy = 1e6 * max(float(sums["points"].sum()), 1.0)
        fit = _isotonic(
            np.concatenate([[0.0], f_steps[steps < longest], [1.0]]),
            np.concatenate([[heavy], sums["points"][steps[steps < longest]], [heavy]]),
        )
        explained = np.interp(np.arange(h + 1), xs, fit)
        return Profile(explained, survival, sums["energy"][:h] / tasks, sums["cost"][:h] / tasks)

    def dump(self) -> list[dict]:
        return list(self.batches)

    def load(self, data) -> None:
        self.batches.extend(data or [])


class TreeChooser:
    """Each batch's design from the batches before it (`rollout.tree=auto`).

    A batch plays the prior (the configured `fixed` tree; `next_design` returns None) when it is
    the first, when every `explore_every`-th batch comes round (0: never again), and while the
    kept batches give no profile; else the design `design.choose_design` picks.

    Args:
      n: the baseline's group size N (the budget is N episodes unless told otherwise).
      max_steps, unit, window: as `DesignStats`.
      explore_every: play the prior every this many batches, to measure f where it branches.
      ks, max_levels, margin: as `design.choose_design`.
    """

    def __init__(
        self,
        n: int,
        max_steps: int,
        unit: str = "tokens",
        *,
        explore_every: int = 4,
        window: int = 8,
        ks=DEFAULT_KS,
        max_levels: int = 2,
        margin: float = 0.05,
    ):
        self.n, self.explore_every = int(n), int(explore_every)
        self.ks, self.max_levels, self.margin = tuple(ks), max_levels, margin
        self.stats = DesignStats(max_steps, unit, window)
        self.batches = 0  # Batches recorded.

    def next_design(self, episodes: float | None = None) -> Choice | None:
        """The design of the next batch, from the batches recorded so far; None: the prior.

        Args:
          episodes: the task's budget in episodes of the baseline (default N).
        """
        if self.batches == 0 or (self.explore_every and self.batches % self.explore_every == 0):
            return None
        profile = self.stats.profile()
        if profile is None:
            return None
        episodes = self.n if episodes is None or not math.isfinite(episodes) else episodes
        budget = episodes * profile.remaining(0)
        return choose_design(
            profile, self.n, budget, ks=self.ks, max_levels=self.max_levels, margin=self.margin
        )

    def record(self, forest, parts: dict | None = None) -> None:
        """Adds a played batch (after its design was used)."""
        self.stats.add(forest, parts)
        self.batches += 1

    def dump(self) -> dict:
        return {"batches": self.batches, "stats": self.stats.dump()}

    def load(self, data: dict | None) -> TreeChooser:
        data = data or {}
        self.batches = int(data.get("batches", 0))
        self.stats.load(data.get("stats", []))
        return self
