"""The lockstep loop: every live path of a batch played one turn at a time, cohort by cohort.

Every live path of a cohort advances in lockstep: one prefill + one batched sampling call per
turn (plus one for the extra children of that turn's branch points) and one parallel batch of
steps across the pool's worker processes. The batch's tasks are split into `cohorts` contiguous
groups (every path of a task, its tree and its planner state in one), whose turns are pipelined:
sample cohort A's turn, submit its steps (`SandboxPool.submit_steps`), sample cohort B's turn
while A's environments step, collect A, submit B, sample A's next turn, ... so the accelerator
and the environment workers work at the same time. One cohort is plain lockstep.

Cohorts (`bpo_jax.rollout.cohorts`) change what is independent of the other tasks only in its order:
for a deterministic policy and decisions that depend on a task's own paths, every task's tree is
the same for any number of cohorts (its segments and leaves are numbered in another order: a
cohort's paths are listed together). What the planner pools across tasks (the branch rule's
running score history, the length and token-cost models, the acceptance coin, a uniform rule's
draws) sees the other cohorts' turns in another order, so adaptive thresholds and budget
decisions can differ; each is still a function of h_t and of other tasks' past, never of the
node's own future, so the estimator stays unbiased. Each cohort keeps its own prefix cache, so
a turn's prompts continue that cohort's previous turn.

`bpo_jax.rollout.engine.play_forest` drives it.
"""

from __future__ import annotations

import copy
import logging

import numpy as np

from bpo_jax.agent import EpisodeText, admissible_actions
from bpo_jax.rollout.branching import action_distribution_entropy, action_entropy
from bpo_jax.rollout.cohorts import Cohort, split_cohorts
from bpo_jax.rollout.forest import ComputeStats, StepRecord
from bpo_jax.rollout.forest_builder import ForestBuilder, LivePath
from bpo_jax.rollout.timing import Timer

log = logging.getLogger(__name__)


