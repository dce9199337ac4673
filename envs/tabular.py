"""Small, exactly solvable finite-horizon MDPs, for testing estimators and rollout engines.

The MDP is a tree: a state is the history of actions taken so far, so from every state each of
the `A` actions leads to its own child state and the episode ends after `H` actions. States are
numbered in heap order: the initial state is 0 and action `a` in state `s` leads to
`A * s + 1 + a`. Ids below `num_states` are the decision states (depth < H); the `A**H` ids from
`num_states` on are the terminal leaves. Action `a` in state `s` pays `rewards[s, a]`.

The policy is a softmax over a logits table `logits[s, a]` (one row per decision state), so every
quantity below is exact: the trajectory enumeration (A**H of them), the objective
`J = sum_tau p(tau) R(tau)`, its gradient
`dJ/dlogits = sum_tau p(tau) R(tau) sum_t grad log pi(a_t | s_t)`, with
`d log pi(a|s) / d logits[s, b] = 1[a == b] - pi(b|s)`, and the conditional mean and variance of
the return given any state.

Two named instances (`make_mdp`):
- `generic`: random rewards at every step; H = 3, A = 3 by default.
- `first_action_decides`: the return is `values[a_0]`, paid at the last step, and nothing else
  matters; H = 4, A = 2 by default. A branch point below the root sees siblings with equal
  returns, so only a root group gives the first action a gradient (DESIGN.md, first trap).

`TabularEnv` plays an MDP behind the `envs.base.Environment` protocol (actions "a0", "a1", ...),
registered as "tabular" with a task loader, so the rollout engine can be tested against the exact
gradient. Its whole state is plain Python values, so the in-process snapshot backend can copy it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, NamedTuple

import numpy as np

from envs.base import StepResult, Task, check_can_step, register_env, register_task_loader

__all__ = [
    "INSTANCES",
    "TabularEnv",
    "TabularTask",
    "Trajectories",
    "TreeMDP",
    "enumerate_trajectories",
    "first_action_decides_mdp",
    "generic_mdp",
    "load_tasks",
    "make_mdp",
    "objective",
    "objective_grad",
    "optimal_actions",
    "parse_action",
    "policy_probs",
    "prefix_rewards",
    "random_logits",
    "reward_to_go_moments",
    "state_visit_probs",
    "trajectory_probs",
]


# ------------------------------------------------------------------------------------ the MDP


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


# ---------------------------------------------------------------------------------- exact math


class Trajectories(NamedTuple):
    """Every trajectory of an MDP (N = A**H rows, in lexicographic order of the actions)."""

    actions: np.ndarray  # int64[N, H]
    states: np.ndarray  # int64[N, H], the decision state each action is taken in
    rewards: np.ndarray  # float64[N, H]
    returns: np.ndarray  # float64[N]


def enumerate_trajectories(mdp: TreeMDP) -> Trajectories:
    a, h = mdp.num_actions, mdp.horizon
    actions = np.stack(np.unravel_index(np.arange(a**h), (a,) * h), axis=1).astype(np.int64)
    states = np.zeros_like(actions)
    for t in range(1, h):
        states[:, t] = mdp.child(states[:, t - 1], actions[:, t - 1])
    rewards = mdp.rewards[states, actions]
    return Trajectories(actions, states, rewards, rewards.sum(axis=1))


def _check_logits(mdp: TreeMDP, logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    if logits.shape != (mdp.num_states, mdp.num_actions):
        raise ValueError(
            f"logits must have shape (num_states, num_actions) = "
            f"{(mdp.num_states, mdp.num_actions)} for {mdp.name}, got {logits.shape}"
        )
    return logits


def policy_probs(logits) -> np.ndarray:
    """Softmax over the last axis (stable)."""
    logits = np.asarray(logits, np.float64)
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def random_logits(mdp: TreeMDP, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A reproducible policy: logits ~ N(0, scale^2)."""
    return np.random.default_rng(seed).normal(size=(mdp.num_states, mdp.num_actions)) * scale


def trajectory_probs(mdp: TreeMDP, logits, trajs: Trajectories | None = None) -> np.ndarray:
    """p(tau) of every trajectory of `enumerate_trajectories` (sums to 1)."""
    pi = policy_probs(_check_logits(mdp, logits))
    trajs = enumerate_trajectories(mdp) if trajs is None else trajs
    return pi[trajs.states, trajs.actions].prod(axis=1)


