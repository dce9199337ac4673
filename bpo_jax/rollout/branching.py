"""Where a BPO tree branches: selection rules, the running entropy threshold, and the budget.

A branch point is decided *online*: at step t of a path, from what the policy did at h_t (the
entropy of the action it just sampled there) and from statistics of other paths, never from the
path's own future. Deciding after the whole backbone is known (post-hoc top-k) lets the
backbone's later actions choose which of its own states get siblings; that biases the estimator,
and the rule is kept only as a documented ablation (DESIGN.md, "Two traps").

Rules, chosen by name (`make_selector`):
  entropy       branch when the action's entropy reaches a running quantile of recent action
                entropies (the default). With `entropy_reduce="first"` the action's entropy is
                the first token's, a function of h_t alone, so the K children of a node are K
                independent draws from pi(.|h_t). With "mean" or "max" the statistic also
                depends on the backbone's own later tokens, which tilts the backbone child
                towards high-entropy continuations: a slight bias, kept as an ablation.
  uniform       branch at any step with probability `branch_prob`.
  interval      branch every `interval` steps (t = interval, 2 * interval, ...).
  action_samples  draw `probes` extra actions at h_t (their tokens count in the budget) and
                branch where they disagree, ranked by the entropy of the distinct actions they
                parse to: it sees the consequential choice, not the first token (the verb). The
                probes are independent of the children, which are drawn afresh, so the K
                children of a node are still K independent draws from pi(.|h_t).
  posthoc_topk  roll each backbone to the end, then branch at its `branch_budget` highest-entropy
                steps (biased; needs a snapshot of every backbone step).

Schedules (`rollout.branch_schedule`, applied by the planner):
  threshold     each rule's own test (the entropy quantile, the uniform probability, ...);
  spread        a path is a candidate when its score's rank among recent scores at the same
                step (`ranks`, the probability integral transform of the per-step history) is
                in the top `b / R(t)` fraction, where b is its backbone's branch points left and
                R(t) the expected steps it still takes: each backbone spends its branch budget
                over its expected remaining steps instead of on the first high scores.
With `entropy_per_step` the entropy threshold is a quantile of recent entropies at the same
step t (the first action's entropy and the tenth's are not on one scale).

The budget (matched compute) is per task, in generated tokens or environment steps; how a tree
spends it is the branch planner's (`bpo_jax.rollout.planner`). Expected remaining costs come from
`LengthModel`, the lengths of recently finished paths; the budget's reference, the cost of an
independent episode, from `CostModel.episodes`.

What a batch feeds these running statistics (a rule's scores, finished lengths, sampled actions
and tokens, episode costs) can also be written down as it arrives, as plain data
(`Measurements`, started by `measure`), and fed to another copy of the statistics later
(`Measurements.apply_to`): how a batch played in shares on several hosts updates one running
state (`bpo_jax.multihost.shares`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

SELECTORS: dict[str, Callable[..., BranchSelector]] = {}
ENTROPY_REDUCE = ("first", "mean", "max")
BUDGET_UNITS = ("tokens", "env_steps")
BUDGET_MODES = ("target", "cap")
BRANCH_SCHEDULES = ("threshold", "spread")


def register_selector(name: str):
    def decorate(cls):
        SELECTORS[name] = cls
        return cls

    return decorate


def action_entropy(token_entropies: np.ndarray, reduce: str) -> float:
    """One number per action from its per-token entropies (0 for an empty action)."""
    e = np.asarray(token_entropies, np.float64)
    if e.size == 0:
        return 0.0
    if reduce == "first":
        return float(e[0])
    if reduce == "mean":
        return float(e.mean())
    if reduce == "max":
        return float(e.max())
    raise ValueError(f"Unknown entropy_reduce {reduce!r}; expected one of {ENTROPY_REDUCE}.")


@dataclasses.dataclass
class Measurements:
    """What a batch fed the running statistics, as plain data, in the order it came.

    Attributes:
      scores: one `(scores, steps)` per turn the branch rule observed (`BranchSelector.observe`;
        steps None where none were given).
      lengths: the length of every finished path (`LengthModel.add`).
      actions, tokens: sampled actions and their generated tokens (`CostModel.record`).
      episode_costs: the cost of every finished backbone episode (`CostModel.record_episode`).
    """

    scores: list[tuple[list[float], list[int] | None]] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    actions: int = 0
    tokens: int = 0
    episode_costs: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def merged(cls, parts: Iterable[Measurements]) -> Measurements:
        """Several batches' measurements as one, in the order given (each part's lists follow
        the previous part's): feeding the result equals feeding the parts one after another."""
        out = cls()
        for m in parts:
            out.scores += m.scores
            out.lengths += m.lengths
            out.actions += m.actions
            out.tokens += m.tokens
            out.episode_costs += m.episode_costs
        return out

    def apply_to(self, selector: BranchSelector | None, lengths: LengthModel, costs: CostModel):
        """Feeds these measurements to running statistics, as a batch playing on them would
        have (the rule's scores turn by turn, so its running history ends the same)."""
        if selector is not None:
            for scores, steps in self.scores:
                selector.observe(np.asarray(scores, np.float64), _steps_array(steps))
        for length in self.lengths:
            lengths.add(length)
        costs.record(self.actions, self.tokens)
        for cost in self.episode_costs:
            costs.record_episode(cost)


