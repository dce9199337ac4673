"""A NumPy sampler of many BPO forests on a tabular MDP at once, early episode ends included.

One root per task with `root_k` backbones; all running paths advance one step at a time. Before
step t >= 1 a running path branches (into `k` children) when t is one of `branch_at`, else with
probability `coin[state]` (into `coin_k`), while it has fewer than `max_depth` branch points
above it. Every decision reads the current history only (an online rule), so every
root-to-leaf path is an on-policy episode. A path stops at a terminal state (`TreeMDP.stops`)
or at the horizon.

Per segment it also gives the step count (for the `trajectory` weights and a node's step
depth). `tests/test_estimator_mdp.py` draws its fixed-horizon forests here too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from bpo_jax import estimators as est
from envs import tabular


class Trees(NamedTuple):
    num_tasks: int
    num_nodes: int  # roots are nodes 0 .. num_tasks - 1
    seg_parent: np.ndarray
    seg_child: np.ndarray
    seg_reward: np.ndarray
    seg_len: np.ndarray
    node_t: np.ndarray  # the step a node comes before (0 for roots)
    step_task: np.ndarray
    step_state: np.ndarray
    step_action: np.ndarray
    step_segment: np.ndarray

    def padded(self, num_segments: int | None = None, num_nodes: int | None = None):
        """(Forest, seg_len) padded to the given sizes (default: the next powers of two)."""
        size = len(self.seg_parent)
        num_segments = num_segments or 1 << max(4, (size - 1).bit_length())
        num_nodes = num_nodes or 1 << max(4, (self.num_nodes - 1).bit_length())
        if size > num_segments or self.num_nodes > num_nodes:
            raise ValueError(f"{size} segments / {self.num_nodes} nodes exceed the padding")
        pad = num_segments - size
        forest = est.Forest(
            seg_parent=np.concatenate([self.seg_parent, np.full(pad, -1)]).astype(np.int32),
            seg_child=np.concatenate([self.seg_child, np.full(pad, -1)]).astype(np.int32),
            seg_reward=np.concatenate([self.seg_reward, np.zeros(pad)]).astype(np.float32),
            num_nodes=num_nodes,
        )
        return forest, np.concatenate([self.seg_len, np.zeros(pad, np.int64)])


def sample_trees(
    mdp,
    logits,
    num_tasks: int,
    *,
    root_k: int,
    branch_at=(),
    k: int = 2,
    coin=None,
    coin_k: int = 2,
    max_depth: int = 1,
    seed: int = 0,
) -> Trees:
    """Draws `num_tasks` independent forests (see the module docstring)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(tabular.policy_probs(logits), axis=1)
    task = np.repeat(np.arange(num_tasks), root_k)  # per running path
    segment = np.arange(num_tasks * root_k)
    state = np.zeros_like(task)
    nest = np.zeros_like(task)
    seg_parent, node_t = [task.copy()], [np.zeros(num_tasks, np.int64)]
    ended_seg, ended_node, steps = [], [], []
    num_segments, num_nodes = num_tasks * root_k, num_tasks
    for t in range(mdp.horizon):
        if t >= 1:
            running = ~mdp.terminal[state]
            task, segment, state, nest = (x[running] for x in (task, segment, state, nest))
            if t in branch_at:
                branch, kk = np.ones(len(state), bool), k
            elif coin is not None:
                branch, kk = rng.random(len(state)) < coin[state], coin_k
            else:
                branch, kk = np.zeros(len(state), bool), 0
            idx = np.flatnonzero(branch & (nest < max_depth))
            if idx.size:
                nodes = num_nodes + np.arange(idx.size)
                num_nodes += idx.size
                ended_seg.append(segment[idx])
                ended_node.append(nodes)
                node_t.append(np.full(idx.size, t))
                seg_parent.append(np.repeat(nodes, kk))
                new_segments = num_segments + np.arange(idx.size * kk)
                num_segments += idx.size * kk
                keep = np.ones(len(state), bool)
                keep[idx] = False
                task = np.concatenate([task[keep], np.repeat(task[idx], kk)])
                state = np.concatenate([state[keep], np.repeat(state[idx], kk)])
                nest = np.concatenate([nest[keep], np.repeat(nest[idx] + 1, kk)])
                segment = np.concatenate([segment[keep], new_segments])
        u = rng.random(len(state))
        action = np.minimum((cdf[state] <= u[:, None]).sum(axis=1), cdf.shape[1] - 1)
        steps.append((task, state, action, segment))
        state = mdp.child(state, action)
    step_task, step_state, step_action, step_segment = (np.concatenate(x) for x in zip(*steps))
    seg_child = np.full(num_segments, -1, np.int64)
    if ended_seg:
        seg_child[np.concatenate(ended_seg)] = np.concatenate(ended_node)
    reward = mdp.rewards[step_state, step_action]
    return Trees(
        num_tasks,
        num_nodes,
        np.concatenate(seg_parent),
        seg_child,
        np.bincount(step_segment, reward, minlength=num_segments),
        np.bincount(step_segment, minlength=num_segments),
        np.concatenate(node_t),
        step_task,
        step_state,
        step_action,
        step_segment,
    )


def task_gradients(mdp, logits, trees: Trees, seg_coef) -> np.ndarray:
    """float64[num_tasks, num_states * A]: per task, sum over steps of coef * grad log pi."""
    pi = tabular.policy_probs(logits)
    f, s, a = trees.num_tasks, mdp.num_states, mdp.num_actions
    coef = np.asarray(seg_coef, np.float64)[trees.step_segment]
    key = trees.step_task * s + trees.step_state
    grad = np.bincount(key * a + trees.step_action, coef, minlength=f * s * a).reshape(f, s, a)
    grad -= np.bincount(key, coef, minlength=f * s).reshape(f, s, 1) * pi[None]
    return grad.reshape(f, s * a)
