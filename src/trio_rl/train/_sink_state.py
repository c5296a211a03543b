"""The sink's state codec: an open group's record, the snapshot the checkpoint saves, and the
restore that rebuilds a sink from it (the queue first, open groups back to the rollout layer).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Literal

import attrs

from ..samples import Group, PolicyVersion, Prompt, ResumedGroup, Sample, SampleStatus
from ._errors import TrainSinkError
from ._queue import SinkBooks, SinkCounters, SinkWindow
from ._scoring import GroupScore, sample_version, validate_sample
from ._types import TrainingSample

if TYPE_CHECKING:
    from ._sink import TrainSink

__all__ = [
    "OpenBook",
    "OpenGroup",
    "OpenGroupState",
    "RestoreReport",
    "SinkState",
    "copy_sample",
    "payload_files_of_state",
    "restore_sink",
    "snapshot_sink",
    "state_problem",
]

logger = logging.getLogger("trio_rl.train")


@attrs.frozen
class OpenGroupState:
    """A checkpointed open group: its identity, task and the finished members that arrived."""

    group_id: str
    prompt: Prompt
    group_size: int
    policy_version_at_start: PolicyVersion
    members: tuple[Sample, ...]


@attrs.frozen
class SinkState:
    """An owned snapshot of the sink (see :meth:`TrainSink.state_dict`)."""

    step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    queued: tuple[TrainingSample, ...]
    open_groups: tuple[OpenGroupState, ...]


@attrs.frozen
class RestoreReport:
    """What :meth:`TrainSink.load_state_dict` restored and dropped.

    ``resumed`` go back to the rollout layer (same id, prompt, arrived members) to be scheduled
    before any new prompt; ``completed_groups`` were already full and were scored at restore, so
    nothing is dispatched for them.
    """

    resumed: list[ResumedGroup]
    completed_groups: list[str]
    queued: int
    dropped_queued_missing: int
    dropped_queued_stale: int
    dropped_members_missing: int
    dropped_members_stale: int


@attrs.define(slots=True, eq=False)
class OpenGroup:
    group_id: str
    prompt: Prompt
    group_size: int
    start: PolicyVersion
    members: list[Sample] = attrs.field(factory=list)
    seen: set[int] = attrs.field(factory=set)
    failed: int = 0
    cancelled: int = 0
    aborted: bool = False

    @property
    def complete(self) -> bool:
        return len(self.members) + self.failed + self.cancelled >= self.group_size

    def check_new(self, samples: Iterable[Sample]) -> None:
        """Reject members this group already holds, pending ones and malformed ones."""
        where = f"group {self.group_id}"
        for s in samples:
            if s.index in self.seen:
                raise TrainSinkError(f"{where}, sample {s.index}: arrived twice")
            if s.status is SampleStatus.PENDING:
                raise TrainSinkError(f"{where}, sample {s.index}: still pending")
            validate_sample(s, where)

    def arrive(self, samples: Iterable[Sample]) -> tuple[int, int]:
        """Record arrived members; returns how many failed and were cancelled (aborted), which
        the caller books at once: only finished members are held."""
        failed = cancelled = 0
        for s in samples:
            self.seen.add(s.index)
            if s.status is SampleStatus.FAILED:
                failed += 1
            elif s.status is SampleStatus.ABORTED:
                cancelled += 1
                self.aborted = True
            else:
                self.members.append(s)
        self.failed += failed
        self.cancelled += cancelled
        return failed, cancelled

    def adopt_rewards(self, group: Group) -> None:
        """A resumed group's group reward ran over the whole group, restored members included:
        the rollout layer's reward (same sample index) is the one to score with."""
        rewards = {s.index: s.reward for s in group.samples if s.index in self.seen}
        for m in self.members:
            reward = rewards.get(m.index)
            if reward is not None:
                m.reward = reward