def objective(mdp: TreeMDP, logits) -> float:
    """J = E[R] under the softmax policy, by enumeration."""
    trajs = enumerate_trajectories(mdp)
    return float(trajectory_probs(mdp, logits, trajs) @ trajs.returns)


def objective_grad(mdp: TreeMDP, logits) -> np.ndarray:
    """dJ/dlogits, float64[num_states, A]: sum_tau p R sum_t (onehot(a_t) - pi(s_t)) at s_t."""
    logits = _check_logits(mdp, logits)
    pi = policy_probs(logits)
    trajs = enumerate_trajectories(mdp)
    coef = trajectory_probs(mdp, logits, trajs) * trajs.returns  # [N]
    coef_nh = np.broadcast_to(coef[:, None], trajs.states.shape)
    s, a = trajs.states.ravel(), trajs.actions.ravel()
    grad = np.zeros_like(pi)
    np.add.at(grad, (s, a), coef_nh.ravel())
    grad -= np.bincount(s, coef_nh.ravel(), minlength=mdp.num_states)[:, None] * pi
    return grad


def state_visit_probs(mdp: TreeMDP, logits) -> np.ndarray:
    """float64[num_states]: the chance that an episode passes through each decision state."""
    pi = policy_probs(_check_logits(mdp, logits))
    p = np.zeros(mdp.num_states)
    p[0] = 1.0
    inner = np.arange(mdp.num_states)
    inner = inner[mdp.depth[inner] < mdp.horizon - 1]  # states whose children are decisions
    for s in inner:  # heap order: a parent comes before its children
        p[mdp.child(s, np.arange(mdp.num_actions))] = p[s] * pi[s]
    return p


def prefix_rewards(mdp: TreeMDP) -> np.ndarray:
    """float64[num_states]: the reward collected on the way from the initial state to s."""
    prefix = np.zeros(mdp.num_states)
    for s in range(1, mdp.num_states):
        parent, action = divmod(s - 1, mdp.num_actions)
        prefix[s] = prefix[parent] + mdp.rewards[parent, action]
    return prefix


def reward_to_go_moments(mdp: TreeMDP, logits) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of the reward still to come from each decision state, exactly.

    The return given the history h is `prefix_rewards[h] + reward-to-go`, so its conditional
    variance is the reward-to-go's and its conditional mean is shifted by the prefix.

    Returns:
        (mean, var), float64[num_states] each.
    """
    pi = policy_probs(_check_logits(mdp, logits))
    a = mdp.num_actions
    m1 = np.zeros(mdp.num_states + mdp.num_leaves)  # leaves: 0
    m2 = np.zeros_like(m1)
    for s in range(mdp.num_states - 1, -1, -1):  # children before parents
        kids = mdp.child(s, np.arange(a))
        r = mdp.rewards[s]
        m1[s] = pi[s] @ (r + m1[kids])
        m2[s] = pi[s] @ (r**2 + 2 * r * m1[kids] + m2[kids])
    mean = m1[: mdp.num_states]
    return mean, np.maximum(m2[: mdp.num_states] - mean**2, 0.0)


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


# ------------------------------------------------------------------------- the text environment

_ACTION_RE = re.compile(r"a(\d+)")


def parse_action(text: str | None, num_actions: int) -> int | None:
    """ "a1", " A1. " -> 1; None for anything that is not one of the MDP's actions."""
    if text is None:
        return None
    m = _ACTION_RE.fullmatch(text.strip().lower().rstrip(".").strip())
    if m is None or int(m.group(1)) >= num_actions:
        return None
    return int(m.group(1))


@dataclasses.dataclass(frozen=True)
class TabularTask(Task):
    """An episode of a tabular MDP, starting at a given state.

    Attributes:
        task_id: Unique name, `tabular/<split>/<mdp name>/<start state>[/<copy>]`.
        mdp_name: `TreeMDP.name` of the MDP the task was made for; the env checks it matches.
        start: The action history the episode starts from (() is the initial state).
        task_type: The instance name ("generic", ...).
        walkthrough: Action texts of a highest-return path from `start`.
    """

    mdp_name: str
    start: tuple[int, ...] = ()
    task_type: str = "generic"
    walkthrough: tuple[str, ...] = ()


