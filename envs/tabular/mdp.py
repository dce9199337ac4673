"""Small, exactly solvable finite-horizon MDPs whose states are action histories.

The MDP is a tree: a state is the history of actions taken so far, so from every state each of
the `A` actions leads to its own child state and the episode ends after `H` actions. States are
numbered in heap order: the initial state is 0 and action `a` in state `s` leads to
`A * s + 1 + a`. Ids below `num_states` are the decision states (depth < H); the `A**H` ids from
`num_states` on are the terminal leaves. Action `a` in state `s` pays `rewards[s, a]`.

Two named instances (`make_mdp`):
- `generic`: random rewards at every step; H = 3, A = 3 by default.
- `first_action_decides`: the return is `values[a_0]`, paid at the last step, and nothing else
  matters; H = 4, A = 2 by default. A branch point below the root sees siblings with equal
  returns, so only a root group gives the first action a gradient (DESIGN.md, first trap).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = [
    "INSTANCES",
    "TreeMDP",
    "first_action_decides_mdp",
    "generic_mdp",
    "make_mdp",
    "optimal_actions",
]


@dataclasses.dataclass(frozen=True, eq=False)
class TreeMDP:
    """A finite-horizon MDP whose states are action histories (see the module docstring).

    Attributes:
        name: Identifies the MDP, e.g. "generic(seed=0,H=3,A=3)"; equal names mean equal MDPs
            for the instances of `make_mdp`.
        num_actions: A >= 2.
        horizon: H >= 1, the number of actions in every episode.
        rewards: float64[num_states, A], the reward of action a in decision state s (read-only).
    """

    name: str
    num_actions: int
    horizon: int
    rewards: np.ndarray

    def __post_init__(self):
        a, h = self.num_actions, self.horizon
        if isinstance(a, bool) or not isinstance(a, int) or a < 2:
            raise ValueError(f"num_actions must be an int >= 2, got {a!r}")
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"horizon must be an int >= 1, got {h!r}")
        rewards = np.array(self.rewards, dtype=np.float64)  # a private copy
        expected = ((a**h - 1) // (a - 1), a)
        if rewards.shape != expected:
            raise ValueError(
                f"rewards must have shape (num_states, num_actions) = {expected} for H={h}, "
                f"A={a}, got {rewards.shape}"
            )
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"rewards of MDP {self.name!r} must be finite")
        rewards.setflags(write=False)
        object.__setattr__(self, "rewards", rewards)

    def __deepcopy__(self, memo):
        return self  # immutable: snapshots of an env share its MDP

    @property
    def num_states(self) -> int:
        """Number of decision states (depth < H); leaves have the ids after them."""
        return self.rewards.shape[0]

    @property
    def num_leaves(self) -> int:
        return self.num_actions**self.horizon

    @functools.cached_property
    def depth(self) -> np.ndarray:
        """int64[num_states + num_leaves]: the depth (actions taken) of every state id."""
        sizes = self.num_actions ** np.arange(self.horizon + 1)
        return np.repeat(np.arange(self.horizon + 1), sizes)

    def child(self, state, action):
        """The state that `action` leads to from `state` (works on arrays)."""
        return self.num_actions * state + 1 + action

    def is_terminal(self, state: int) -> bool:
        return state >= self.num_states

    def history(self, state: int) -> tuple[int, ...]:
        """The actions that lead from the initial state to `state`."""
        if not 0 <= state < self.num_states + self.num_leaves:
            raise ValueError(f"state {state} is outside [0, {self.num_states + self.num_leaves})")
        actions = []
        while state > 0:
            state, action = divmod(state - 1, self.num_actions)
            actions.append(action)
        return tuple(reversed(actions))

    def state_of(self, history) -> int:
        """The state reached by the action sequence `history` (length <= H)."""
        history = tuple(int(a) for a in history)
        if len(history) > self.horizon or any(not 0 <= a < self.num_actions for a in history):
            raise ValueError(
                f"{history} is not an action history of {self.name} (H={self.horizon}, "
                f"A={self.num_actions})"
            )
        state = 0
        for action in history:
            state = self.child(state, action)
        return state


def generic_mdp(seed: int = 0, horizon: int = 3, num_actions: int = 3) -> TreeMDP:
    """Random rewards, N(0, 1) rounded to 0.01, at every step."""
    rng = np.random.default_rng(seed)
    num_states = (num_actions**horizon - 1) // (num_actions - 1) if num_actions >= 2 else 0
    rewards = np.round(rng.normal(size=(num_states, num_actions)), 2)
    return TreeMDP(
        f"generic(seed={seed},H={horizon},A={num_actions})", num_actions, horizon, rewards
    )


def first_action_decides_mdp(
    seed: int = 0, horizon: int = 4, num_actions: int = 2, values=None
) -> TreeMDP:
    """The return is `values[a_0]`, paid at the last step; all other rewards are 0.

    Args:
        seed: Unused (the instance is deterministic); accepted so every instance has one.
        horizon: H >= 2, so that some steps come after the deciding one.
        num_actions: A >= 2.
        values: float[A], the return of each first action; default `1 - a / (A - 1)`.
    """
    del seed
    if horizon < 2:
        raise ValueError(f"first_action_decides needs horizon >= 2, got {horizon}")
    if values is None:
        values = 1.0 - np.arange(num_actions) / (num_actions - 1)
    values = np.asarray(values, np.float64)
    if values.shape != (num_actions,):
        raise ValueError(f"values must have shape ({num_actions},), got {values.shape}")
    num_states = (num_actions**horizon - 1) // (num_actions - 1)
    rewards = np.zeros((num_states, num_actions))
    last = np.arange(num_states - num_actions ** (horizon - 1), num_states)
    # The first action of a state at depth H-1: walk its heap index up H-2 levels.
    first = last.copy()
    for _ in range(horizon - 2):
        first = (first - 1) // num_actions
    rewards[last, :] = values[first - 1][:, None]
    name = f"first_action_decides(H={horizon},A={num_actions},values={values.tolist()})"
    return TreeMDP(name, num_actions, horizon, rewards)


INSTANCES = {"generic": generic_mdp, "first_action_decides": first_action_decides_mdp}


@functools.lru_cache(maxsize=64)
def _make_mdp_cached(instance: str, seed: int, horizon, num_actions) -> TreeMDP:
    kwargs = {}
    if horizon is not None:
        kwargs["horizon"] = horizon
    if num_actions is not None:
        kwargs["num_actions"] = num_actions
    return INSTANCES[instance](seed=seed, **kwargs)


def make_mdp(
    instance: str = "generic",
    seed: int = 0,
    horizon: int | None = None,
    num_actions: int | None = None,
) -> TreeMDP:
    """Builds a named instance (None keeps the instance's default horizon / number of actions).

    Raises:
        ValueError: Unknown instance name or out-of-range sizes.
    """
    if instance not in INSTANCES:
        raise ValueError(f"unknown tabular MDP instance {instance!r}; known: {sorted(INSTANCES)}")
    return _make_mdp_cached(instance, int(seed), horizon, num_actions)


def optimal_actions(mdp: TreeMDP, start: int = 0) -> tuple[int, ...]:
    """Actions of a highest-return path from `start` to a leaf (ties: the lowest action)."""
    best = np.zeros(mdp.num_states + mdp.num_leaves)
    for s in range(mdp.num_states - 1, -1, -1):
        best[s] = np.max(mdp.rewards[s] + best[mdp.child(s, np.arange(mdp.num_actions))])
    actions, state = [], start
    while not mdp.is_terminal(state):
        kids = mdp.child(state, np.arange(mdp.num_actions))
        action = int(np.argmax(mdp.rewards[state] + best[kids]))
        actions.append(action)
        state = mdp.child(state, action)
    return tuple(actions)
