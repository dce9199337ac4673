"""Plain Python/NumPy reference for `bpo_jax.estimators`: readable loops, no JAX.

The oracle the tests check the jitted kernels against on random forests, and the baseline of
`bench/bench_estimator.py`. Written for clarity, per node and per segment, straight from the
definitions in DESIGN.md; float64 throughout.
"""

from __future__ import annotations

import math

import numpy as np


class ReferenceForest:
    """Children lists and parent links of a forest, built with a loop over segments."""

    def __init__(self, seg_parent, seg_child, seg_reward, num_nodes):
        self.seg_parent = [int(p) for p in seg_parent]
        self.seg_child = [int(c) for c in seg_child]
        self.seg_reward = [float(r) for r in seg_reward]
        self.num_nodes = int(num_nodes)
        self.children = {}  # node -> its child segments
        self.incoming = {}  # node -> the segment that ends at it
        for s, (p, c) in enumerate(zip(self.seg_parent, self.seg_child)):
            if p < 0:
                continue  # padding
            self.children.setdefault(p, []).append(s)
            if c >= 0:
                self.incoming[c] = s
        for node, segs in self.children.items():
            if len(segs) < 2:
                raise ValueError(f"node {node} has {len(segs)} child segment(s)")
        self._seg_value = {}

    def is_padding(self, s):
        return self.seg_parent[s] < 0

    def seg_value(self, s):
        """V(s) = reward of s + mean value of the node s ends at (0 at a terminal state)."""
        if s not in self._seg_value:
            value = self.seg_reward[s]
            if self.seg_child[s] >= 0:
                value += self.node_value(self.seg_child[s])
            self._seg_value[s] = value
        return self._seg_value[s]

    def node_value(self, node):
        segs = self.children[node]
        return sum(self.seg_value(c) for c in segs) / len(segs)

    def parent_node(self, node):
        """The node above `node`, or None at a root."""
        s = self.incoming.get(node)
        return None if s is None else self.seg_parent[s]

    def ancestors(self, node):
        """`node` and every node above it, bottom first."""
        out = []
        while node is not None:
            out.append(node)
            node = self.parent_node(node)
        return out

    def num_leaves(self, s):
        if self.seg_child[s] < 0:
            return 1
        return sum(self.num_leaves(c) for c in self.children[self.seg_child[s]])


def tree_advantages(seg_parent, seg_child, seg_reward, num_nodes, method="bpo", normalize="none",
                    eps=1e-6):  # fmt: skip
    forest = ReferenceForest(seg_parent, seg_child, seg_reward, num_nodes)
    num_segments = len(forest.seg_parent)
    values = np.zeros(num_segments)
    advantages = np.zeros(num_segments)
    for s in range(num_segments):
        if forest.is_padding(s):
            continue
        values[s] = forest.seg_value(s)
        siblings = forest.children[forest.seg_parent[s]]
        sibling_values = [forest.seg_value(c) for c in siblings]
        k = len(siblings)
        mean = sum(sibling_values) / k
        std = math.sqrt(sum((v - mean) ** 2 for v in sibling_values) / k)  # population std
        if method == "grpo":
            advantages[s] = (values[s] - mean) / (std + eps)
        else:
            others = sum(sibling_values) - values[s]
            advantages[s] = values[s] - others / (k - 1)
            if normalize == "sibling_std":
                advantages[s] /= std + eps
    return values, advantages


def segment_weights(seg_parent, seg_child, num_nodes):
    forest = ReferenceForest(seg_parent, seg_child, np.zeros(len(seg_parent)), num_nodes)
    weights = np.zeros(len(forest.seg_parent))
    for s in range(len(weights)):
        if forest.is_padding(s):
            continue
        weight = 1.0
        for node in forest.ancestors(forest.seg_parent[s]):
            weight /= len(forest.children[node])
        weights[s] = weight
    return weights


