"""The train sink: finished groups in, training batches out, every sample accounted for; and
the sink's snapshots and restores (the state values they use are ``_sink_state``'s).

All methods except :meth:`TrainSink.ingest_group` and :meth:`TrainSink.take_batch` are
synchronous and meant to run on the event loop; they never block. Those two run their costly
part in a worker thread: the training lists of a group, and post-selection pruning of samples
the sink has already detached.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Literal

import trio

from ..samples import Group, OpenGroup, PolicyVersion, Prompt, Sample
from ._changes import ChangeLog
from ._open_book import OpenBook
from ._queue import (
    Cut,
    DetachedBatch,
    PruneMode,
    SampleQueue,
    SinkConfig,
    SinkCounters,
    SinkTally,
    SinkWindow,
    TrainBatch,
)
from ._scoring import (
    PruneResult,
    SequenceLists,
    build_sequences,
    member_is_stale,
    sample_version,
    score_group,
)
from ._sink_state import (
    RestoreDrops,
    RestoreReport,
    SinkDelta,
    SinkState,
    check_restorable,
    copy_open_group,
    copy_sample,
)
from ._types import TrainingSample
from ._zero_output import ZeroOutputBudget

__all__ = [
    "RESTORE_BATCH",
    "TrainSink",
    "finish_restore",
    "finish_restore_async",
    "restore_sink",
    "restoring",
    "snapshot_changes",
    "snapshot_sink",
]

logger = logging.getLogger("trio_rl.sink")


class TrainSink:
    """Scores finished groups, queues training samples and cuts batches.

    Groups arrive whole (:meth:`add_group`) or member by member (:meth:`open_group` then
    :meth:`add_member`); failures and cancellations that produced no sample are counted with
    :meth:`record_failed` / :meth:`record_cancelled`. ``step`` is the batch being collected
    (1-based); batch ``S`` trains on policy ``S - 1``, and a sample generated at version ``v`` is
    stale for it when ``v < (S - 1) - max_off_policy_steps``.
    """

    def __init__(self, config: SinkConfig, *, step: int = 1) -> None:
        self.config = config
        self._tally = SinkTally()
        #: What changed since the last incremental checkpoint (queue and book record it).
        self.changes = ChangeLog()
        #: The queue and its cut (ready, detach, settle, requeue, staleness).
        self.queue = SampleQueue(config, self._tally, step=step, changes=self.changes)
        self._next_arrival = 0
        #: #3806's zero-output budget: finished groups that queued nothing, with its warning.
        self.zero_output = ZeroOutputBudget(
            config.batch_size or config.token_batch_size or 1,
            tokens=config.batch_size is None,
        )
        #: The open-group book: the one record of work in flight, and the
        #: :class:`~trio_rl.samples.GroupBook` the async driver reports to.
        self.book = OpenBook(
            self._tally, self._finalize, changes=self.changes, zero_output=self.zero_output
        )

    # -- inspection -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.queue.step

    @property
    def counters(self) -> SinkCounters:
        return self._tally.counters

    @property
    def window(self) -> SinkWindow:
        """The metrics window accumulated since the last non-empty batch (not reset by reading)."""
        return self._tally.window

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def queued_tokens(self) -> int:
        return self.queue.tokens

    @property
    def held(self) -> int:
        """Samples the sink holds: queued, arrived members of open groups, and in a cut."""
        return self.queue.held + self.book.held

    def open_group_ids(self) -> list[str]:
        return list(self.book.groups)

    def arrived(self, group_id: str) -> int:
        """How many members of open group ``group_id`` arrived so far (0 if it is not open)."""
        g = self.book.groups.get(group_id)
        return 0 if g is None else len(g.seen)

    def queued_samples(self) -> list[TrainingSample]:
        """The queue in arrival order (the objects themselves: do not mutate)."""
        return self.queue.samples()

    def live_payload_versions(self) -> set[PolicyVersion]:
        """Versions whose payload directories a holder the sink knows of may still read.

        Queued samples (restored ones included), arrived members and start versions of open groups
        (in flight in the rollout layer, or resumed: a start version bounds the versions its
        requests wrote under), samples in a cut, and batches shipped but not yet
        :meth:`mark_read`. In-flight work the book was never told about must be added by the
        caller before :meth:`PayloadStore.sweep_orphans`.
        """
        live = self.queue.live_versions()
        for g in self.book.groups.values():
            start = g.policy_version_at_start
            live.add(start)
            live.update(sample_version(m, start, "oldest_token") for m in g.arrived)
            live.update(v for m in g.arrived for v in m.policy_versions)
        return live

    def mark_read(self, step: int) -> None:
        """The trainer has read batch ``step``: its payload files no longer need protecting."""
        self.queue.mark_read(step)

    # -- accounting -----------------------------------------------------------------------------

    def _is_stale(self, version: PolicyVersion) -> bool:
        return self.queue.is_stale(version)

    def member_is_stale(self, sample: Sample, start: PolicyVersion) -> bool:
        """Whether this sink would drop ``sample``, a member (finished or still to generate) of
        a group started at ``start``, as stale for the batch being collected now. Scoring and
        restore judge members with the same function (``member_is_stale`` of the scoring
        module), and the orchestrator's early expiry of running groups asks this, so the two
        never disagree (e.g. on the members a resumed group regenerates)."""
        return member_is_stale(sample, start, self.config.staleness, self._is_stale)

    # -- ingest ---------------------------------------------------------------------------------

    def open_group(
        self, group_id: str, prompt: Prompt, group_size: int, policy_version_at_start: int = 0
    ) -> None:
        """Register a group whose members will arrive one by one (it is a live payload holder)."""
        self.book.open(group_id, prompt, group_size, policy_version_at_start)

    def add_member(self, group_id: str, sample: Sample) -> None:
        """One member of an open group arrived (in any status); the group finalizes when full."""
        if self.book.member(group_id, sample).complete:
            self._finalize(group_id)

    def add_group(
        self, group: Group, *, sequences: Mapping[int, SequenceLists] | None = None
    ) -> None:
        """A finished group. If the group is open (e.g. resumed), members it already holds (same
        sample index) are recognised and not counted twice. The group finalizes now.

        ``sequences`` (from :func:`build_sequences`, keyed by sample index) supplies training
        lists already built off the loop; see :meth:`ingest_group`.
        """
        self.book.admit(group)
        self._finalize(group.group_id, sequences)

    async def ingest_group(
        self, group: Group, *, limiter: trio.CapacityLimiter | None = None
    ) -> None:
        """:meth:`add_group`, with the costly training lists built in a worker thread first.

        The samples must not change while this runs (a finished group the rollout layer has
        handed over). The thread's work is bounded and shielded from cancellation, so the group
        is always added: a cancellation lands at the caller's next checkpoint, never between
        taking a group and adding it.
        """
        with trio.CancelScope(shield=True):
            sequences = await trio.to_thread.run_sync(build_sequences, group, limiter=limiter)
        self.add_group(group, sequences=sequences)

    def record_failed(self, n: int, group_id: str | None = None) -> None:
        """``n`` dispatched samples failed without producing a sample (counts toward completion)."""
        self._record_lost("failed", n, group_id)

    def record_cancelled(self, n: int, group_id: str | None = None) -> None:
        """``n`` dispatched samples were cancelled (counts toward completion of ``group_id``)."""
        self._record_lost("cancelled", n, group_id)

    def _record_lost(
        self, outcome: Literal["failed", "cancelled"], n: int, gid: str | None
    ) -> None:
        g = self.book.lose(outcome, n, gid)
        if g is not None and g.complete:
            self._finalize(g.group_id)

    def _finalize(
        self, group_id: str, sequences: Mapping[int, SequenceLists] | None = None
    ) -> None:
        """Score a complete group exactly once with exactly its arrived members."""
        g = self.book.close(group_id)
        score = score_group(
            group_id,
            g.arrived,
            start=g.policy_version_at_start,
            aborted=g.aborted,
            is_stale=self._is_stale,
            config=self.config.scoring,
            rule=self.config.staleness,
            prune_before_queue=self.config.prune is PruneMode.BEFORE_QUEUE,
            arrival=self._next_arrival,
            sequences=sequences,
        )
        self._next_arrival = score.next_arrival
        self.book.settle_score(score)
        for ts in score.samples:
            self.queue.enqueue(ts)
        if score.samples:
            self.zero_output.admitted()
        else:  # stale (voided), filtered, pruned, failed or cancelled: nothing to train
            owed = len(g.arrived) + g.failed + g.cancelled
            self.zero_output.finished_empty(g.arrived, owed, len(g.prompt.tokens))

    # -- the queue (see SampleQueue) ---------------------------------------------------------

    def sweep_stale(self) -> int:
        """:meth:`SampleQueue.sweep_stale`."""
        return self.queue.sweep_stale()

    def ready(self) -> bool:
        """:meth:`SampleQueue.ready`."""
        return self.queue.ready()

    def detach_batch(self, *, force: bool = False) -> DetachedBatch:
        """:meth:`SampleQueue.detach_batch`."""
        return self.queue.detach_batch(force=force)

    def settle_batch(
        self, detached: DetachedBatch, pruned: PruneResult | None = None
    ) -> TrainBatch:
        """:meth:`SampleQueue.settle_batch`."""
        return self.queue.settle_batch(detached, pruned)

    def requeue_batch(self, detached: DetachedBatch, pruned: PruneResult | None = None) -> None:
        """:meth:`SampleQueue.requeue_batch`."""
        self.queue.requeue_batch(detached, pruned)

    def cut(
        self, *, force: bool = False, limiter: trio.CapacityLimiter | None = None
    ) -> AbstractAsyncContextManager[Cut]:
        """:meth:`SampleQueue.cut`, the one implementation of the cut (cancellation: see there;
        an unsettled cut goes back to the queue)."""
        return self.queue.cut(force=force, limiter=limiter)

    async def take_batch(
        self, *, limiter: trio.CapacityLimiter | None = None, force: bool = False
    ) -> TrainBatch:
        """:meth:`SampleQueue.take_batch`: cut and settle at once. Cancelled before the cut,
        nothing changes; during pruning, the survivors go back to the queue."""
        return await self.queue.take_batch(limiter=limiter, force=force)

    def discard_queued(self) -> int:
        """:meth:`SampleQueue.discard_queued`."""
        return self.queue.discard_queued()

    # -- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> SinkState:
        """An owned snapshot, taken on the loop (see :func:`snapshot_sink`): the tally, the queue
        (a cut is saved as queued), open groups and the rollout layer's work in flight."""
        return snapshot_sink(self)

    def load_state_dict(
        self, state: SinkState, *, missing_files: Collection[str] = ()
    ) -> RestoreReport:
        """Replace the sink's state with a checkpoint's (see :func:`restore_sink`); a state that
        breaks the sink's invariants raises :class:`TrainSinkError` and changes nothing."""
        return restore_sink(self, state, missing_files=missing_files)


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
        counters=sink._tally.counters,
        window=sink._tally.window.copy(),
        queued=sink.queue.saved(),
        open_groups=tuple(copy_open_group(g) for g in sink.book.groups.values()),
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
        counters=sink._tally.counters,
        window=sink._tally.window.copy(),
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

    A state that breaks the sink's invariants (see
    :func:`~trio_rl.sink._sink_state.state_problem`) raises :class:`TrainSinkError` naming the
    field, and the sink is left unchanged.

    ``track`` (an incremental checkpoint manager) starts the sink's change log at ``state`` as
    saved: what the restore changes in it (dropped work, groups scored now) is logged, so the
    next checkpoint is a delta after the one restored from.
    """
    check_restorable(state)
    return finish_restore(restoring(sink, state, missing_files=missing_files, track=track))


#: Records a restore handles between two yields of :func:`restoring`.
RESTORE_BATCH = 512


def _advance(steps: Generator[None, None, RestoreReport]) -> RestoreReport | None:
    """One batch of a restore: None while records are left, the report once it is done."""
    try:
        next(steps)
    except StopIteration as done:
        report: RestoreReport = done.value
        return report
    return None


def finish_restore(steps: Generator[None, None, RestoreReport]) -> RestoreReport:
    """Run a restore (:func:`restoring`) to its end at once."""
    while (report := _advance(steps)) is None:
        pass
    return report


async def finish_restore_async(steps: Generator[None, None, RestoreReport]) -> RestoreReport:
    """Run a restore (:func:`restoring`) to its end with a checkpoint every ``RESTORE_BATCH``
    records: a cancellation gets in whatever the restore holds (the sink then holds part of the
    state: discard it)."""
    while (report := _advance(steps)) is None:
        await trio.lowlevel.checkpoint()
    return report


def restoring(
    sink: TrainSink,
    state: SinkState,
    *,
    missing_files: Collection[str] = (),
    track: object = None,
) -> Generator[None, None, RestoreReport]:
    """:func:`restore_sink` without the invariant check (the caller ran
    :func:`~trio_rl.sink._sink_state.check_restorable`), as a generator that yields every
    ``RESTORE_BATCH`` records and returns the report: an async caller checkpoints at each
    yield, so a restore of any size lets a cancellation in. Stopped part-way, the sink holds
    part of ``state``: discard it."""
    sink.queue.reset(state.step)
    sink._next_arrival = state.next_arrival
    sink._tally.counters = state.counters
    sink._tally.window = state.window.copy()
    book = sink.book
    book.groups.clear()
    changes = book.changes
    changes.invalidate()
    if track is not None:
        changes.start(track)
        changes.active = False  # the bulk restore below is ``state`` itself: not a change
    drops = RestoreDrops(set(missing_files), sink.queue.is_stale, sink.config.staleness)
    dropped: list[int] = []
    for i, ts in enumerate(state.queued):
        if i % RESTORE_BATCH == RESTORE_BATCH - 1:
            yield
        if drops.drops_queued(ts):
            dropped.append(ts.arrival)
        else:
            sink.queue.enqueue(ts)
            sink._next_arrival = max(sink._next_arrival, ts.arrival + 1)
    if track is not None:
        changes.active = True  # from here on, what the restore changes in ``state`` is logged
        for a in dropped:
            changes.remove(a)
    resumed: list[OpenGroup] = []
    completed: list[str] = []
    for i, og in enumerate(state.open_groups):
        if i % RESTORE_BATCH == RESTORE_BATCH - 1:
            yield
        start = og.policy_version_at_start
        fresh = [copy_sample(m) for m in og.arrived if not drops.drops_member(m, start)]
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
    drops.settle(sink._tally)
    return RestoreReport(
        resumed=resumed,
        completed_groups=completed,
        queued=len(sink.queue),
        dropped_queued_missing=drops.queued_missing,
        dropped_queued_stale=drops.queued_stale,
        dropped_members_missing=drops.members_missing,
        dropped_members_stale=drops.members_stale,
    )
