"""The sink's state codec: an open group's record, the snapshot the checkpoint saves, and the
restore that rebuilds a sink from it (the queue first, open groups back to the rollout layer).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable, Collection, Generator, Sequence
from typing import TYPE_CHECKING, Literal

import attrs

from ..samples import Group, OpenGroup, PolicyVersion, Prompt, Sample, SampleStatus
from ._changes import ChangeLog
from ._errors import TrainSinkError
from ._queue import Outcome, SinkBooks, SinkCounters, SinkWindow
from ._scoring import GroupScore, sample_version, validate_sample
from ._types import TrainingSample

if TYPE_CHECKING:
    from ._sink import TrainSink

__all__ = [
    "OpenBook",
    "OpenGroup",
    "RestoreReport",
    "SinkDelta",
    "SinkState",
    "copy_open_group",
    "copy_sample",
    "payload_files_of_state",
    "restore_sink",
    "restoring",
    "snapshot_changes",
    "snapshot_sink",
    "state_problem",
]

logger = logging.getLogger("trio_rl.train")


@attrs.frozen
class SinkState:
    """An owned snapshot of the sink (see :meth:`TrainSink.state_dict`)."""

    step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    queued: tuple[TrainingSample, ...]
    open_groups: tuple[OpenGroup, ...]


@attrs.frozen
class RestoreReport:
    """What :meth:`TrainSink.load_state_dict` restored and dropped.

    ``resumed`` go back to the rollout layer (same id, prompt, arrived members) to be scheduled
    before any new prompt; ``completed_groups`` were already full and were scored at restore, so
    nothing is dispatched for them.
    """

    resumed: list[OpenGroup]
    completed_groups: list[str]
    queued: int
    dropped_queued_missing: int
    dropped_queued_stale: int
    dropped_members_missing: int
    dropped_members_stale: int


@attrs.define(slots=True, eq=False)
class OpenBook:
    """The sink's open groups and what their arrivals book: the one record of work in flight.

    It is the :class:`~trio_rl.samples.GroupBook` the async driver reports to, and the sink's
    own member-by-member API books through it. Every member that arrives is dispatched once;
    failed and aborted ones settle at once; finished ones are held until the group closes:
    scored (``finalize``, the sink's), or settled by a failed attempt or a discard.
    """

    books: SinkBooks
    #: Scores a complete group (``TrainSink._finalize``): takes it out with :meth:`close`.
    finalize: Callable[[str], None]
    groups: dict[str, OpenGroup] = attrs.field(factory=dict)
    #: What an incremental checkpoint saves that changed (shared with the queue).
    changes: ChangeLog = attrs.field(factory=ChangeLog)

    @property
    def held(self) -> int:
        return sum(len(g.arrived) for g in self.groups.values())

    def open(
        self, group_id: str, prompt: Prompt, group_size: int, start: PolicyVersion
    ) -> OpenGroup:
        if group_id in self.groups:
            raise TrainSinkError(f"group {group_id}: already open")
        if group_size < 1:
            raise TrainSinkError(f"group {group_id}: group_size must be >= 1, got {group_size}")
        g = self.groups[group_id] = OpenGroup(
            group_id, prompt, group_size, policy_version_at_start=start
        )
        self.changes.opened(group_id)
        return g

    def member(self, group_id: str, sample: Sample) -> OpenGroup:
        """One member of open group ``group_id`` arrived; returns the group."""
        g = self.groups.get(group_id)
        if g is None:
            raise TrainSinkError(f"group {group_id}: member {sample.index} for a group not open")
        self.arrive(g, [sample])
        return g

    def admit(self, group: Group) -> None:
        """A finished group arrives whole; members the book already holds for it (same sample
        index: reported by the driver, or restored) are recognised and not counted twice."""
        g = self._opened(group)
        self.changes.group(g.group_id)  # rewards of held members are set below
        rewards = {s.index: s.reward for s in group.samples if s.index in g.seen}
        for m in g.arrived:
            # the group reward ran over the whole group, restored members included
            if (reward := rewards.get(m.index)) is not None:
                m.reward = reward
        new = [s for s in group.samples if s.index not in g.seen]
        if len({s.index for s in new}) != len(new):
            raise TrainSinkError(f"group {group.group_id}: duplicate sample indices")
        for m in g.arrived:
            if m.reward is None or not math.isfinite(m.reward):
                validate_sample(m, f"group {g.group_id}")  # names the unrewarded member
        self.arrive(g, new)

    def arrive(self, g: OpenGroup, samples: list[Sample], *, rewarded: bool = True) -> None:
        """Book new members of ``g`` (any status): dispatched; failed and aborted ones settle.
        ``rewarded=False``: reported as they finish, before any group reward."""
        where = f"group {g.group_id}"
        for s in samples:
            if s.index in g.seen:
                raise TrainSinkError(f"{where}, sample {s.index}: arrived twice")
            if s.status is SampleStatus.PENDING:
                raise TrainSinkError(f"{where}, sample {s.index}: still pending")
            validate_sample(s, where, rewarded=rewarded)
        self.books.dispatched(len(samples))
        if samples:
            self.changes.group(g.group_id)
        for s in samples:
            g.seen.add(s.index)
            if s.status is SampleStatus.FAILED:
                g.failed += 1
                self.books.book("failed", 1)
                self._failure_type("failed_status")
            elif s.status is SampleStatus.ABORTED:
                g.cancelled += 1
                g.aborted = True
                self.books.book("cancelled", 1)
            else:
                g.arrived.append(s)

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
        self.changes.close(group_id)
        self._attempts(len(g.arrived) + g.failed + g.cancelled, groups=1)
        # scored in sample order, not the order members finished in (which trio varies): the
        # group's training samples and metrics then never depend on timing
        g.arrived.sort(key=lambda s: s.index)
        return g

    def _attempts(self, n: int, *, groups: int = 0) -> None:
        w = self.books.window
        self.books.window = attrs.evolve(w, attempts=w.attempts + n, groups=w.groups + groups)

    def book_score(self, score: GroupScore) -> None:
        self.books.book("filtered", score.filtered)
        self.books.book("stale", score.stale)
        self.books.book("pruned", score.pruned)
        w = self.books.window
        # The value lists are the live window's own (see `SinkWindow`): appended in place.
        w.rewards.extend(score.rewards)
        w.completion_lengths.extend(score.lengths)
        if score.rewards or score.zero_length:
            self.books.window = attrs.evolve(
                w,
                reward_sum=w.reward_sum + sum(score.rewards),
                reward_count=w.reward_count + len(score.rewards),
                zero_length=w.zero_length + score.zero_length,
            )

    def _failure_type(self, name: str, n: int = 1) -> None:
        types = self.books.window.failure_types
        types[name] = types.get(name, 0) + n

    def _failures(self, error: BaseException | None) -> None:
        """Count a failed attempt's errors by type: each real failure of a `GroupFailed`
        (a sample's or the group reward's exception), or ``error`` itself."""
        if error is None:
            return
        failures = getattr(error, "failures", None)
        if isinstance(failures, tuple) and failures:
            for _, exc in failures:
                self._failure_type(type(exc).__name__)
        else:
            self._failure_type(type(error).__name__)

    # -- GroupBook: what the async driver reports ------------------------------------------

    def _opened(self, group: Group) -> OpenGroup:
        g = self.groups.get(group.group_id)
        if g is None:
            g = self.open(
                group.group_id, group.prompt, max(1, group.size), group.policy_version_at_start
            )
        return g

    def group_opened(self, group: Group) -> None:
        """``group`` was submitted: opened here unless open already (restored, or a retry).
        Members arrive only as reported (or when the group is handed over whole)."""
        self._opened(group)

    def members_arrived(self, group: Group, samples: Sequence[Sample]) -> None:
        """Finished members of open ``group`` arrived; held (the same objects) until it closes.
        Never scores: the group reward may not have run yet (the consumer's add_group does)."""
        g = self._opened(group)
        self.arrive(g, [s for s in samples if s.index not in g.seen], rewarded=False)

    def attempt_failed(self, group: Group, error: BaseException | None = None) -> None:
        """The attempt raised: each of its samples settles failed (held members included, before
        the driver resets them for the retry), counted in the attempt budget; the group stays
        open and empty. ``error`` (the attempt's `GroupFailed`) is counted by type."""
        g = self._opened(group)
        self._failures(error)
        self._settle(g, group, "failed")
        g.arrived, g.seen, g.failed, g.cancelled, g.aborted = [], set(), 0, 0, False
        self.changes.group(g.group_id)

    def group_discarded(
        self, group: Group, reason: str, error: BaseException | None = None
    ) -> None:
        """``group`` will not reach the consumer. ``"aborted"``: scored like any group (aborted
        members cancelled, the rest filtered); ``"failed"`` (its last attempt, ``error`` counted
        by type), ``"filtered"``, ``"stale"``: every member settles under that outcome and the
        group closes."""
        self._failures(error)
        if reason == "aborted":
            self.admit(group)
            self.finalize(group.group_id)
            return
        outcome: Outcome = (
            reason if reason in ("failed", "filtered", "stale") else "cancelled"  # type: ignore[assignment]
        )
        g = self._opened(group)
        self._settle(g, group, outcome)
        del self.groups[group.group_id]
        self.changes.close(group.group_id)

    def _settle(self, g: OpenGroup, group: Group, outcome: Outcome) -> None:
        unseen = [s for s in group.samples if s.index not in g.seen]
        self.books.dispatched(len(unseen))
        self.books.book(outcome, len(g.arrived) + len(unseen))
        self._attempts(len(g.arrived) + len(unseen) + g.failed + g.cancelled)


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
    while a save of an earlier snapshot is still running. Samples in a cut are saved as queued.
    Every open group of the book (the rollout layer's work in flight included: the driver
    reports it there) is saved as it is, its arrived members copied with their lists.
    """
    return SinkState(
        step=sink.queue.step,
        next_arrival=sink._next_arrival,
        counters=sink._books.counters,
        window=sink._books.window.copy(),
        queued=sink.queue.saved(),
        open_groups=tuple(copy_open_group(g) for g in sink.book.groups.values()),
    )


@attrs.frozen
class SinkDelta:
    """What changed in the sink since the previous incremental snapshot (O(changes)).

    The small part (step, arrival counter, counters, window) is whole; of the queue only the
    samples ``put`` under an arrival since then and the arrivals ``removed``; of the open groups
    the records that changed (``groups``, owned copies; a new one goes after the others) and the
    ids ``closed``. Applied in that order: removals first, then puts; closes, then groups.
    """

    step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    put: tuple[TrainingSample, ...]
    removed: tuple[int, ...]
    groups: tuple[OpenGroup, ...]
    closed: tuple[str, ...]


def copy_open_group(g: OpenGroup) -> OpenGroup:
    """An owned copy of an open group's saved record (its arrived members copied)."""
    return OpenGroup(
        g.group_id,
        g.prompt,
        g.group_size,
        [copy_sample(m) for m in g.arrived],
        g.policy_version_at_start,
    )


def snapshot_changes(sink: TrainSink) -> SinkDelta:
    """Drain the sink's change log into a :class:`SinkDelta`, on the loop: O(what changed).
    Queued samples are shared (never mutated once queued), open-group records copied."""
    queued, dirty, closed = sink.changes.drain()
    groups = sink.book.groups
    gone = [gid for gid in dirty if gid not in groups]  # defensive: closed without a record
    return SinkDelta(
        step=sink.queue.step,
        next_arrival=sink._next_arrival,
        counters=sink._books.counters,
        window=sink._books.window.copy(),
        put=tuple(ts for _, ts in sorted(queued.items()) if ts is not None),
        removed=tuple(sorted(a for a, ts in queued.items() if ts is None)),
        groups=tuple(copy_open_group(groups[gid]) for gid in dirty if gid in groups),
        closed=(*closed, *gone),
    )


def restore_sink(
    sink: TrainSink,
    state: SinkState,
    *,
    missing_files: Collection[str] = (),
    track: object = None,
) -> RestoreReport:
    """Replace the sink's state with a checkpoint's.

    Queued samples come back first in the queue (stale ones and those naming a file in
    ``missing_files`` are dropped and logged). Open groups go back into the book with their id,
    prompt and fresh members; members dropped (stale or missing files) are regenerated like any
    missing one. An open group whose fresh members already fill it is scored now and dispatches
    nothing; the others are the report's ``resumed``: the book's own records, which the rollout
    layer continues.

    A state that breaks the sink's invariants (see :func:`state_problem`) raises
    :class:`TrainSinkError` naming the field, and the sink is left unchanged.

    ``track`` (an incremental checkpoint manager) starts the sink's change log at ``state`` as
    saved: what the restore changes in it (dropped work, groups scored now) is logged, so the
    next checkpoint is a delta after the one restored from.
    """
    problem = state_problem(state)
    if problem is not None:
        raise TrainSinkError(f"restore: {problem[0]}: {problem[1]}")
    steps = restoring(sink, state, missing_files=missing_files, track=track)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            report: RestoreReport = done.value
            return report


#: Records a restore handles between two yields of :func:`restoring`.
RESTORE_BATCH = 512


def restoring(
    sink: TrainSink,
    state: SinkState,
    *,
    missing_files: Collection[str] = (),
    track: object = None,
) -> Generator[None, None, RestoreReport]:
    """:func:`restore_sink` without the invariant check (the caller ran :func:`state_problem`),
    as a generator that yields every ``RESTORE_BATCH`` records and returns the report: an async
    caller checkpoints at each yield, so a restore of any size lets a cancellation in. Stopped
    part-way, the sink holds part of ``state``: discard it."""
    sink.queue.reset(state.step)
    sink._next_arrival = state.next_arrival
    sink._books.counters = state.counters
    sink._books.window = state.window.copy()
    book = sink.book
    book.groups.clear()
    changes = book.changes
    changes.invalidate()
    if track is not None:
        changes.start(track)
        changes.active = False  # the bulk restore below is ``state`` itself: not a change
    missing = set(missing_files)
    q_missing = q_stale = m_missing = m_stale = 0
    dropped: list[int] = []
    for i, ts in enumerate(state.queued):
        if i % RESTORE_BATCH == RESTORE_BATCH - 1:
            yield
        if missing and any(seg.file in missing for seg in ts.payload or ()):
            q_missing += 1
            dropped.append(ts.arrival)
        elif sink.queue.is_stale(ts.policy_version):
            q_stale += 1
            dropped.append(ts.arrival)
        else:
            sink.queue.enqueue(ts)
            sink._next_arrival = max(sink._next_arrival, ts.arrival + 1)
    if track is not None:
        changes.active = True  # from here on, what the restore changes in ``state`` is logged
        for a in dropped:
            changes.remove(a)
    sink._books.book("filtered", q_missing)
    sink._books.book("stale", q_stale)
    resumed: list[OpenGroup] = []
    completed: list[str] = []
    for i, og in enumerate(state.open_groups):
        if i % RESTORE_BATCH == RESTORE_BATCH - 1:
            yield
        fresh: list[Sample] = []
        for m in og.arrived:
            if missing and sample_files(m) & missing:
                m_missing += 1
            elif sink.queue.is_stale(
                sample_version(m, og.policy_version_at_start, sink.config.staleness)
            ):
                m_stale += 1
            else:
                fresh.append(copy_sample(m))
        g = book.groups[og.group_id] = OpenGroup(
            og.group_id, og.prompt, og.group_size, fresh, og.policy_version_at_start
        )
        if len(fresh) != len(og.arrived):
            changes.group(og.group_id)  # members dropped
        # A full group is scored now only when every member has its reward; otherwise its
        # group reward had not run at the checkpoint, and it goes back to the rollout layer,
        # which dispatches nothing for it and only runs the reward.
        if g.complete and (len(fresh) < og.group_size or all(m.reward is not None for m in fresh)):
            completed.append(og.group_id)
            sink._finalize(og.group_id)
        else:
            resumed.append(g)
    sink._books.book("filtered", m_missing)
    sink._books.book("stale", m_stale)
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
    if not all(map(math.isfinite, w.rewards)):
        return "window.rewards", "a reward is not finite"
    if any(n < 0 for n in w.completion_lengths):
        return "window.completion_lengths", "a length is negative"
    if any(n < 0 for n in w.failure_types.values()):
        return "window.failure_types", "a count is negative"
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
        for j, m in enumerate(og.arrived):
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
        held += len(og.arrived)
    if c.dispatched != c.settled + held:
        return (
            "counters.dispatched",
            f"{c.dispatched} dispatched, but {c.settled} settled and {held} held",
        )
    return None


_COUNTER_NAMES = tuple(f.name for f in attrs.fields(SinkCounters))
_WINDOW_COUNTS = tuple(f.name for f in attrs.fields(SinkWindow) if f.type in ("int", int))


def payload_files_of_state(state: SinkState) -> set[str]:
    """Every payload file a snapshot's queued samples and open-group members refer to."""
    files: set[str] = set()
    for ts in state.queued:
        files.update(seg.file for seg in ts.payload or ())
    for og in state.open_groups:
        for m in og.arrived:
            files |= sample_files(m)
    return files
