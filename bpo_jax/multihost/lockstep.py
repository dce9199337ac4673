"""Hosts in lockstep: each host's rollouts issue policy calls; the hosts run them as one program.

Why: on TPU slices with limited ICI routing (v5e, v6e) libtpu refuses a program whose devices
are a subset of the slice's chips ("device assignment should include all slice devices"), so a
host cannot sample on its own chips (`mesh.sampler="host"`, `bpo_jax.multihost.shares`). With
`mesh.sampler="slice"` every sampler program runs over the global mesh, with the parameters in
the train state's sharding, and every host takes part in every program. But the rollouts' calls
are data-dependent: each host's trees, episode lengths, batch sizes, greedy or sampled turns
differ, so the hosts cannot simply call the sampler in the same order. This module turns their
different call sequences into one sequence of rounds that all hosts run alike:

  * Each host plays its shares in a worker thread (`run_in_lockstep`) whose policy is a
    `LockstepPolicy`: a policy call (prefill, next-token entropy, sample) posts a `Request` and
    blocks until its answer comes back. The rollout code is unchanged.
  * The main thread serves rounds. It waits for its worker's next request (or its end), then
    exchanges every host's request *whole* (`distributed.allgather_objects`: prompts, rows and
    key data are a few kB), so every host knows every request and computes the same plan
    (`plan_round`): the requests grouped by what must be one program (`group_key`: the kind,
    and greedy or not for samples), in a canonical order. For each group every host runs the
    same global program (the `executor`, `bpo_jax.multihost.slice_sampler.SliceSampler`), a host
    without
    a request of that group contributing filler rows; each host's rows are one block of R rows
    (`blocks`), R the largest batch bucket of the group's hosts. The round's answer goes back to
    the worker, and the next round starts. A host whose worker has ended takes part with its end
    marker (and so with filler rows) until every host's has ended.
  * Contexts live on the executor: every host's executor keeps the same registry, since
    contexts are made in the same rounds everywhere; a worker holds a `SliceContext` handle (id,
    its block's offset, its prompts). A handle's release is announced with the host's next
    request, and a context is freed once every host that has rows in it released it.
  * Randomness stays each host's own: a sample request carries its key, and row j of host p's
    block draws with `fold_in(key_p, j)`, as row j of a one-process batch does, so a row's
    tokens do not depend on the other hosts' rows (up to the float rounding of other batch
    shapes, see `bpo_jax.multihost.slice_sampler`).
  * Failures end every host: a worker's exception is announced as a "failed" request, the
    other hosts' workers are answered with `LockstepAborted`, and each host raises (its worker's
    own error where it failed), so no host waits forever in a collective. An error in a program
    itself (on the main thread) ends its host as in any SPMD run: the others stop in their next
    collective when the runtime finds a process missing.

Prefix reuse (`sampler.prefix_reuse`) is not supported: a prefix cache's programs depend on
what each host's cache holds, so a config asking for both is refused (`bpo_jax.config`).

The protocol's pure parts (`Request`, `plan_round`, `blocks`) are functions of the gathered
requests alone; the serving loop takes the gather as an argument, so it also runs (and is
tested) in one process.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from bpo_jax.parallel import distributed
from bpo_jax.sampler.policy import action_samples, batch_bucket, check_prompts_fit, check_rows
from bpo_jax.sampler.tokens import typed_key

log = logging.getLogger(__name__)

# Request kinds that run programs, in the canonical order of a round's groups.
KINDS = ("prefill", "entropy", "sample")
# A worker's end: "done" (played its shares) or "failed" (raised).
ENDS = ("done", "failed")


class LockstepAborted(RuntimeError):
    """Another host's rollout (or this host's serving loop) failed: this host's stops too."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One policy call of a host's worker, as every host sees it.

    Attributes:
      kind: one of `KINDS`, or of `ENDS`.
      prompts: prefill: the prompts' token ids.
      context: entropy, sample: the id of the context (`SliceContext.id`).
      size: entropy: the context's prompts (rows of this host's block to score).
      rows: sample: the context rows to sample from, one action each (repeats allowed).
      in_place: sample: every prompt once, in order, and the context not kept (the caller's
        `sample(ctx)`): the context's cache may be consumed rather than copied.
      greedy: sample: argmax tokens.
      key: sample: (the call's raw key data as ints, its implementation's name).
      released: context ids this host's worker has dropped since its previous request.
    """

    kind: str
    prompts: tuple[tuple[int, ...], ...] = ()
    context: int = -1
    size: int = 0
    rows: tuple[int, ...] = ()
    in_place: bool = False
    greedy: bool = False
    key: tuple[tuple[int, ...], str] | None = None
    released: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS + ENDS:
            raise ValueError(f"Request kind must be one of {KINDS + ENDS}, got {self.kind!r}.")

    @property
    def num_rows(self) -> int:
        """Rows the request adds to its group's batch (0: not batched by rows)."""
        if self.kind == "prefill":
            return len(self.prompts)
        if self.kind == "sample":
            return len(self.rows)
        return 0


