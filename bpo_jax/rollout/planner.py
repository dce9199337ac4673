"""The branch planner: which live paths branch at this turn, under the branch rule and budget.

It combines a branch rule (`bpo_jax.rollout.branching`, a function of each path's h_t) with the
per-backbone branch budget, the depth limit and the task's compute budget. It knows paths only
by their task, backbone, depth and step count (`LivePath`), never by their outcomes, so the
number of children a node gets cannot depend on those children's returns (DESIGN.md).

Budget. A fixed per-task number (`TreeSpec.budget`), or with `budget_episodes = N` N times the
cost of one episode of that task, measured on its own backbones as they play: a finished
backbone counts its cost, a live one what it has spent plus its expected remaining cost. Every
backbone is an independent on-policy episode of the task (the reference an independent-episode
algorithm's N episodes are), and its cost so far is known at step t, so the budget is too. A
budget from other tasks' episodes would under-spend on the tasks a policy finishes quickly and
cap the slow ones (measured: batches at 0.41 of a global budget on ALFWorld). Probe tokens
count in the task's spend, never in a backbone's episode cost.

Budget rule. The task's committed spend is what it has spent plus the expected remaining cost
of its live paths; a candidate branch adds the expected cost of its K - 1 new children.
  cap     accept only while committed + extra <= budget (the budget is never exceeded in
          expectation, and so is under-spent: trees ended at 0.81 of it on ALFWorld);
  target  accept when it fits; when a candidate only partly fits (slack = budget - committed,
          0 < slack < extra), accept it with probability slack / extra (randomised rounding,
          the default), so the expected committed spend is the budget. A lost coin books the
          slack it stood for as the task's debt, so the same slack is not offered again; only
          what later paths save against their expected cost can be spent after it.
The coin is the planner's own and every input is known at step t, so whether a node branches
never depends on its children's outcomes. Candidates of one turn are served in order of their
rule's score. Across batches `RolloutState.adapt` moves the rule's rate (the entropy quantile,
the uniform probability; under `spread` the schedule's scale) towards spending the budget
(`rollout.rate_gain`).

Schedule (`TreeSpec.branch_schedule`). Under `threshold` a path is a candidate when the rule's
own test passes. Under `spread` it is one when the rank of its score among recent scores at its
step is in the top `scale * b / (R(t) * m)` fraction: b its backbone's branch points left, R(t)
the expected steps a path at step t still takes, m the backbone's live paths. A backbone then
branches about b times over its expected remaining steps, at its highest-ranked ones, instead of
at the first high scores. The rank uses only scores of steps already taken (h_t).
"""

from __future__ import annotations

import math

import numpy as np

from bpo_jax.rollout.branching import (
    BranchSelector,
    CostModel,
    LengthModel,
    PostHocTopK,
    action_entropy,
)
from bpo_jax.rollout.forest_builder import LivePath