def path_lengths(seg_parent, seg_child, seg_len, num_nodes):
    """Steps from the task's root to the end of each segment: its own plus those above it."""
    forest = ReferenceForest(seg_parent, seg_child, np.zeros(len(seg_parent)), num_nodes)
    lengths = np.zeros(len(forest.seg_parent), np.int64)
    for s in range(len(lengths)):
        if forest.is_padding(s):
            continue
        above = forest.ancestors(forest.seg_parent[s])[:-1]  # nodes entered, the root excluded
        lengths[s] = int(seg_len[s]) + sum(int(seg_len[forest.incoming[n]]) for n in above)
    return lengths


def trajectory_weights(seg_parent, seg_child, seg_len, num_nodes):
    """Per leaf l, w(l) / L(l) added to every segment on its root-to-leaf path.

    The loop of `RolloutForest.step_weights("trajectory")`: w(l) the path mass of the leaf
    segment, L(l) the steps on its path (a path of 0 steps counts as 1).
    """
    forest = ReferenceForest(seg_parent, seg_child, np.zeros(len(seg_parent)), num_nodes)
    mass = segment_weights(seg_parent, seg_child, num_nodes)
    lengths = path_lengths(seg_parent, seg_child, seg_len, num_nodes)
    weights = np.zeros(len(forest.seg_parent))
    for s in range(len(weights)):
        if forest.is_padding(s) or forest.seg_child[s] >= 0:
            continue
        share = mass[s] / max(lengths[s], 1)
        weights[s] += share
        for node in forest.ancestors(forest.seg_parent[s])[:-1]:
            weights[forest.incoming[node]] += share
    return weights


def expand(values, index):
    """values[index], 0 where index is -1 (a NumPy gather: the readable way to write it)."""
    values = np.asarray(values)
    index = np.asarray(index)
    return np.where(index >= 0, values[np.maximum(index, 0)], 0.0)


def treerl(seg_parent, seg_child, seg_reward, num_nodes):
    forest = ReferenceForest(seg_parent, seg_child, seg_reward, num_nodes)
    advantages = np.zeros(len(forest.seg_parent))
    for s in range(len(advantages)):
        if forest.is_padding(s):
            continue
        parent = forest.seg_parent[s]
        path = forest.ancestors(parent)  # parent first, root last
        prefix = sum(forest.seg_reward[forest.incoming[n]] for n in path[:-1])
        value = forest.seg_value(s)
        global_term = prefix + value - forest.node_value(path[-1])
        local_term = value - forest.node_value(parent)
        advantages[s] = (global_term + local_term) / math.sqrt(forest.num_leaves(s))
    return advantages


def gigpo(seg_parent, seg_child, seg_reward, num_nodes, step_segment, step_obs_id,
          step_reward=None, step_weight=1.0, eps=1e-6):  # fmt: skip
    forest = ReferenceForest(seg_parent, seg_child, seg_reward, num_nodes)
    _, episode = tree_advantages(seg_parent, seg_child, seg_reward, num_nodes, "grpo", eps=eps)
    num_steps = len(step_segment)
    # Return-to-go: walk each segment's steps backwards (array order is time order).
    steps_of = {}
    for t in range(num_steps):
        if step_segment[t] >= 0:
            steps_of.setdefault(int(step_segment[t]), []).append(t)
    rtg = np.zeros(num_steps)
    for s, steps in steps_of.items():
        if step_reward is None:
            for t in steps:
                rtg[t] = forest.seg_value(s)
            continue
        running = forest.seg_value(s) - forest.seg_reward[s]  # value of the node s ends at
        for t in reversed(steps):
            running += float(step_reward[t])
            rtg[t] = running
    groups = {}
    for t in range(num_steps):
        if step_segment[t] >= 0 and step_obs_id[t] >= 0:
            root = forest.ancestors(forest.seg_parent[step_segment[t]])[-1]
            groups.setdefault((root, int(step_obs_id[t])), []).append(t)
    step_term = np.zeros(num_steps)
    for members in groups.values():
        if len(members) < 2:
            continue
        mean = sum(rtg[t] for t in members) / len(members)
        for t in members:
            step_term[t] = rtg[t] - mean
    out = np.zeros(num_steps)
    for t in range(num_steps):
        if step_segment[t] >= 0:
            out[t] = episode[step_segment[t]] + step_weight * step_term[t]
    return out