@attrs.define(slots=True, eq=False)
class OpenBook:
    """The sink's open groups and what their arrivals book: every member that arrives is
    dispatched once, failed and aborted ones settle at once, finished ones are held until the
    group completes and is scored."""

    books: SinkBooks
    groups: dict[str, OpenGroup] = attrs.field(factory=dict)

    @property
    def held(self) -> int:
        return sum(len(g.members) for g in self.groups.values())

    def open(
        self, group_id: str, prompt: Prompt, group_size: int, start: PolicyVersion
    ) -> OpenGroup:
        if group_id in self.groups:
            raise TrainSinkError(f"group {group_id}: already open")
        if group_size < 1:
            raise TrainSinkError(f"group {group_id}: group_size must be >= 1, got {group_size}")
        g = self.groups[group_id] = OpenGroup(group_id, prompt, group_size, start)
        return g

    def member(self, group_id: str, sample: Sample) -> OpenGroup:
        """One member of open group ``group_id`` arrived; returns the group."""
        g = self.groups.get(group_id)
        if g is None:
            raise TrainSinkError(f"group {group_id}: member {sample.index} for a group not open")
        g.check_new([sample])
        self.arrive(g, [sample])
        return g

    def admit(self, group: Group) -> None:
        """A finished group arrives whole; members an open group (e.g. resumed) already holds
        (same sample index) are recognised and not counted twice."""
        g = self.groups.get(group.group_id)
        if g is None:
            g = OpenGroup(
                group.group_id, group.prompt, max(1, group.size), group.policy_version_at_start
            )
        g.adopt_rewards(group)
        new = [s for s in group.samples if s.index not in g.seen]
        if len({s.index for s in new}) != len(new):
            raise TrainSinkError(f"group {group.group_id}: duplicate sample indices")
        g.check_new(new)
        self.groups[group.group_id] = g
        self.arrive(g, new)

    def arrive(self, g: OpenGroup, samples: list[Sample]) -> None:
        self.books.dispatched(len(samples))
        failed, cancelled = g.arrive(samples)
        self.books.book("failed", failed)
        self.books.book("cancelled", cancelled)

    def lose(
        self, outcome: Literal["failed", "cancelled"], n: int, gid: str | None
    ) -> OpenGroup | None:
        """``n`` dispatched samples ended without a sample; returns their group if it is open."""
        if n < 0:
            raise TrainSinkError(f"record_{outcome}: n must be >= 0, got {n}")
        g = self.groups.get(gid) if gid is not None else None
        if gid is not None and g is None:
            raise TrainSinkError(f"record_{outcome}: group {gid} is not open")
        self.books.dispatched(n)
        self.books.book(outcome, n)
        if g is not None:
            setattr(g, outcome, getattr(g, outcome) + n)
        return g

    def close(self, group_id: str) -> OpenGroup:
        """Take a complete group out to be scored; the attempt budget counts every member that
        arrived, stale ones included (defect 2)."""
        g = self.groups.pop(group_id)
        w = self.books.window
        n_owed = len(g.members) + g.failed + g.cancelled
        self.books.window = attrs.evolve(w, attempts=w.attempts + n_owed, groups=w.groups + 1)
        return g

    def book_score(self, score: GroupScore) -> None:
        self.books.book("filtered", score.filtered)
        self.books.book("stale", score.stale)
        self.books.book("pruned", score.pruned)
        if score.rewards:
            w = self.books.window
            self.books.window = attrs.evolve(
                w,
                reward_sum=w.reward_sum + sum(score.rewards),
                reward_count=w.reward_count + len(score.rewards),
            )


def copy_sample(s: Sample) -> Sample:
    """An owned copy of a finished sample: its lists, metadata and payload segments are new
    objects (for a checkpoint snapshot taken on the loop and written in a worker)."""
    return attrs.evolve(
        s,
        completion_tokens=list(s.completion_tokens),
        logprobs=list(s.logprobs),
        loss_mask=list(s.loss_mask),
        policy_versions=list(s.policy_versions),
        metadata=dict(s.metadata),
        payload=[copy.copy(seg) for seg in s.payload],
    )


def sample_files(s: Sample) -> set[str]:
    return {seg.file for seg in s.payload}