def group_key(request: Request) -> tuple:
    """What must be equal for requests to share one program: the kind, and greedy for samples
    (a static argument of the decode program). Sorts in the canonical order of a round."""
    return (KINDS.index(request.kind), request.kind == "sample" and request.greedy)


@dataclasses.dataclass(frozen=True)
class Group:
    """Requests of one round run as one program (one per context for "entropy").

    Attributes:
      kind, greedy: the group's `group_key`.
      hosts: the hosts with a request in the group, ascending; the others take part with filler.
      rows: R, each host's block of rows: the largest batch bucket of the hosts' requests
        (0 for "entropy", which scores contexts as they are).
    """

    kind: str
    greedy: bool
    hosts: tuple[int, ...]
    rows: int


def plan_round(requests: Sequence[Request]) -> list[Group]:
    """The round's groups, in canonical order: the same list on every host.

    Args:
      requests: every host's request of the round, in host order (ends included: they join
        no group).
    """
    by_key: dict[tuple, list[int]] = {}
    for host, r in enumerate(requests):
        if r.kind in KINDS:
            by_key.setdefault(group_key(r), []).append(host)
    groups = []
    for key, hosts in sorted(by_key.items()):
        kind = KINDS[key[0]]
        rows = 0 if kind == "entropy" else max(batch_bucket(requests[h].num_rows) for h in hosts)
        groups.append(Group(kind, key[1], tuple(hosts), rows))
    return groups


def blocks(
    items: Mapping[int, Sequence],
    hosts: int,
    rows: int,
    filler: Callable[[int, Sequence], Any],
) -> list:
    """A global batch of `hosts * rows` rows: host p's `items[p]` first in block p, then filler.

    Args:
      items: per host with rows, its rows (at most `rows`); hosts absent have none.
      filler: `filler(p, items of p)`: what fills host p's block after its own rows (its own
        first row, a padding prompt, ...).
    """
    out = []
    for p in range(hosts):
        own = list(items.get(p, ()))
        if len(own) > rows:
            raise ValueError(f"Host {p} has {len(own)} rows, more than the block of {rows}.")
        out += own + [filler(p, own) for _ in range(rows - len(own))]
    return out


class _Channel:
    """The worker's calls to the main thread, and their answers (one call at a time)."""

    def __init__(self):
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._released: list[int] = []
        self._lock = threading.Lock()
        self._closed: BaseException | None = None

    # The worker's side.
    def call(self, request: Request):
        if self._closed is not None:
            raise self._closed
        self._requests.put(request)
        reply = self._replies.get()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def end(self, failed: bool) -> None:
        self._requests.put(Request("failed" if failed else "done"))

    def release(self, context: int) -> None:
        """A context handle was dropped (any thread: a finalizer may run it)."""
        with self._lock:
            self._released.append(context)

    # The main thread's side.
    def next(self) -> Request:
        return self._requests.get()

    def reply(self, value) -> None:
        self._replies.put(value)

    def take_released(self) -> tuple[int, ...]:
        with self._lock:
            out, self._released = tuple(self._released), []
        return out

    def close(self, error: BaseException) -> None:
        """Every later call of the worker raises `error`; a call waiting now gets it too."""
        self._closed = error
        self._replies.put(error)


class SliceContext:
    """A worker's handle on a context of the executor's registry: its prompts, in this host's
    block of the global batch at `offset`. Dropping it announces its release."""

    def __init__(self, context: int, offset: int, prompts: list[list[int]], channel: _Channel):
        self.id = context
        self.offset = offset
        self.prompts = prompts
        weakref.finalize(self, channel.release, context)

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def prefilled_tokens(self) -> int:
        """Tokens the model ran for these prompts (all of them: no prefix reuse)."""
        return sum(len(p) for p in self.prompts)