@register_env("tabular")
class TabularEnv:
    """Plays a `TreeMDP` as text.

    Observations name the state uniquely and deterministically ("State s5, history a1 a0, step 2
    of 3. ..."). Action "aK" takes action K; any other text (or None) is invalid: the state does
    not change, the reward is `-invalid_action_penalty`, and the step still counts towards
    `max_steps`. The episode ends at a leaf (`done`; `won` if the path collected the highest
    return possible from the start state) or, truncated, when `max_steps` actions were played.

    Info keys (reset and every step): `won`, `truncated`, `steps`, `invalid`, `action` (the
    parsed action text or None), `admissible_commands`, `state`, `history`, `mdp_return` (MDP
    reward collected so far, penalties excluded). `reset` adds `goal`, `task_id`, `task_type`.
    """

    def __init__(
        self,
        max_steps: int | None = None,
        invalid_action_penalty: float = 0.1,
        instance: str | None = None,
        seed: int = 0,
        horizon: int | None = None,
        num_actions: int | None = None,
        mdp: TreeMDP | None = None,
    ):
        """Creates the env for one MDP.

        Args:
            max_steps: Episode length limit (None: the MDP's horizon).
            invalid_action_penalty: Non-negative amount subtracted for an invalid action.
            instance, seed, horizon, num_actions: The MDP, built by `make_mdp` (instance None:
                "generic").
            mdp: An MDP object to play instead (then leave `instance` None).

        Raises:
            ValueError: Bad argument, or both `mdp` and `instance` given.
        """
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
        ):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}.")
        if not invalid_action_penalty >= 0:
            raise ValueError(
                f"invalid_action_penalty must be >= 0 (it is subtracted), got "
                f"{invalid_action_penalty!r}."
            )
        if mdp is not None and instance is not None:
            raise ValueError(f"give either mdp ({mdp.name}) or instance ({instance!r}), not both")
        if mdp is None:
            mdp = make_mdp(instance or "generic", seed, horizon, num_actions)
        self.mdp = mdp
        self.max_steps = mdp.horizon if max_steps is None else max_steps
        self.invalid_action_penalty = float(invalid_action_penalty)
        self._actions = tuple(f"a{i}" for i in range(mdp.num_actions))
        self._task: TabularTask | None = None
        self._state = 0
        self._steps = 0
        self._return = 0.0
        self._best = 0.0
        self._done = True  # no episode until reset

    @property
    def state(self) -> int:
        """The current state id."""
        return self._state

    def reset(self, task: TabularTask) -> tuple[str, dict[str, Any]]:
        """Starts an episode at `task.start`.

        Raises:
            TypeError: `task` is not a `TabularTask`.
            ValueError: The task was made for another MDP, or its start is a leaf.
        """
        if not isinstance(task, TabularTask):
            raise TypeError(
                f"TabularEnv.reset expects a TabularTask (from envs.tabular.load_tasks), got "
                f"{type(task).__name__}: {task!r}."
            )
        if task.mdp_name != self.mdp.name:
            raise ValueError(
                f"task {task.task_id} was made for MDP {task.mdp_name!r} but this env plays "
                f"{self.mdp.name!r}; give the env and the task loader the same instance options."
            )
        start = self.mdp.state_of(task.start)
        if self.mdp.is_terminal(start):
            raise ValueError(f"task {task.task_id} starts at a leaf ({task.start}); nothing to do")
        self._task = task
        self._state = start
        self._steps = 0
        self._return = 0.0
        best_path = optimal_actions(self.mdp, start)
        self._best = self._path_return(start, best_path)
        self._done = False
        info = self._info(won=False, truncated=False, invalid=False, action=None)
        info.update(
            goal=f"collect the most reward in the tabular MDP {self.mdp.name}",
            task_id=task.task_id,
            task_type=task.task_type,
        )
        return self._describe(), info

    def step(self, action: str | None) -> StepResult:
        """Plays one action; see the class docstring.

        Raises:
            RuntimeError: Called before `reset` or after the episode ended.
        """
        check_can_step(self, True, self._done, self._task, self._steps)
        parsed = parse_action(action, self.mdp.num_actions)
        self._steps += 1
        if parsed is None:
            reward = -self.invalid_action_penalty
            shown = "" if action is None else " ".join(str(action).split())[:40]
            prefix = f"Invalid action {shown!r}: answer with one of {', '.join(self._actions)}. "
        else:
            reward = float(self.mdp.rewards[self._state, parsed])
            self._return += reward
            self._state = self.mdp.child(self._state, parsed)
            prefix = ""
        terminal = self.mdp.is_terminal(self._state)
        won = terminal and self._return >= self._best - 1e-9
        truncated = not terminal and self._steps >= self.max_steps
        self._done = terminal or truncated
        info = self._info(
            won=won,
            truncated=truncated,
            invalid=parsed is None,
            action=None if parsed is None else self._actions[parsed],
        )
        return StepResult(prefix + self._describe(), reward, self._done, info)

    def close(self) -> None:
        self._done = True

    def __enter__(self) -> TabularEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _path_return(self, state: int, actions) -> float:
        total = 0.0
        for action in actions:
            total += float(self.mdp.rewards[state, action])
            state = self.mdp.child(state, action)
        return total

    def _describe(self) -> str:
        history = " ".join(f"a{a}" for a in self.mdp.history(self._state)) or "(none)"
        depth = int(self.mdp.depth[self._state])
        if self.mdp.is_terminal(self._state):
            return f"State s{self._state}, history {history}: the episode is over."
        return (
            f"State s{self._state}, history {history}, step {depth} of {self.mdp.horizon}. "
            f"Actions: {', '.join(self._actions)}."
        )

    def _info(self, *, won: bool, truncated: bool, invalid: bool, action: str | None) -> dict:
        terminal = self.mdp.is_terminal(self._state)
        return {
            "won": won,
            "truncated": truncated,
            "steps": self._steps,
            "invalid": invalid,
            "action": action,
            "admissible_commands": [] if terminal else list(self._actions),
            "state": self._state,
            "history": self.mdp.history(self._state),
            "mdp_return": self._return,
        }