def snapshot_sink(sink: TrainSink) -> SinkState:
    """An owned snapshot, taken on the loop.

    Containers are copied. Queued samples are shared, not copied: once queued, the library
    never mutates a training sample (post-selection pruning works on copies), so sharing them
    costs nothing and cannot tear. Callers must not mutate queued or shipped samples in place
    while a save of an earlier snapshot is still running. Members of open groups are copied
    with their lists. Samples in a cut are saved as queued. Groups in flight in the rollout
    layer (see :meth:`TrainSink.track_in_flight`) are saved as open groups.
    """
    open_groups = {
        g.group_id: OpenGroupState(
            group_id=g.group_id,
            prompt=g.prompt,
            group_size=g.group_size,
            policy_version_at_start=g.start,
            members=tuple(copy_sample(m) for m in g.members),
        )
        for g in sink._open.values()
    }
    # Work in flight (see track_in_flight): members the sink has not seen yet are saved as
    # arrived and count as dispatched; on restore the sink holds them, and they settle
    # exactly once like any other arrival.
    added = 0
    for group in sink._in_flight() if sink._in_flight is not None else ():
        held = open_groups.get(group.group_id)
        seen = set() if held is None else {m.index for m in held.members}
        new = tuple(copy_sample(m) for m in group.arrived if m.index not in seen)
        added += len(new)
        open_groups[group.group_id] = OpenGroupState(
            group_id=group.group_id,
            prompt=group.prompt,
            group_size=group.group_size,
            policy_version_at_start=group.policy_version_at_start,
            members=(*(() if held is None else held.members), *new),
        )
    counters = sink._books.counters
    if added:
        counters = attrs.evolve(counters, dispatched=counters.dispatched + added)
    return SinkState(
        step=sink.queue.step,
        next_arrival=sink._next_arrival,
        counters=counters,
        window=sink._books.window,
        queued=sink.queue.saved(),
        open_groups=tuple(open_groups.values()),
    )


def restore_sink(
    sink: TrainSink, state: SinkState, *, missing_files: Collection[str] = ()
) -> RestoreReport:
    """Replace the sink's state with a checkpoint's.

    Queued samples come back first in the queue (stale ones and those naming a file in
    ``missing_files`` are dropped and logged). Open groups keep their id, prompt and fresh
    members; members dropped (stale or missing files) are regenerated like any missing one.
    An open group whose fresh members already fill it is scored now and dispatches nothing.

    A state that breaks the sink's invariants (see :func:`state_problem`) raises
    :class:`TrainSinkError` naming the field, and the sink is left unchanged.
    """
    problem = state_problem(state)
    if problem is not None:
        raise TrainSinkError(f"restore: {problem[0]}: {problem[1]}")
    sink.queue.reset(state.step)
    sink._next_arrival = state.next_arrival
    sink._books.counters = state.counters
    sink._books.window = state.window
    sink._open.clear()
    missing = set(missing_files)
    q_missing = q_stale = m_missing = m_stale = 0
    for ts in state.queued:
        if missing and any(seg.file in missing for seg in ts.payload or ()):
            q_missing += 1
        elif sink._is_stale(ts.policy_version):
            q_stale += 1
        else:
            sink.queue.enqueue(ts)
            sink._next_arrival = max(sink._next_arrival, ts.arrival + 1)
    sink._book("filtered", q_missing)
    sink._book("stale", q_stale)
    resumed: list[ResumedGroup] = []
    completed: list[str] = []
    for og in state.open_groups:
        fresh: list[Sample] = []
        for m in og.members:
            if missing and sample_files(m) & missing:
                m_missing += 1
            elif sink._is_stale(sample_version(m, og.policy_version_at_start)):
                m_stale += 1
            else:
                fresh.append(copy_sample(m))
        g = OpenGroup(og.group_id, og.prompt, og.group_size, og.policy_version_at_start)
        g.members = fresh
        g.seen = {m.index for m in fresh}
        sink._open[og.group_id] = g
        # A full group is scored now only when every member has its reward; otherwise its
        # group reward had not run at the checkpoint, and it goes back to the rollout layer,
        # which dispatches nothing for it and only runs the reward.
        if g.complete and (len(fresh) < og.group_size or all(m.reward is not None for m in fresh)):
            completed.append(og.group_id)
            sink._finalize(og.group_id)
        else:
            resumed.append(
                ResumedGroup(
                    group_id=og.group_id,
                    prompt=og.prompt,
                    group_size=og.group_size,
                    arrived=[copy_sample(m) for m in fresh],
                    policy_version_at_start=og.policy_version_at_start,
                )
            )
    sink._book("filtered", m_missing)
    sink._book("stale", m_stale)
    if q_missing or q_stale or m_missing or m_stale:
        logger.warning(
            "restore: dropped %d queued samples with missing payload files, %d stale queued "
            "samples, %d open-group members with missing payload files and %d stale members "
            "(dropped members are regenerated)",
            q_missing,
            q_stale,
            m_missing,
            m_stale,
        )
    return RestoreReport(
        resumed=resumed,
        completed_groups=completed,
        queued=len(sink.queue),
        dropped_queued_missing=q_missing,
        dropped_queued_stale=q_stale,
        dropped_members_missing=m_missing,
        dropped_members_stale=m_stale,
    )