class LockstepLoop:
    """Plays every live path of a batch, cohort by cohort, one turn at a time (sandbox
    lifecycle and sampling).

    Forest bookkeeping is the builder's, branch decisions and spending the planner's; this
    class owns the sandboxes (every live path holds one, closed on any exit) and the policy calls.
    """

    def __init__(self, pool, policy, agent, tasks, spec, planner, rng, greedy, bar, cohorts=1):
        self.pool, self.policy, self.agent, self.rng = pool, policy, agent, rng
        self.tasks, self.spec, self.planner = list(tasks), spec, planner
        self.greedy, self.bar = greedy, bar
        self.stats = ComputeStats()
        # Seconds in the policy (sampling), in the resets and root copies (reset), blocked on
        # the steps (env), and the sum of the steps' own send-to-reply latencies (env_busy:
        # env work, overlapped or not).
        self.timer = Timer()
        self.builder = ForestBuilder(len(self.tasks))
        self.finished_backbones: list[LivePath] = []
        self.cohorts, self.cohort_of = split_cohorts(len(self.tasks), cohorts, rng, policy)

    @property
    def live(self) -> list[LivePath]:
        """Paths with an open sandbox (closed on any exit), over all cohorts."""
        return [p for c in self.cohorts for p in c.live]

    @live.setter
    def live(self, paths: list[LivePath]) -> None:
        for c in self.cohorts:
            c.live = [p for p in paths if self.cohort_of[p.task] == c.index]

    def start(self) -> None:
        k0 = self.spec.root_group
        with self.timer("reset"):
            resets = self.pool.reset_many(self.tasks)
        self.stats.resets += len(resets)
        for ti, (sid, obs, info) in enumerate(resets):
            # The reset sandbox plays the first member; the others are live copies of it.
            with self.timer("reset"):
                sids = [sid, *self.pool.clone(sid, k0 - 1)]
            self.stats.clones += k0 - 1
            for fsid in sids:
                episode = EpisodeText.start(
                    obs, goal=info.get("goal"), actions=admissible_actions(info)
                )
                path = self.builder.start_path(ti, sid=fsid, episode=episode)
                self.planner.add_backbone(path)
                self.cohorts[self.cohort_of[ti]].live.append(path)

    def _key(self, c: Cohort, salt: int):
        import jax  # Local: keeps this module importable without initialising JAX.

        return jax.random.fold_in(c.key, 2 * c.turns + salt)

    def _branch_where(self, live: list[LivePath], rows: list[int], entropies: np.ndarray) -> None:
        """Branches the paths the planner picks.

        The children join `live` (which also puts their sandboxes in the clean-up on error) and
        `rows` (they sample from their parent's context row).
        """
        for i in self.planner.choose(live, entropies):
            children = self._branch(live[i])
            live.extend(children)
            rows.extend([i] * len(children))

    def _branch(self, p: LivePath) -> list[LivePath]:
        """Turns p's current state into a node with p plus K - 1 children in sandbox copies."""
        from envs.sandbox import SandboxError  # Local: the sandbox package is optional here.

        try:
            # Copies of the live sandbox before the step (a snapshot and K - 1 forks of it in one
            # go: on the fork server, one os.fork per copy).
            sids = self.pool.clone(p.sid, self.spec.num_branches - 1)
        except SandboxError as e:
            log.warning("Branch at step %d of task %s skipped: %s", p.t, p.task, e)
            self.planner.refund(p)
            return []
        self.stats.clones += len(sids)
        children = self.builder.branch(p, len(sids))
        for child, sid in zip(children, sids):
            child.sid = sid
        return children

    def _probe_scores(self, c: Cohort, live: list[LivePath], ctx) -> np.ndarray:
        """`action_samples` rule: per path, the entropy of `probes` extra actions drawn at h_t
        (NaN where the path cannot branch, or its task cannot pay for the probes). Their tokens
        are charged to the paths' tasks."""
        import jax  # Local: keeps this module importable without initialising JAX.

        m = self.planner.selector.probes
        eligible = self.planner.probe_candidates(live, m)
        scores = np.full((len(live),), np.nan)
        if not eligible:
            return scores
        rows = [i for i in eligible for _ in range(m)]
        # Its own key: independent of the actions the paths and their children are given.
        key = jax.random.fold_in(self._key(c, 0), 0x9E3779B1 % 2**31)
        probes = self.policy.sample(ctx, key, rows=rows, keep_context=True)
        tokens = sum(len(s.token_ids) for s in probes)
        self.stats.generated_tokens += tokens
        self.stats.probe_tokens += tokens
        for j, i in enumerate(eligible):
            chunk = probes[j * m : (j + 1) * m]
            for s in chunk:
                self.planner.charge(live[i], len(s.token_ids), probe=True)
            scores[i] = action_distribution_entropy([self.agent.parse(s.text) for s in chunk])
        return scores

    def _sample(self, c: Cohort, ctx, rows: list[int]):
        """This turn's actions: one per live path, children included (they join `c.live`)."""
        live = c.live
        if self.planner.selector is not None and self.planner.selector.probes:
            if self.planner.may_branch(live):
                self._branch_where(live, rows, self._probe_scores(c, live, ctx))
            return self.policy.sample(ctx, self._key(c, 0), rows=rows, greedy=self.greedy)
        if self.spec.entropy_reduce == "first" or not self.planner.may_branch(live):
            # The branch rule sees h_t only (the first token's distribution), so every
            # path's action and every child's action come from one sampling call.
            self._branch_where(live, rows, self.policy.next_token_entropy(ctx))
            return self.policy.sample(ctx, self._key(c, 0), rows=rows, greedy=self.greedy)
        # "mean" / "max" look at the backbone's sampled action first (an ablation).
        samples = self.policy.sample(ctx, self._key(c, 0), keep_context=True)
        entropies = np.array(
            [action_entropy(s.entropies, self.spec.entropy_reduce) for s in samples]
        )
        self._branch_where(live, rows, entropies)
        return samples + self.policy.sample(ctx, self._key(c, 1), rows=rows[len(samples) :])

    def run(self) -> None:
        """Plays every live path to its end, the cohorts' turns pipelined (module docstring).

        On any exit the steps still in flight are cancelled (their sandboxes closed).
        """
        try:
            while any(c.live or c.pending is not None for c in self.cohorts):
                for c in self.cohorts:
                    if c.pending is not None:
                        self._end_turn(c)
                    if c.live:
                        self._start_turn(c)
        finally:
            for c in self.cohorts:
                if c.pending is not None:
                    c.pending.cancel()
                    c.pending = None

    def _start_turn(self, c: Cohort) -> None:
        """Samples cohort c's actions (branching where the planner says) and submits its steps."""
        prompts = [self.agent.encode(p.episode) for p in c.live]
        with self.timer("sampling"):
            ctx = self._prefill(c, prompts)
            self.stats.prefilled_tokens += ctx.prefilled_tokens
            rows = list(range(len(c.live)))
            samples = self._sample(c, ctx, rows)
        tokens = sum(len(s.token_ids) for s in samples)
        self.stats.generated_tokens += tokens
        self.planner.costs.record(len(samples), tokens)
        for p, s in zip(c.live, samples):
            self.planner.charge(p, len(s.token_ids))
        if self.planner.posthoc:
            for p in c.live:
                if p.depth == 0:
                    p.history.append((self.pool.snapshot(p.sid), copy.deepcopy(p.episode)))
                    self.stats.snapshots += 1
        actions = [self.agent.parse(s.text) for s in samples]
        with self.timer("env"):
            c.pending = self.pool.submit_steps([(p.sid, a) for p, a in zip(c.live, actions)])
        c.turn = (prompts, rows, samples, actions)
        self.stats.env_steps += len(c.live)

    def _prefill(self, c: Cohort, prompts):
        """The policy's prefill, continuing cohort c's own previous turn (its prefix cache)."""
        if c.prefixes is None:
            return self.policy.prefill(prompts)
        own, self.policy.prefixes = self.policy.prefixes, c.prefixes
        try:
            return self.policy.prefill(prompts)
        finally:
            self.policy.prefixes = own

    def _end_turn(self, c: Cohort) -> None:
        """Collects cohort c's steps and records them; finished paths leave `c.live`."""
        with self.timer("env"):
            results = c.pending.results()
        self.timer.seconds["env_busy"] += sum(c.pending.latencies)
        c.pending = None
        prompts, rows, samples, actions = c.turn
        still = []
        for p, row, sample, action, res in zip(c.live, rows, samples, actions, results):
            self.builder.record(
                p,
                StepRecord(
                    prompt_ids=prompts[row],
                    action_ids=sample.token_ids,
                    logprobs=sample.logprobs,
                    entropies=sample.entropies,
                    action_text=action,
                    observation=res.observation,
                    reward=float(res.reward),
                    state_text=p.episode.current or p.episode.room,
                    invalid=action is None or bool(res.info.get("invalid_action", False)),
                ),
            )
            p.episode.record(action or "", res.observation, admissible_actions(res.info))
            if res.done:
                self._finish(p, res.info)
            else:
                still.append(p)
        c.live[:] = still
        c.turn = ()
        c.turns += 1

    def _finish(self, p: LivePath, info: dict) -> None:
        self.builder.finish(p, info)
        self.pool.close_sandbox(p.sid)
        self.planner.finished(p)
        if p.history:
            self.finished_backbones.append(p)
        if self.bar is not None:
            self.bar.update(1)

    def release_all(self) -> None:
        """Frees every snapshot and sandbox this batch still holds, and the cohorts' prefix
        caches (on any exit)."""
        for c in self.cohorts:
            if c.prefixes is not None:
                c.prefixes.clear()
        for p in self.live + self.finished_backbones:
            for handle, _ in p.history:
                self.pool.release(handle)
            p.history = []
        for p in self.live:
            self.pool.close_sandbox(p.sid)