@register_task_loader("tabular")
def load_tasks(
    data_root: str | None,
    split: str,
    task_types: tuple[str, ...] | None = None,
    *,
    instance: str = "generic",
    seed: int = 0,
    horizon: int | None = None,
    num_actions: int | None = None,
    start_depth: int = 0,
    copies: int = 1,
) -> list[TabularTask]:
    """Lists the tasks of one MDP: every state at `start_depth`, each `copies` times.

    The MDP has no held-out data, so every split gets the same states (the split only enters
    the task ids). Give the env the same instance options (`env_options`) as the loader
    (`task_options`); `TabularEnv.reset` checks that they agree.

    Args:
        data_root: Ignored (the MDPs are generated).
        split: Any split name.
        task_types: None, or names of instances that must include `instance`.
        instance, seed, horizon, num_actions: The MDP (`make_mdp`).
        start_depth: Depth of the start states, 0 <= start_depth < horizon.
        copies: Tasks per start state (distinct ids, same episode distribution).

    Raises:
        ValueError: Bad options, or `task_types` excludes `instance`.
    """
    del data_root
    if task_types is not None and instance not in task_types:
        raise ValueError(
            f"task_types {tuple(task_types)} does not include the tabular instance {instance!r}; "
            f"add it, or set task_options.instance to one of {sorted(INSTANCES)}"
        )
    mdp = make_mdp(instance, seed, horizon, num_actions)
    if not 0 <= start_depth < mdp.horizon:
        raise ValueError(f"start_depth must be in [0, {mdp.horizon}), got {start_depth}")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    tasks = []
    for state in np.flatnonzero(mdp.depth[: mdp.num_states] == start_depth):
        state = int(state)
        walkthrough = tuple(f"a{a}" for a in optimal_actions(mdp, state))
        for copy in range(copies):
            suffix = f"/{copy}" if copies > 1 else ""
            tasks.append(
                TabularTask(
                    task_id=f"tabular/{split}/{mdp.name}/s{state}{suffix}",
                    mdp_name=mdp.name,
                    start=mdp.history(state),
                    task_type=instance,
                    walkthrough=walkthrough,
                )
            )
    return tasks