class BranchPlanner:
    """Branch decisions and compute accounting of one batch.

    Args:
      spec: the batch's `rollout.TreeSpec`.
      selector: the branch rule (None: never branch).
      lengths, costs: running models of path length and tokens per action (kept by the
        caller across batches, so budgets use what earlier batches measured).
      num_tasks: tasks in the batch.
      seed: the acceptance coin's seed (`target` mode).
    """

    def __init__(
        self,
        spec,
        selector: BranchSelector | None,
        lengths: LengthModel,
        costs: CostModel,
        num_tasks: int,
        seed: int = 0,
    ):
        self.spec, self.selector, self.lengths, self.costs = spec, selector, lengths, costs
        self.spent = np.zeros((num_tasks,), np.float64)
        self.branches_left: list[int] = []  # Per backbone.
        self.rng = np.random.default_rng(seed)
        self.debt = np.zeros((num_tasks,), np.float64)  # `target`: slack of lost coins.
        self.backbones: list[list[LivePath]] = [[] for _ in range(num_tasks)]
        self.done: set[int] = set()  # id() of finished backbones.

    @property
    def online(self) -> bool:
        """Whether branch points are chosen during play (every rule but post-hoc top-k)."""
        return self.spec.branches and self.selector is not None and self.selector.online

    @property
    def posthoc(self) -> bool:
        return self.spec.branches and isinstance(self.selector, PostHocTopK)

    def add_backbone(self, path: LivePath) -> None:
        if path.backbone != len(self.branches_left):
            raise ValueError(f"backbone {path.backbone} registered out of order.")
        self.branches_left.append(self.spec.branch_budget)
        self.backbones[path.task].append(path)

    def task_budgets(self) -> np.ndarray:
        """[num_tasks] each task's budget now (see the module docstring)."""
        return np.array([self.budget(task) for task in range(len(self.backbones))])

    def budget(self, task: int) -> float:
        """The task's budget now: fixed, or `budget_episodes` of its backbones' episodes."""
        paths = self.backbones[task]
        if self.spec.budget_episodes <= 0 or not paths:
            return float(self.spec.budget)
        total = sum(
            p.cost if id(p) in self.done else p.cost + self.expected_cost(p.t) for p in paths
        )
        return self.spec.budget_episodes * total / len(paths)

    def expected_cost(self, t: int) -> float:
        """Expected cost of a path's steps from its step t on (t steps taken, step t included)."""
        return self.costs.of_steps(self.lengths.remaining(t))

    def may_branch(self, live: list[LivePath]) -> bool:
        return self.online and any(self.eligible(p) for p in live)

    def eligible(self, p: LivePath) -> bool:
        """Whether p could branch now: below the depth limit, with branch points left, and its
        task not closed by the budget (a probe costs tokens: no probes where nothing fits)."""
        if p.depth >= self.spec.max_depth or self.branches_left[p.backbone] <= 0:
            return False
        return self.spent[p.task] + self.debt[p.task] < self.budget(p.task)

    def _committed(self, live: list[LivePath]) -> np.ndarray:
        """Per task: what it spent, plus what its live paths are expected to spend from their
        current step on."""
        committed = self.spent.copy()
        for p in live:
            committed[p.task] += self.expected_cost(p.t)
        return committed

    def probe_candidates(self, live: list[LivePath], probes: int) -> list[int]:
        """Paths that draw `probes` extra actions to score this step (`action_samples`).

        A task's probes may spend `spec.probe_share` of its slack (budget - committed), the rest
        is left for the branches they find: each eligible path of the task probes with
        probability q = share * slack / (cost of a probe * O), O the expected remaining steps of
        the task's eligible paths, so the task's expected probe spend over the rest of the batch
        is about share * slack whatever its length. Probing every eligible step would spend
        every probe's cost at every step (at K0 = 3 with N = 4 the one-episode slack went to
        probes: 0 and 2 branch points in two ALFWorld batches). The coin is the planner's own
        and q is known at step t: where a path probes never depends on its future.
        """
        committed = self._committed(live) + self.debt
        budgets = self.task_budgets()
        cost = probes * self.costs.of_steps(1)
        eligible = [i for i, p in enumerate(live) if self.eligible(p)]
        steps_left = np.zeros_like(committed)
        for i in eligible:
            steps_left[live[i].task] += self.lengths.remaining(live[i].t)
        out = []
        for i in eligible:
            task = live[i].task
            slack = budgets[task] - committed[task]
            if cost >= slack:  # Probes would leave nothing to branch with.
                continue
            if math.isfinite(slack) and self.spec.probe_share < 1.0:
                rate = self.spec.probe_share * slack / (cost * max(steps_left[task], 1.0))
                if self.rng.random() >= rate:
                    continue
            committed[task] += cost
            out.append(i)
        return out

    def choose(self, live: list[LivePath], entropies: np.ndarray) -> list[int]:
        """Indices into `live` of the paths that branch at this turn (online rules only).

        Each chosen path's backbone is charged one branch point; `refund` gives it back if
        the branch could not be made.
        """
        if not self.online:
            return []
        steps = np.array([p.t for p in live])
        self.selector.observe(entropies, steps)
        if self.spec.branch_schedule == "spread":
            scores = self._spread_scores(live, entropies, steps)
        else:
            scores = self.selector.scores(entropies, steps)
        eligible = [i for i, p in enumerate(live) if not np.isnan(scores[i]) and self.eligible(p)]
        eligible.sort(key=lambda i: -scores[i])
        committed = self._committed(live)
        budgets = self.task_budgets()
        chosen = []
        for i in eligible:
            p = live[i]
            extra = (self.spec.num_branches - 1) * self.expected_cost(p.t)
            if self.branches_left[p.backbone] > 0 and self._accept(
                p.task, committed[p.task], extra, budgets[p.task]
            ):
                committed[p.task] += extra
                self.branches_left[p.backbone] -= 1
                chosen.append(i)
        return chosen

    def _spread_scores(self, live: list[LivePath], entropies, steps) -> np.ndarray:
        """`spread`: the rank of each path's score where it is in its backbone's top fraction
        `scale * b / (R(t) * m)` at this step, NaN elsewhere (see the module docstring)."""
        ranks = self.selector.ranks(entropies, steps)
        if ranks is None:
            raise ValueError(
                f"branch_schedule='spread' needs a rule with ranked scores; "
                f"{type(self.selector).__name__} has none."
            )
        members = np.bincount([p.backbone for p in live], minlength=len(self.branches_left))
        out = np.full((len(live),), np.nan)
        for i, p in enumerate(live):
            left = self.branches_left[p.backbone]
            if left <= 0 or np.isnan(ranks[i]):
                continue
            rate = (
                self.spec.branch_scale * left / (self.lengths.remaining(p.t) * members[p.backbone])
            )
            if ranks[i] >= 1.0 - rate:
                out[i] = ranks[i]
        return out

    def _accept(self, task: int, committed: float, extra: float, budget: float) -> bool:
        slack = budget - committed - self.debt[task]
        if extra <= slack:
            return True
        if self.spec.budget_mode != "target" or slack <= 0 or not math.isfinite(slack):
            return False
        if self.rng.random() < slack / extra:
            return True
        self.debt[task] += slack
        return False

    def refund(self, path: LivePath) -> None:
        self.branches_left[path.backbone] += 1

    def charge(self, path: LivePath, num_tokens: int, probe: bool = False) -> None:
        """Charges one action of `num_tokens` generated tokens to its task, and unless it is a
        probe (`action_samples`) to the path's episode cost."""
        cost = self.costs.of_actions(num_tokens, 1)
        self.spent[path.task] += cost
        if not probe:
            path.cost += cost

    def finished(self, path: LivePath) -> None:
        """A path ended: its length (and, for a backbone, its episode cost) is measured."""
        self.lengths.add(path.t)
        if path.is_backbone:
            self.costs.record_episode(path.cost)
            self.done.add(id(path))

    def posthoc_cuts(self, path: LivePath, step_entropies: list[np.ndarray]) -> list[int]:
        """Post-hoc ablation (biased): the finished backbone's top-entropy steps that fit."""
        spec = self.spec
        ents = [action_entropy(e, spec.entropy_reduce) for e in step_entropies]
        # Cuts on one backbone nest, so the depth limit caps their number too.
        k = min(spec.branch_budget, spec.max_depth)
        budget = self.budget(path.task)
        affordable = []
        for t in PostHocTopK.choose_posthoc(np.array(ents), k):
            extra = (spec.num_branches - 1) * self.expected_cost(t)
            if self._committed_posthoc[path.task] + extra <= budget:
                self._committed_posthoc[path.task] += extra
                affordable.append(t)
        return affordable

    def start_posthoc(self) -> None:
        """Begins the post-hoc pass: budgets count from what the backbones spent."""
        self._committed_posthoc = self.spent.copy()