class LockstepPolicy:
    """What a worker's rollouts see as the policy: `bpo_jax.sampler.policy.Policy`'s calls, each one
    posted to the main thread (`_Channel.call`) and answered once the hosts ran its round."""

    def __init__(self, channel: _Channel, policy):
        self._channel = channel
        self.tokenizer = policy.tokenizer
        self.max_new_tokens = policy.max_new_tokens
        self.cache_len = policy.cache_len
        self.temperature = policy.temperature
        self.prefixes = None  # No prefix reuse (module docstring).

    def forget_prefixes(self) -> None:
        """Nothing kept: there is no prefix cache."""

    def prefill(self, prompts: list[list[int]]) -> SliceContext:
        check_prompts_fit(prompts, self.max_new_tokens, self.cache_len)
        prompts = [[int(t) for t in p] for p in prompts]
        context, offset = self._channel.call(
            Request("prefill", prompts=tuple(tuple(p) for p in prompts))
        )
        return SliceContext(context, offset, prompts, self._channel)

    def next_token_entropy(self, ctx: SliceContext) -> np.ndarray:
        """[n] entropy of each prompt's first action token (as `Policy.next_token_entropy`)."""
        return self._channel.call(Request("entropy", context=ctx.id, size=ctx.size))

    def sample(
        self,
        ctx: SliceContext,
        rng,
        rows: list[int] | None = None,
        *,
        greedy: bool = False,
        keep_context: bool = False,
    ):
        """One action per prompt, or per entry of `rows` (as `Policy.sample`)."""
        every = list(range(ctx.size))
        rows = every if rows is None else [int(r) for r in rows]
        if not rows:
            return []
        check_rows(rows, ctx.size)
        out = self._channel.call(
            Request(
                "sample",
                context=ctx.id,
                rows=tuple(rows),
                in_place=rows == every and not keep_context,
                greedy=greedy,
                key=_key_data(rng),
            )
        )
        fields = (out["tokens"], out["logprobs"], out["entropies"], out["lengths"])
        return action_samples(self.tokenizer, *fields, len(rows))


def _key_data(rng) -> tuple[tuple[int, ...], str]:
    key = typed_key(rng)
    data = np.asarray(jax.random.key_data(key)).reshape(-1)
    return tuple(int(v) for v in data), str(jax.random.key_impl(key))


def run_in_lockstep(
    play: Callable[[LockstepPolicy], Any],
    executor,
    policy,
    *,
    allgather: Callable[[Request], list[Request]] | None = None,
    me: int | None = None,
):
    """`play(lockstep policy)` in a worker thread, its policy calls served in rounds with the
    other hosts'; returns what `play` returned. A collective: every host calls it at once.

    Args:
      play: this host's rollouts, given the policy to call.
      executor: runs a round's groups: `run(group, requests)` (this host's answer, or None
        where it has no request in the group) and `release(host, context ids)`.
      policy: the policy whose settings the worker's `LockstepPolicy` copies (tokenizer, ...).
      allgather: every host's request of a round, in host order (default:
        `distributed.allgather_objects`).
      me: this host's index in the gathered list (default: `jax.process_index()`).

    Raises:
      The worker's own exception where it failed; `LockstepAborted` on the other hosts.
    """
    allgather = distributed.allgather_objects if allgather is None else allgather
    me = distributed.process_index() if me is None else me
    channel = _Channel()
    proxy = LockstepPolicy(channel, policy)
    outcome: dict[str, Any] = {}

    def work():
        try:
            outcome["value"] = play(proxy)
        except BaseException as e:  # Announced to every host; re-raised on this one below.
            outcome["error"] = e
            channel.end(failed=True)
            return
        channel.end(failed=False)

    thread = threading.Thread(target=work, name="lockstep-rollouts", daemon=True)
    thread.start()
    try:
        _serve(channel, executor, allgather, me)
    except BaseException as e:
        channel.close(e if isinstance(e, LockstepAborted) else LockstepAborted(str(e)))
        thread.join()
        own = outcome.get("error")
        if own is not None and not isinstance(own, LockstepAborted):
            raise own from e
        raise
    thread.join()
    return outcome["value"]


def _serve(channel: _Channel, executor, allgather, me: int) -> None:
    """Rounds until every host's worker has ended (module docstring)."""
    ended: Request | None = None
    rounds = programs = 0
    while True:
        mine = ended or channel.next()
        if mine.kind in ENDS:
            ended = mine
        requests = allgather(dataclasses.replace(mine, released=channel.take_released()))
        for host, r in enumerate(requests):
            executor.release(host, r.released)
        failed = [h for h, r in enumerate(requests) if r.kind == "failed"]
        if failed:
            raise LockstepAborted(f"The rollouts of host(s) {failed} failed; see their logs.")
        if all(r.kind == "done" for r in requests):
            log.info("slice-wide sampling: %d rounds, %d groups of calls", rounds, programs)
            return
        reply = None
        for group in plan_round(requests):
            programs += 1
            out = executor.run(group, requests)
            if me in group.hosts:
                reply = out
        rounds += 1
        if ended is None:
            channel.reply(reply)