def _steps_array(steps: list[int] | None) -> np.ndarray | None:
    return None if steps is None else np.asarray(steps, np.int64)


def measure(selector, lengths: LengthModel, costs: CostModel) -> Measurements:
    """Starts writing down what `selector`, `lengths` and `costs` are fed from now on.

    Returns:
      The `Measurements` they add to (each keeps its own statistics as before).
    """
    journal = Measurements()
    for model in (selector, lengths, costs):
        if model is not None:
            model.journal = journal
    return journal


class BranchSelector:
    """Scores candidate branch points; a NaN score means "do not branch here".

    `online` rules are asked at every step (`scores`); the post-hoc rule is asked once per
    finished backbone (`choose_posthoc`). Higher scores are served first when the budget cannot
    take every candidate of a turn. A rule keeps its running statistics in `update`, so that
    every turn it observes can also be written down (`journal`, see `measure`).
    """

    online = True
    probes = 0  # Extra actions the loop samples at h_t for `scores` (0: it passes entropies).
    journal: Measurements | None = None  # Where observed scores are also written (`measure`).

    def observe(self, entropies: np.ndarray, steps: np.ndarray | None = None) -> None:
        """Sees the action entropies (scores) of one turn (all live paths) and their steps."""
        if self.journal is not None:
            self.journal.scores.append(
                (
                    [float(e) for e in np.asarray(entropies, np.float64).reshape(-1)],
                    None if steps is None else [int(t) for t in np.asarray(steps).reshape(-1)],
                )
            )
        self.update(entropies, steps)

    def update(self, entropies: np.ndarray, steps: np.ndarray | None) -> None:
        """The rule's own use of an observed turn (its running history); none by default."""

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def ranks(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray | None:
        """Per path, the rank in [0, 1] of its score among recent scores at its step (NaN
        where there is too little history); None for rules that have no score to rank."""
        return None

    def state_dict(self) -> dict:
        return {}

    # The attribute that holds the rule's adaptable rate in [0, 1] (None: it has none), and the
    # way the rate moves per unit of `gain * (spend_ratio - 1)`: +1 for a quantile (under-spent,
    # a lower quantile branches more), -1 for a probability (under-spent, a higher one).
    rate_attr: str | None = None
    rate_direction = 1.0

    def adjust_rate(self, spend_ratio: float, gain: float) -> None:
        """Branch more often after a batch that spent less than its budget (ratio < 1), less
        often after one that spent more. Rules without a rate (interval, post-hoc) ignore it."""
        if self.rate_attr is not None:
            step = self.rate_direction * gain * (spend_ratio - 1.0)
            self.set_rate(np.clip(self.rate() + step, 0.0, 1.0))

    def rate(self) -> float | None:
        """The rule's adaptable rate (a quantile or a probability), None if it has none."""
        return None if self.rate_attr is None else getattr(self, self.rate_attr)

    def set_rate(self, value: float) -> None:
        if self.rate_attr is not None:
            setattr(self, self.rate_attr, float(value))

    def reseed(self, seed: int) -> None:
        """Restarts the rule's own random stream from `seed` (rules without one ignore it)."""


class ScoreHistory:
    """Recent scores, pooled and per step, for thresholds and ranks.

    Steps at or beyond `max_step` share the last bucket. A per-step statistic falls back to the
    pooled one while its step has fewer than `min_history` scores.
    """

    def __init__(self, window: int = 512, min_history: int = 16, max_step: int = 64):
        self.min_history, self.max_step = min_history, max_step
        self.pooled: collections.deque[float] = collections.deque(maxlen=window)
        per_step = max(window // 4, min_history)
        self.by_step = collections.defaultdict(lambda: collections.deque(maxlen=per_step))

    def add(self, scores: np.ndarray, steps: np.ndarray | None) -> None:
        scores = np.asarray(scores, np.float64).reshape(-1)
        self.pooled.extend(float(e) for e in scores)
        if steps is not None:
            for e, t in zip(scores, np.asarray(steps).reshape(-1)):
                self.by_step[min(int(t), self.max_step)].append(float(e))

    def dump(self) -> dict:
        return {
            "pooled": list(self.pooled),
            "by_step": {str(t): list(h) for t, h in self.by_step.items()},
        }

    def load(self, data: dict) -> None:
        self.pooled.extend(data.get("pooled", []))
        for t, h in data.get("by_step", {}).items():
            self.by_step[int(t)].extend(h)

    def of_step(self, t: int | None) -> np.ndarray | None:
        """The history a score at step t is compared with (None: too little of it yet)."""
        if t is not None:
            h = self.by_step.get(min(int(t), self.max_step))
            if h is not None and len(h) >= self.min_history:
                return np.asarray(h)
        if len(self.pooled) < self.min_history:
            return None
        return np.asarray(self.pooled)

    def rank(self, score: float, t: int | None) -> float:
        """Mid-rank of `score` in the history (ties count half): a uniform variate under a
        continuous, stationary score; NaN without history."""
        h = self.of_step(t)
        if h is None or not np.isfinite(score):
            return float("nan")
        return float((np.sum(h < score) + 0.5 * np.sum(h == score)) / h.size)


@register_selector("entropy")
class EntropySelector(BranchSelector):
    """Branch where the action entropy is at or above a running quantile of recent entropies
    (pooled over steps, or per step with `per_step`)."""

    rate_attr = "quantile"  # Under-spent -> a lower quantile -> more steps at or above it.

    def __init__(
        self,
        quantile: float = 0.8,
        window: int = 512,
        min_history: int = 16,
        per_step: bool = False,
        **_,
    ):
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"entropy quantile must be in [0, 1], got {quantile}.")
        self.quantile = quantile
        self.min_history = min_history
        self.per_step = per_step
        self.history = ScoreHistory(window, min_history)

    def update(self, entropies: np.ndarray, steps: np.ndarray | None) -> None:
        self.history.add(entropies, steps)

    def threshold_at(self, t: int | None = None) -> float:
        h = self.history.of_step(t if self.per_step else None)
        if h is None:
            return float("inf")  # Too little history to know what "high" means yet.
        return float(np.quantile(h, self.quantile))

    @property
    def threshold(self) -> float:
        return self.threshold_at(None)

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        entropies = np.asarray(entropies, np.float64)
        thresholds = np.array([self.threshold_at(int(t)) for t in np.asarray(steps)])
        return np.where(entropies >= thresholds, entropies, np.nan)

    def ranks(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return np.array(
            [self.history.rank(float(e), int(t)) for e, t in zip(entropies, np.asarray(steps))]
        )

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "quantile": self.quantile}


@register_selector("uniform")
class UniformSelector(BranchSelector):
    """Branch at any step with probability `branch_prob` (independent of the history)."""

    rate_attr = "prob"
    rate_direction = -1.0

    def __init__(self, branch_prob: float = 0.2, seed: int = 0, **_):
        if not 0.0 <= branch_prob <= 1.0:
            raise ValueError(f"branch_prob must be in [0, 1], got {branch_prob}.")
        self.prob = branch_prob
        self.rng = np.random.default_rng(seed)

    def reseed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        u = self.rng.random(len(steps))
        return np.where(u < self.prob, u, np.nan)

    def ranks(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return self.rng.random(len(steps))  # Uniform ranks: `spread` branches at rate b / R(t).


@register_selector("interval")
class IntervalSelector(BranchSelector):
    """Branch at steps interval, 2 * interval, ... of every path."""

    def __init__(self, interval: int = 3, **_):
        if interval < 1:
            raise ValueError(f"branch interval must be >= 1, got {interval}.")
        self.interval = interval

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        steps = np.asarray(steps)
        hit = (steps > 0) & (steps % self.interval == 0)
        return np.where(hit, -steps.astype(np.float64), np.nan)  # Earlier steps first.


def action_distribution_entropy(actions: list) -> float:
    """Plug-in entropy (nats) of the empirical distribution of sampled actions (None counts as
    one more action: nothing parseable)."""
    if not actions:
        return 0.0
    _, counts = np.unique(np.array(["\0" if a is None else a for a in actions]), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


@register_selector("action_samples")
class ActionSampleSelector(BranchSelector):
    """Branch where `probes` extra actions sampled at h_t disagree (see the module docstring).

    The loop passes, per path, the entropy of its probes' parsed actions (0 when they all
    agree); a path is a candidate when it is above `min_entropy`.
    """

    def __init__(
        self, probes: int = 4, min_entropy: float = 0.0, window: int = 512, min_history=16, **_
    ):
        if probes < 2:
            raise ValueError(f"action_samples needs >= 2 probes, got {probes}.")
        self.probes = int(probes)
        self.min_entropy = float(min_entropy)
        self.history = ScoreHistory(window, min_history)

    def update(self, entropies: np.ndarray, steps: np.ndarray | None) -> None:
        e = np.asarray(entropies, np.float64)
        keep = np.isfinite(e)  # NaN: paths that drew no probes.
        self.history.add(e[keep], None if steps is None else np.asarray(steps)[keep])

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        entropies = np.asarray(entropies, np.float64)
        return np.where(entropies > self.min_entropy, entropies, np.nan)

    def ranks(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        # Probes that all agree (entropy 0) never branch: there is nothing to tell apart.
        return np.array(
            [
                self.history.rank(float(e), int(t)) if e > self.min_entropy else np.nan
                for e, t in zip(entropies, np.asarray(steps))
            ]
        )


@register_selector("posthoc_topk")
class PostHocTopK(BranchSelector):
    """BIASED ablation: after a backbone ends, branch at its top-k entropy steps."""

    online = False

    def __init__(self, **_):
        pass

    def scores(self, entropies: np.ndarray, steps: np.ndarray) -> np.ndarray:
        return np.full(len(steps), np.nan)

    @staticmethod
    def choose_posthoc(entropies: np.ndarray, k: int) -> list[int]:
        """Indices of the k highest-entropy steps, in time order."""
        order = np.argsort(-np.asarray(entropies, np.float64), kind="stable")[:k]
        return sorted(int(i) for i in order)


def make_selector(name: str, **options) -> BranchSelector:
    if name not in SELECTORS:
        raise ValueError(f"Unknown branch selector {name!r}; known: {sorted(SELECTORS)}.")
    return SELECTORS[name](**options)


class LengthModel:
    """Expected steps still to take (the next one included) by a path that has taken t steps.

    `remaining(t) = mean(L - t over recent path lengths L > t)`, from recently finished paths;
    with no such path yet it is the worst case, `max_steps - t`, so the first trees are
    cautious rather than over budget.
    """

    journal: Measurements | None = None  # Where added lengths are also written (`measure`).

    def __init__(self, max_steps: int, window: int = 2048):
        self.max_steps = max_steps
        self.lengths: collections.deque[int] = collections.deque(maxlen=window)

    def add(self, length: int) -> None:
        self.lengths.append(int(length))
        if self.journal is not None:
            self.journal.lengths.append(int(length))

    def mean_length(self) -> float:
        """Mean length of recent paths (the step limit before any has finished)."""
        return float(np.mean(self.lengths)) if self.lengths else float(self.max_steps)

    def remaining(self, t: int) -> float:
        lengths = np.asarray(self.lengths)
        longer = lengths[lengths > t]
        if longer.size == 0:
            return float(max(self.max_steps - t, 1))
        return float(np.mean(longer - t))


@dataclasses.dataclass
class CostModel:
    """Turns expected steps into the budget's unit (tokens use a running tokens-per-action),
    and keeps the measured cost of recent independent episodes (the budget's reference)."""

    unit: str
    tokens_per_action: float = 8.0  # Prior, until actions have been recorded.
    actions: int = 0
    tokens: int = 0
    episodes: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=512)
    )
    # Where recorded actions and episodes are also written (`measure`).
    journal: Measurements | None = dataclasses.field(default=None, repr=False, compare=False)

    def record_episode(self, cost: float) -> None:
        """The cost of one whole on-policy episode from a task's reset (a backbone's path)."""
        self.episodes.append(float(cost))
        if self.journal is not None:
            self.journal.episode_costs.append(float(cost))

    def mean_episode(self) -> float | None:
        return float(np.mean(self.episodes)) if self.episodes else None

    def __post_init__(self):
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"Unknown budget unit {self.unit!r}; expected one of {BUDGET_UNITS}.")

    def record(self, num_actions: int, tokens: int) -> None:
        self.actions += num_actions
        self.tokens += tokens
        if self.journal is not None:
            self.journal.actions += num_actions
            self.journal.tokens += tokens
        if self.actions:
            self.tokens_per_action = self.tokens / self.actions

    def of_steps(self, steps: float) -> float:
        return steps * (self.tokens_per_action if self.unit == "tokens" else 1.0)

    def of_actions(self, tokens: int, actions: int) -> float:
        """What a batch of actions cost, in the budget's unit."""
        return float(tokens if self.unit == "tokens" else actions)
