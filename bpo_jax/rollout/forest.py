"""A batch of rollouts as a forest of segments, and its conversion to the estimator's arrays.

Every topology produces the same structure (DESIGN.md, "The forest"): a node is a task's initial
state or a branch point, a segment is the run of steps from a node to the next node or to the
end of the episode. Independent groups (GRPO, RLOO, PPO) are depth-1 forests: one root per task,
one whole trajectory per segment. A BPO tree is deeper. A step belongs to exactly one segment, so
a shared prefix enters the loss once, not once per leaf.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bpo_jax.estimators import Forest, segment_weights, trajectory_weights

STEP_WEIGHTINGS = ("trajectory", "path_mass", "uniform")


@dataclasses.dataclass
class ComputeStats:
    """What a batch of rollouts cost (the currency of matched-compute comparisons)."""

    generated_tokens: int = 0
    prefilled_tokens: int = 0
    env_steps: int = 0
    resets: int = 0
    snapshots: int = 0  # Held snapshots taken (post-hoc branching keeps one per step).
    restores: int = 0  # Sandboxes forked from held snapshots.
    clones: int = 0  # Live copies of a sandbox (group members, branch children).
    probe_tokens: int = 0  # Generated to score branch points (`action_samples`; in generated).

    def add(self, other: ComputeStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self, prefix: str = "") -> dict[str, int]:
        return {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass
class StepRecord:
    """One agent step: the prompt it saw, the tokens it generated and what came of them."""

    prompt_ids: list[int]
    action_ids: list[int]  # Generated tokens, including the stop token when one was produced.
    logprobs: np.ndarray  # [len(action_ids)] under the sampling distribution.
    entropies: np.ndarray  # [len(action_ids)]
    action_text: str | None  # Parsed action (None: nothing parseable).
    observation: str  # What the environment answered.
    reward: float
    state_text: str = ""  # The observation the action was taken on (GiGPO's anchor state).
    # No parseable action, or the env said the action did nothing (`info["invalid_action"]`).
    invalid: bool = False


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group: int  # Index of the task within the batch (rollouts of one task share it).
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    won: bool = False
    truncated: bool = False
    error: str | None = None  # A sandbox fault that ended the episode, if any.

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


@dataclasses.dataclass
class Segment:
    task: int  # Index of the task in the batch.
    parent: int  # Node the segment starts from.
    child: int = -1  # Node it ends at; -1 when it ends the episode.
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


@dataclasses.dataclass
class Leaf:
    """The end of one root-to-leaf path: one on-policy episode."""

    task: int
    segments: list[int]  # Root to leaf.
    won: bool = False
    truncated: bool = False
    error: str | None = None


@dataclasses.dataclass
class RolloutForest:
    """What one batch of rollouts produced.

    Attributes:
      task_ids: the batch's tasks; node i < len(task_ids) is task i's root.
      segments, leaves: see `Segment`, `Leaf`.
      node_task: the task of every node (roots first, then branch points in creation order).
      stats: the compute the batch used.
      task_cost: [num_tasks] what each task spent, in the budget's unit.
      budget: [num_tasks] each task's budget the batch was played under (inf: none).
      seconds: wall-clock seconds of the play, per phase ("sampling", "env").
    """

    task_ids: list[str]
    segments: list[Segment]
    leaves: list[Leaf]
    node_task: list[int]
    stats: ComputeStats
    task_cost: np.ndarray
    budget: np.ndarray | float = float("inf")
    seconds: dict = dataclasses.field(default_factory=dict)  # Wall time per phase of play.

    @property
    def spend_ratio(self) -> np.ndarray:
        """[num_tasks] spent / budget (empty without a finite budget)."""
        budget = np.broadcast_to(np.asarray(self.budget, np.float64), np.shape(self.task_cost))
        if not budget.size or not np.all(np.isfinite(budget)) or np.any(budget <= 0):
            return np.zeros((0,))
        return np.asarray(self.task_cost, np.float64) / budget

    @property
    def num_nodes(self) -> int:
        return len(self.node_task)

    @property
    def num_branch_points(self) -> int:
        return self.num_nodes - len(self.task_ids)

    def steps(self) -> list[StepRecord]:
        """Every step once, in segment order (the order of the forest's step arrays)."""
        return [step for seg in self.segments for step in seg.steps]

    def paths(self) -> list[Trajectory]:
        """One trajectory per leaf (steps shared by several leaves appear in each)."""
        out = []
        for leaf in self.leaves:
            steps = [st for s in leaf.segments for st in self.segments[s].steps]
            out.append(
                Trajectory(
                    task_id=self.task_ids[leaf.task],
                    group=leaf.task,
                    steps=steps,
                    won=leaf.won,
                    truncated=leaf.truncated,
                    error=leaf.error,
                )
            )
        return out

    def arrays(self, with_obs_ids: bool = False) -> ForestArrays:
        """The estimator's arrays, padded to powers of two so jitted kernels compile rarely.

        Steps are laid out in `steps()` order; `ForestArrays.unpad_steps` maps a per-step result
        of a kernel back to that order.
        """
        num_seg = len(self.segments)
        steps = self.steps()
        s_pad, t_pad, n_pad = (_bucket(num_seg), _bucket(len(steps)), _bucket(self.num_nodes))
        seg_parent = np.full((s_pad,), -1, np.int32)
        seg_child = np.full((s_pad,), -1, np.int32)
        seg_reward = np.zeros((s_pad,), np.float32)
        seg_len = np.zeros((s_pad,), np.int32)
        for s, seg in enumerate(self.segments):
            seg_parent[s], seg_child[s], seg_reward[s] = seg.parent, seg.child, seg.reward
            seg_len[s] = len(seg.steps)
        step_segment = np.full((t_pad,), -1, np.int32)
        step_segment[: len(steps)] = np.repeat(
            np.arange(num_seg, dtype=np.int32), seg_len[:num_seg]
        )
        step_reward = np.zeros((t_pad,), np.float32)
        step_reward[: len(steps)] = [step.reward for step in steps]
        obs_id = None
        if with_obs_ids:
            # GiGPO's anchor states: steps taken on the same observation text (within a task).
            ids: dict[tuple[int, str], int] = {}
            obs_id = np.full((t_pad,), -1, np.int32)
            obs_id[: len(steps)] = [
                ids.setdefault((seg.task, step.state_text), len(ids))
                for seg in self.segments
                for step in seg.steps
            ]
        forest = Forest(
            seg_parent=seg_parent,
            seg_child=seg_child,
            seg_reward=seg_reward,
            num_nodes=n_pad,
            step_segment=step_segment,
            step_reward=step_reward,
            step_obs_id=obs_id,
        )
        return ForestArrays(forest, seg_len, num_seg, len(steps))

    def to_forest(self, with_obs_ids: bool = False) -> Forest:
        """`arrays(with_obs_ids).forest`: the padded `estimators.Forest` alone."""
        return self.arrays(with_obs_ids).forest

    def leaf_mass(self) -> np.ndarray:
        """Probability of each leaf's path under a uniform descent of its task's tree."""
        w = self.arrays().segment_mass()
        return np.array([w[leaf.segments[-1]] for leaf in self.leaves], np.float64)

    def step_weights(self, mode: str) -> np.ndarray:
        """Loss weight of every step (in `steps()` order).

        trajectory: the mass-weighted mean of 1 / (path length) over the paths through the
          step's segment, `sum over leaves l below s of w(l) / L(l)`; for an independent group
          this is (1/N) / (trajectory length), the per-trajectory mean GRPO and RLOO estimate,
          and the tree then estimates the same objective.
        path_mass: `w(s)`, the probability mass of the paths through s (DESIGN.md, "Weights"):
          the unbiased weighting of the summed (not length-averaged) policy gradient.
        uniform: 1 per step (an ablation: over-weights steps after branch points).
        """
        if mode not in STEP_WEIGHTINGS:
            raise ValueError(f"Unknown step weighting {mode!r}; expected one of {STEP_WEIGHTINGS}.")
        a = self.arrays()
        if mode == "uniform":
            per_seg = np.ones((a.num_segments,), np.float64)
        elif mode == "path_mass":
            per_seg = a.segment_mass()
        else:
            f = a.forest
            w = trajectory_weights(f.seg_parent, f.seg_child, a.seg_len, f.num_nodes)
            per_seg = a.unpad_segments(w).astype(np.float64)
        return a.segments_to_steps(per_seg)


@dataclasses.dataclass(frozen=True)
class ForestArrays:
    """A `RolloutForest` as the estimator's padded arrays, and the way back.

    Attributes:
      forest: the padded `estimators.Forest` (segments [S], steps [T], nodes; -1 / 0 padding).
      seg_len: int32 [S] steps in each segment (0 for padding).
      num_segments, num_steps: the real sizes (the rest is padding).
    """

    forest: Forest
    seg_len: np.ndarray
    num_segments: int
    num_steps: int

    def pad_steps(self, x_t) -> np.ndarray:
        """[num_steps] -> [T] float32 with zeros on the padding steps."""
        x_t = np.asarray(x_t, np.float32)
        if x_t.shape != (self.num_steps,):
            raise ValueError(f"expected {self.num_steps} per-step values, got shape {x_t.shape}.")
        out = np.zeros(self.forest.step_segment.shape, np.float32)
        out[: self.num_steps] = x_t
        return out

    def unpad_steps(self, x_t) -> np.ndarray:
        """[T] (a kernel's per-step result) -> [num_steps], in `RolloutForest.steps()` order."""
        return np.asarray(x_t)[: self.num_steps]

    def unpad_segments(self, x_s) -> np.ndarray:
        return np.asarray(x_s)[: self.num_segments]

    def segments_to_steps(self, x_s) -> np.ndarray:
        """Per-segment values [num_segments] (or [S]) -> per step [num_steps]."""
        x_s = np.asarray(x_s)[: self.num_segments]
        return np.repeat(x_s, self.seg_len[: self.num_segments]).astype(np.float64)

    def segment_mass(self) -> np.ndarray:
        """`estimators.segment_weights` of the real segments, float64 [num_segments]."""
        f = self.forest
        w = segment_weights(f.seg_parent, f.seg_child, f.num_nodes)
        return np.asarray(w, np.float64)[: self.num_segments]


def _bucket(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b