def random_forest(rng, num_tasks, k=4, max_depth=3, branch_prob=0.5, num_segments=None,
                  num_steps=None, mean_steps=4.0, obs_vocab=6, interleave=False):  # fmt: skip
    """A random forest of `num_tasks` trees, as the dict of arrays the estimators take.

    Every task's root has k children; a segment below depth `max_depth` ends at a new branch
    node (k more children) with probability `branch_prob`, else at a terminal state. Node ids
    and segment order are shuffled; padding fills up to `num_segments` and `num_steps`. Each
    real segment gets 1 + Poisson-ish extra steps (or shares of `num_steps`), step rewards are
    N(0, 0.1) plus a 0/1 terminal reward at a leaf's last step, and `seg_reward` is their sum.
    With `interleave` the steps of different segments are mixed (each segment's steps stay in
    time order).
    """
    parents, children = [], []
    num_nodes = 0
    for _ in range(num_tasks):
        frontier = [(num_nodes, 1)]  # (node, depth of its child segments)
        num_nodes += 1
        while frontier:
            node, depth = frontier.pop()
            for _ in range(k):
                parents.append(node)
                if depth < max_depth and rng.random() < branch_prob:
                    children.append(num_nodes)
                    frontier.append((num_nodes, depth + 1))
                    num_nodes += 1
                else:
                    children.append(-1)
    real = len(parents)
    num_segments = real if num_segments is None else num_segments
    if num_segments < real:
        raise ValueError(f"forest has {real} segments, more than num_segments={num_segments}")
    relabel = rng.permutation(num_nodes)
    seg_order = rng.permutation(real)
    seg_parent = np.full(num_segments, -1, np.int32)
    seg_child = np.full(num_segments, -1, np.int32)
    seg_parent[:real] = relabel[np.asarray(parents)][seg_order]
    child = np.asarray(children)[seg_order]
    seg_child[:real] = np.where(child >= 0, relabel[np.maximum(child, 0)], -1)

    if num_steps is None:
        counts = 1 + rng.poisson(mean_steps - 1.0, real)
        num_steps = int(counts.sum())
    else:
        if num_steps < real:
            raise ValueError(f"num_steps={num_steps} < {real} segments")
        counts = 1 + rng.multinomial(num_steps - real, np.full(real, 1.0 / real))
    step_of = np.repeat(np.arange(real), counts)  # contiguous, in time order
    step_reward = rng.normal(0.0, 0.1, step_of.size)
    last = np.cumsum(counts) - 1
    leaf = seg_child[:real] < 0
    step_reward[last[leaf]] += rng.integers(0, 2, leaf.sum())
    step_obs = rng.integers(-1, obs_vocab, step_of.size)
    seg_reward = np.zeros(num_segments, np.float32)
    seg_reward[:real] = np.bincount(step_of, step_reward, minlength=real)
    seg_reward[real:] = rng.normal(size=num_segments - real)  # padding rewards must be ignored
    position = np.arange(step_of.size)
    if interleave:
        slots = rng.permutation(step_of.size)
        position = slots[np.lexsort((slots, step_of))]
    step_segment = np.full(num_steps, -1, np.int32)
    step_segment[position] = step_of
    rewards = np.zeros(num_steps, np.float32)
    rewards[position] = step_reward
    obs = np.full(num_steps, -1, np.int32)
    obs[position] = step_obs
    return {
        "seg_parent": seg_parent,
        "seg_child": seg_child,
        "seg_reward": seg_reward,
        "num_nodes": num_nodes,
        "step_segment": step_segment,
        "step_reward": rewards,
        "step_obs_id": obs,
    }