def state_problem(state: SinkState) -> tuple[str, str] | None:
    """The first broken invariant of a snapshot as ``(field path, reason)``, or None.

    Checked: counters and window are non-negative and the window is part of the counters; every
    dispatched sample is settled or held (queued, or a member of an open group); queued arrivals
    strictly increase (they key the queue); open group ids are distinct, each group holds finished
    members with distinct indices, finite rewards and versions in order. A group holding more
    members than ``group_size`` is allowed here (it is scored once, with all of them); the
    checkpoint reader refuses one.
    """
    c, w = state.counters, state.window
    if state.step < 1:
        return "step", f"{state.step} is not a step (steps start at 1)"
    if state.next_arrival < 0:
        return "next_arrival", f"{state.next_arrival} is negative"
    for name in _COUNTER_NAMES:
        if getattr(c, name) < 0:
            return f"counters.{name}", f"{getattr(c, name)} is negative"
    for name in _WINDOW_COUNTS:
        if getattr(w, name) < 0:
            return f"window.{name}", f"{getattr(w, name)} is negative"
        if name in _COUNTER_NAMES and getattr(w, name) > getattr(c, name):
            return f"window.{name}", f"{getattr(w, name)} exceeds counters.{name}"
    if not math.isfinite(w.reward_sum):
        return "window.reward_sum", f"{w.reward_sum!r} is not finite"
    previous = -1
    for i, ts in enumerate(state.queued):
        if ts.arrival <= previous:
            return f"queued[{i}].arrival", f"{ts.arrival} after {previous} (not in arrival order)"
        previous = ts.arrival
    ids: set[str] = set()
    held = len(state.queued)
    for i, og in enumerate(state.open_groups):
        where = f"open_groups[{i}]"
        if og.group_id in ids:
            return f"{where}.group_id", f"duplicate open group {og.group_id!r}"
        ids.add(og.group_id)
        if og.group_size < 1:
            return f"{where}.group_size", f"{og.group_size} is not a group size"
        if og.policy_version_at_start < 0:
            return f"{where}.policy_version_at_start", "negative version"
        seen: set[int] = set()
        for j, m in enumerate(og.members):
            if m.index in seen:
                return f"{where}.members[{j}].index", f"duplicate sample index {m.index}"
            seen.add(m.index)
            if not m.status.is_finished:
                return f"{where}.members[{j}].status", f"{m.status.value} member (not finished)"
            if m.reward is not None and not math.isfinite(m.reward):
                return f"{where}.members[{j}].reward", f"{m.reward!r} is not finite"
            versions = m.policy_versions
            if any(v < 0 for v in versions) or any(b < a for a, b in itertools.pairwise(versions)):
                return f"{where}.members[{j}].policy_versions", f"{versions} out of order"
        held += len(og.members)
    if c.dispatched != c.settled + held:
        return (
            "counters.dispatched",
            f"{c.dispatched} dispatched, but {c.settled} settled and {held} held",
        )
    return None


_COUNTER_NAMES = tuple(f.name for f in attrs.fields(SinkCounters))
_WINDOW_COUNTS = tuple(f.name for f in attrs.fields(SinkWindow) if f.name != "reward_sum")


def payload_files_of_state(state: SinkState) -> set[str]:
    """Every payload file a snapshot's queued samples and open-group members refer to."""
    files: set[str] = set()
    for ts in state.queued:
        files.update(seg.file for seg in ts.payload or ())
    for og in state.open_groups:
        for m in og.members:
            files |= sample_files(m)
    return files
