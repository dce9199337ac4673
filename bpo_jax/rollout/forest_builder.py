"""Building a rollout forest step by step: pure bookkeeping, no sandboxes and no policy.

The lockstep loop (`bpo_jax.rollout.engine`) tells a `ForestBuilder` what happened: a path started
at
a task's root, took a step, branched into K children at its current state, or ended. The
builder keeps the segments, nodes and leaves (DESIGN.md, "The forest") and hands back a
`RolloutForest`. Because it only sees these events it is tested on its own, with forests made by
hand (tests/test_forest_builder.py).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from bpo_jax.rollout.forest import ComputeStats, Leaf, RolloutForest, Segment, StepRecord


@dataclasses.dataclass
class LivePath:
    """A path being played: where it sits in the forest, plus the loop's own handles.

    Attributes:
      task: index of the task in the batch.
      backbone: the root-group member the path descends from (branch budgets are per backbone).
      segments: segment ids from the root to the current (open) segment.
      depth: branch points on the path (the root not counted).
      t: steps taken since the task's initial state.
      sid: the loop's sandbox id (-1 until it has one).
      episode: the loop's episode text (`bpo_jax.agent.EpisodeText`); children get a copy.
      history: post-hoc branching only: (snapshot handle, episode text) before every step.
      cost: what the path has spent since the task's reset, in the budget's unit (children
        inherit their parent's), so a finished path's cost is one whole episode's.
      is_backbone: started at the root (not a branch child): its path is an independent
        on-policy episode, the budget's reference.
    """

    task: int
    backbone: int
    segments: list[int]
    depth: int = 0
    t: int = 0
    sid: int = -1
    episode: Any = None
    history: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    cost: float = 0.0
    is_backbone: bool = False


class ForestBuilder:
    """Segments, nodes and leaves of one batch; node i < num_tasks is task i's root."""

    def __init__(self, num_tasks: int):
        self.num_tasks = num_tasks
        self.segments: list[Segment] = []
        self.leaves: list[Leaf] = []
        self.node_task: list[int] = list(range(num_tasks))
        self.num_backbones = 0

    def _new_segment(self, task: int, parent: int) -> int:
        self.segments.append(Segment(task=task, parent=parent))
        return len(self.segments) - 1

    def _new_node(self, task: int) -> int:
        self.node_task.append(task)
        return len(self.node_task) - 1

    def start_path(self, task: int, **loop_fields) -> LivePath:
        """A new backbone from task's root (its own first segment)."""
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task {task} is outside [0, {self.num_tasks}).")
        self.num_backbones += 1
        return LivePath(
            task=task,
            backbone=self.num_backbones - 1,
            segments=[self._new_segment(task, task)],
            is_backbone=True,
            **loop_fields,
        )

    def record(self, path: LivePath, step: StepRecord) -> None:
        """Appends one step to the path's open segment."""
        self.segments[path.segments[-1]].steps.append(step)
        path.t += 1

    def branch(self, path: LivePath, num_new: int) -> list[LivePath]:
        """Turns the path's current state into a node with `num_new + 1` children.

        The path itself continues as one child (in a new segment); the `num_new` others are
        returned with the path's depth and step count, a copy of its episode text, no sandbox
        (`sid=-1`: the caller attaches the copies it made) and no post-hoc history.
        """
        if num_new < 1:
            raise ValueError(f"a branch point needs at least one new child, got {num_new}.")
        node = self._new_node(path.task)
        self.segments[path.segments[-1]].child = node
        prefix = list(path.segments)  # Ends with the segment that now ends at the node.
        path.segments = prefix + [self._new_segment(path.task, node)]
        path.depth += 1
        return [
            dataclasses.replace(
                path,
                sid=-1,
                episode=copy.deepcopy(path.episode),
                segments=prefix + [self._new_segment(path.task, node)],
                history=[],
                is_backbone=False,
            )
            for _ in range(num_new)
        ]

    def finish(self, path: LivePath, info: dict) -> Leaf:
        """Ends the path at a terminal state (or a fault); returns its leaf."""
        leaf = Leaf(
            task=path.task,
            segments=list(path.segments),
            won=bool(info.get("won", False)),
            truncated=bool(info.get("truncated", False)),
            error=info.get("error"),
        )
        self.leaves.append(leaf)
        return leaf

    def cut(self, path: LivePath, cut_steps: list[int], num_new: int):
        """Splits a finished backbone's last segment at steps `cut_steps` (post-hoc ablation).

        The backbone's own steps stay where they are, as a chain of segments through one new
        node per cut; every node also gets `num_new` new children that have not started yet.

        Returns:
          [(t, [LivePath, ...]), ...]: per cut, its step and its new children (to be played
          from the snapshot taken before step t; their `episode` is the caller's to set).
        """
        if sorted(set(cut_steps)) != list(cut_steps):
            raise ValueError(f"cut steps must be strictly increasing, got {cut_steps}.")
        leaf = next(lf for lf in self.leaves if lf.segments[-1] == path.segments[-1])
        seg_id = path.segments[-1]
        steps = self.segments[seg_id].steps
        if cut_steps and not (0 <= cut_steps[0] and cut_steps[-1] < len(steps)):
            raise ValueError(f"cut steps {cut_steps} outside the segment's {len(steps)} steps.")
        chain, out = [seg_id], []
        self.segments[seg_id].steps = steps[: cut_steps[0]] if cut_steps else steps
        offset = path.t - len(steps)  # The segment's first step, counted from the task's start.
        for j, t in enumerate(cut_steps):
            node = self._new_node(path.task)
            self.segments[chain[-1]].child = node
            end = cut_steps[j + 1] if j + 1 < len(cut_steps) else len(steps)
            cont = self._new_segment(path.task, node)
            self.segments[cont].steps = steps[t:end]
            children = [
                LivePath(
                    task=path.task,
                    backbone=path.backbone,
                    segments=chain[:] + [self._new_segment(path.task, node)],
                    depth=1,
                    t=offset + t,
                )
                for _ in range(num_new)
            ]
            out.append((t, children))
            chain.append(cont)
        leaf.segments = path.segments[:-1] + chain
        return out

    def build(
        self, task_ids: list[str], stats: ComputeStats, task_cost, budget=float("inf")
    ) -> RolloutForest:
        """The forest; `budget` is one per-task budget or one per task."""
        if len(task_ids) != self.num_tasks:
            raise ValueError(f"{len(task_ids)} task ids for {self.num_tasks} tasks.")
        return RolloutForest(
            task_ids=list(task_ids),
            segments=self.segments,
            leaves=self.leaves,
            node_task=self.node_task,
            stats=stats,
            task_cost=np.asarray(task_cost, np.float64),
            budget=np.broadcast_to(np.asarray(budget, np.float64), (self.num_tasks,)).copy(),
        )
