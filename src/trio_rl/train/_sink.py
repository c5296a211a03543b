"""The train sink: finished groups in, training batches out, every sample accounted for.

All methods except :meth:`TrainSink.take_batch` are synchronous and meant to run on the event
loop; they never block. Post-selection pruning runs in a worker thread on samples the sink has
already detached.
"""

from __future__ import annotations

import copy
import enum
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Literal

import attrs
import trio

from ..samples import Group, PolicyVersion, Prompt, ResumedGroup, Sample, SampleStatus
from ._errors import TrainSinkError
from ._scoring import (
    PAYLOAD_METADATA_KEY,
    PruneResult,
    ScoringConfig,
    SequenceLists,
    build_sequences,
    grpo_advantages,
    prune_detached,
    prune_zero_advantages,
    sample_version,
    to_training_sample,
    validate_sample,
)
from ._types import TrainingSample

__all__ = [
    "Cut",
    "DetachedBatch",
    "OpenGroupState",
    "PruneMode",
    "RestoreReport",
    "SinkConfig",
    "SinkCounters",
    "SinkState",
    "SinkWindow",
    "TrainBatch",
    "TrainSink",
    "copy_sample",
]

logger = logging.getLogger("trio_rl.train")


class PruneMode(enum.Enum):
    """When zero-advantage pruning runs.

    ``BEFORE_QUEUE``: per group, before queueing; the queue holds only samples that train, so
    every batch has exactly ``batch_size`` samples. ``AFTER_SELECTION``: on the cut, in a worker
    thread, so a batch may shrink (or come out empty, which does not advance the step).
    """

    BEFORE_QUEUE = "before_queue"
    AFTER_SELECTION = "after_selection"


def _positive_or_none(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"SinkConfig.{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class SinkConfig:
    """Exactly one of ``batch_size`` (samples) or ``token_batch_size`` (tokens) must be set.

    ``max_off_policy_steps=None`` disables the staleness filter.
    """

    batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    token_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    max_off_policy_steps: int | None = 8
    prune: PruneMode = PruneMode.BEFORE_QUEUE
    scoring: ScoringConfig = attrs.field(factory=ScoringConfig)

    def __attrs_post_init__(self) -> None:
        if (self.batch_size is None) == (self.token_batch_size is None):
            raise ValueError("SinkConfig needs exactly one of batch_size or token_batch_size")
        if self.max_off_policy_steps is not None and self.max_off_policy_steps < 0:
            raise ValueError(
                f"SinkConfig.max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}"
            )


_Outcome = Literal["shipped", "pruned", "stale", "filtered", "failed", "cancelled"]


@attrs.frozen
class SinkCounters:
    """Cumulative accounting since the start of the run (restored from checkpoints).

    Invariant: ``dispatched == shipped + pruned + stale + filtered + failed + cancelled + held``
    where ``held`` is what the sink still holds (queued samples, arrived members of open groups,
    samples of a cut being settled).
    """

    dispatched: int = 0
    shipped: int = 0
    pruned: int = 0
    stale: int = 0
    filtered: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def settled(self) -> int:
        terminal = (self.shipped, self.pruned, self.stale, self.filtered, self.failed)
        return sum(terminal) + self.cancelled


@attrs.frozen
class SinkWindow:
    """Metrics of the window since the previous non-empty batch (read and reset by the cut).

    ``attempts`` is the attempt budget of every group finalized in the window: every member that
    arrived (stale ones included) plus failed and cancelled ones.
    """

    attempts: int = 0
    groups: int = 0
    shipped: int = 0
    shipped_tokens: int = 0
    pruned: int = 0
    stale: int = 0
    filtered: int = 0
    failed: int = 0
    cancelled: int = 0
    reward_sum: float = 0.0
    reward_count: int = 0

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.reward_count if self.reward_count else None


@attrs.frozen
class TrainBatch:
    """A cut: samples detached from the sink (owned by the caller now).

    ``step`` is the batch's step. An empty batch (everything pruned) has ``window=None``: the
    step did not advance and the window stays in the sink for the next batch.
    """

    samples: list[TrainingSample]
    step: int
    window: SinkWindow | None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


@attrs.define(slots=True, eq=False)
class DetachedBatch:
    """Samples detached by :meth:`TrainSink.detach_batch`, to be settled exactly once."""

    samples: list[TrainingSample]
    step: int
    settled: bool = False


@attrs.define(slots=True, eq=False)
class Cut:
    """A batch being cut (see :meth:`TrainSink.cut`): detached from the queue and, in
    ``AFTER_SELECTION`` mode, pruned. ``samples`` are what would ship. :meth:`settle` books it;
    leaving the ``cut`` block any other way puts it back."""

    sink: TrainSink
    detached: DetachedBatch
    pruned: PruneResult | None
    #: Seconds the post-selection pruning took in its worker (0 without pruning).
    prune_seconds: float = 0.0

    @property
    def step(self) -> int:
        return self.detached.step

    @property
    def samples(self) -> list[TrainingSample]:
        return self.detached.samples if self.pruned is None else self.pruned.kept

    @property
    def settled(self) -> bool:
        return self.detached.settled

    def settle(self) -> TrainBatch:
        """Book the cut (on the loop): see :meth:`TrainSink.settle_batch`."""
        return self.sink.settle_batch(self.detached, self.pruned)


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
class _OpenGroup:
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


def copy_sample(s: Sample) -> Sample:
    """An owned copy of a finished sample: its lists, metadata and payload segments are new
    objects (for a checkpoint snapshot taken on the loop and written in a worker)."""
    meta = dict(s.metadata)
    payload = meta.get(PAYLOAD_METADATA_KEY)
    if isinstance(payload, list):
        meta[PAYLOAD_METADATA_KEY] = [copy.copy(seg) for seg in payload]
    return attrs.evolve(
        s,
        completion_tokens=list(s.completion_tokens),
        logprobs=list(s.logprobs),
        loss_mask=list(s.loss_mask),
        policy_versions=list(s.policy_versions),
        metadata=meta,
    )


def _sample_files(s: Sample) -> set[str]:
    payload = s.metadata.get(PAYLOAD_METADATA_KEY)
    return {seg.file for seg in payload} if isinstance(payload, list) else set()


class TrainSink:
    """Scores finished groups, queues training samples and cuts batches.

    Groups arrive whole (:meth:`add_group`) or member by member (:meth:`open_group` then
    :meth:`add_member`); failures and cancellations that produced no sample are booked with
    :meth:`record_failed` / :meth:`record_cancelled`. ``step`` is the batch being collected
    (1-based); batch ``S`` trains on policy ``S - 1``, and a sample generated at version ``v`` is
    stale for it when ``v < (S - 1) - max_off_policy_steps``.
    """

    def __init__(self, config: SinkConfig, *, step: int = 1) -> None:
        self.config = config
        self._step = step
        self._next_arrival = 0
        self._queue: dict[int, TrainingSample] = {}
        self._queued_tokens = 0
        self._open: dict[str, _OpenGroup] = {}
        self._in_cut: dict[int, TrainingSample] = {}
        self._unread: dict[int, PolicyVersion] = {}
        self._swept_step: int | None = None
        self._counters = SinkCounters()
        self._window = SinkWindow()
        self._in_flight: Callable[[], Iterable[ResumedGroup]] | None = None

    # -- inspection -----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @property
    def counters(self) -> SinkCounters:
        return self._counters

    @property
    def window(self) -> SinkWindow:
        """The metrics window accumulated since the last non-empty batch (not reset by reading)."""
        return self._window

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def held(self) -> int:
        """Samples the sink holds: queued, arrived members of open groups, and in a cut."""
        return (
            len(self._queue) + sum(len(g.members) for g in self._open.values()) + len(self._in_cut)
        )

    def track_in_flight(self, open_groups: Callable[[], Iterable[ResumedGroup]] | None) -> None:
        """Make the sink the one record of work in flight: ``open_groups()`` (e.g. the async
        driver's :meth:`~trio_rl.rollout.AsyncRolloutDriver.open_groups`) lists the groups the
        rollout layer holds (running, queued, buffered) with their arrived members.

        From then on :meth:`state_dict` saves them as open groups (a group the sink already
        holds open gains the members it has not seen), their new members counted as
        dispatched, so ``dispatched == settled + held`` holds in every snapshot; and
        :meth:`live_payload_versions` protects their payloads. ``None`` stops tracking.
        """
        self._in_flight = open_groups

    def discard(self, group: Group, reason: str) -> None:
        """Book a finished group the rollout layer gave up on, so every sample settles once
        (the async driver's ``on_discard`` hook). ``"aborted"``: added like any group (aborted
        members booked cancelled, the rest filtered); ``"failed"``: its missing members are
        booked failed, and a group the sink holds open (a resumed one) is scored with what it
        has; any other reason (``"filtered"``, ``"stale"``): its missing members are booked
        cancelled."""
        gid = group.group_id if group.group_id in self._open else None
        lost = group.size - self.arrived(group.group_id)
        if reason == "aborted":
            self.add_group(group)
        elif reason == "failed":
            self.record_failed(lost, gid)
        else:
            self.record_cancelled(lost, gid)

    def open_group_ids(self) -> list[str]:
        return list(self._open)

    def arrived(self, group_id: str) -> int:
        """How many members of open group ``group_id`` arrived so far (0 if it is not open)."""
        g = self._open.get(group_id)
        return 0 if g is None else len(g.seen)

    def queued_samples(self) -> list[TrainingSample]:
        """The queue in arrival order (the objects themselves: do not mutate)."""
        return list(self._queue.values())

    def live_payload_versions(self) -> set[PolicyVersion]:
        """Versions whose payload directories a holder the sink knows of may still read.

        Queued samples (restored ones included), arrived members and start versions of open groups
        (in-flight and resumed), samples in a cut, and batches shipped but not yet
        :meth:`mark_read`. In-flight work the sink was never told about must be added by the
        caller before :meth:`PayloadStore.sweep_orphans`.
        """
        live = {s.policy_version for s in self._queue.values()}
        live.update(s.policy_version for s in self._in_cut.values())
        for g in self._open.values():
            live.add(g.start)
            live.update(sample_version(m, g.start) for m in g.members)
        live.update(self._unread.values())
        for group in self._in_flight() if self._in_flight is not None else ():
            # its start version bounds the versions its requests wrote under
            live.add(group.policy_version_at_start)
            live.update(v for m in group.arrived for v in m.policy_versions)
        return live

    def mark_read(self, step: int) -> None:
        """The trainer has read batch ``step``: its payload files no longer need protecting."""
        self._unread.pop(step, None)

    # -- accounting -----------------------------------------------------------------------------

    def _book(self, outcome: _Outcome, n: int) -> None:
        if n:
            c = self._counters
            self._counters = attrs.evolve(c, **{outcome: getattr(c, outcome) + n})
            w = self._window
            self._window = attrs.evolve(w, **{outcome: getattr(w, outcome) + n})

    def _dispatched(self, n: int) -> None:
        self._counters = attrs.evolve(self._counters, dispatched=self._counters.dispatched + n)

    def _min_fresh(self) -> int | None:
        m = self.config.max_off_policy_steps
        if m is None:
            return None
        floor = (self._step - 1) - m
        return floor if floor > 0 else None

    def _is_stale(self, version: PolicyVersion) -> bool:
        floor = self._min_fresh()
        return floor is not None and version < floor

    # -- ingest ---------------------------------------------------------------------------------

    def open_group(
        self, group_id: str, prompt: Prompt, group_size: int, policy_version_at_start: int = 0
    ) -> None:
        """Register a group whose members will arrive one by one (it is a live payload holder)."""
        if group_id in self._open:
            raise TrainSinkError(f"group {group_id}: already open")
        if group_size < 1:
            raise TrainSinkError(f"group {group_id}: group_size must be >= 1, got {group_size}")
        self._open[group_id] = _OpenGroup(group_id, prompt, group_size, policy_version_at_start)

    def add_member(self, group_id: str, sample: Sample) -> None:
        """One member of an open group arrived (in any status); the group finalizes when full."""
        g = self._open.get(group_id)
        if g is None:
            raise TrainSinkError(f"group {group_id}: member {sample.index} for a group not open")
        self._check_new(g, [sample])
        self._arrive(g, [sample])
        if g.complete:
            self._finalize(group_id)

    def _arrive(self, g: _OpenGroup, samples: list[Sample]) -> None:
        # failed and aborted members are booked at once; only finished ones are held
        self._dispatched(len(samples))
        for s in samples:
            g.seen.add(s.index)
            if s.status is SampleStatus.FAILED:
                g.failed += 1
                self._book("failed", 1)
            elif s.status is SampleStatus.ABORTED:
                g.cancelled += 1
                g.aborted = True
                self._book("cancelled", 1)
            else:
                g.members.append(s)

    def add_group(
        self, group: Group, *, sequences: Mapping[int, SequenceLists] | None = None
    ) -> None:
        """A finished group. If the group is open (e.g. resumed), members it already holds (same
        sample index) are recognised and not counted twice. The group finalizes now.

        ``sequences`` (from :func:`build_sequences`, keyed by sample index) supplies training
        lists already built off the loop; see :meth:`ingest_group`.
        """
        g = self._open.get(group.group_id)
        held = g.seen if g is not None else set()
        new = [s for s in group.samples if s.index not in held]
        if g is not None and held:
            # A resumed group's group reward ran over the whole group, restored members
            # included: the rollout layer's reward is the one to score with.
            rewards = {s.index: s.reward for s in group.samples if s.index in held}
            for m in g.members:
                reward = rewards.get(m.index)
                if reward is not None:
                    m.reward = reward
        where = f"group {group.group_id}"
        if len({s.index for s in new}) != len(new):
            raise TrainSinkError(f"{where}: duplicate sample indices")
        for s in new:
            if s.status is SampleStatus.PENDING:
                raise TrainSinkError(f"{where}, sample {s.index}: still pending")
            validate_sample(s, where)
        if g is None:
            self.open_group(
                group.group_id, group.prompt, max(1, group.size), group.policy_version_at_start
            )
            g = self._open[group.group_id]
        self._arrive(g, new)
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

    def _check_new(self, g: _OpenGroup, samples: list[Sample]) -> None:
        held = g.seen
        for s in samples:
            where = f"group {g.group_id}"
            if s.index in held:
                raise TrainSinkError(f"{where}, sample {s.index}: arrived twice")
            if s.status is SampleStatus.PENDING:
                raise TrainSinkError(f"{where}, sample {s.index}: still pending")
            validate_sample(s, where)

    def record_failed(self, n: int, group_id: str | None = None) -> None:
        """``n`` dispatched samples failed without producing a sample (counts toward completion)."""
        self._record_lost("failed", n, group_id)

    def record_cancelled(self, n: int, group_id: str | None = None) -> None:
        """``n`` dispatched samples were cancelled (counts toward completion of ``group_id``)."""
        self._record_lost("cancelled", n, group_id)

    def _record_lost(
        self, outcome: Literal["failed", "cancelled"], n: int, gid: str | None
    ) -> None:
        if n < 0:
            raise TrainSinkError(f"record_{outcome}: n must be >= 0, got {n}")
        g = self._open.get(gid) if gid is not None else None
        if gid is not None and g is None:
            raise TrainSinkError(f"record_{outcome}: group {gid} is not open")
        self._dispatched(n)
        self._book(outcome, n)
        if g is not None:
            setattr(g, outcome, getattr(g, outcome) + n)
            if g.complete:
                self._finalize(g.group_id)

    def _finalize(
        self, group_id: str, sequences: Mapping[int, SequenceLists] | None = None
    ) -> None:
        """Score a complete group exactly once with exactly its arrived members."""
        g = self._open.pop(group_id)
        w = self._window
        # the attempt budget counts every member that arrived, stale ones included (defect 2)
        n_owed = len(g.members) + g.failed + g.cancelled
        self._window = attrs.evolve(w, attempts=w.attempts + n_owed, groups=w.groups + 1)
        finished = g.members
        if g.aborted:
            # a group holding an aborted member is rejected as a whole
            self._book("filtered", len(finished))
            return
        fresh = [s for s in finished if not self._is_stale(sample_version(s, g.start))]
        self._book("stale", len(finished) - len(fresh))
        if not fresh:
            return
        rewards = [float(s.reward or 0.0) for s in fresh]
        w = self._window
        self._window = attrs.evolve(
            w, reward_sum=w.reward_sum + sum(rewards), reward_count=w.reward_count + len(rewards)
        )
        sc = self.config.scoring
        advs = grpo_advantages(rewards, normalize_std=sc.normalize_std, eps=sc.eps)
        for s, a in zip(fresh, advs, strict=True):
            if not any(s.loss_mask):
                self._book("filtered", 1)
                continue
            ts = to_training_sample(
                s,
                a,
                temperature=sc.temperature_for(s.env_name),
                group_id=group_id,
                version=sample_version(s, g.start),
                arrival=self._next_arrival,
                sequence=None if sequences is None else sequences.get(s.index),
            )
            self._next_arrival += 1
            if self.config.prune is PruneMode.BEFORE_QUEUE and not prune_zero_advantages(ts):
                self._book("pruned", 1)
                continue
            self._enqueue(ts)

    def _enqueue(self, ts: TrainingSample) -> None:
        self._queue[ts.arrival] = ts
        self._queued_tokens += ts.num_tokens

    # -- staleness, readiness, cut --------------------------------------------------------------

    def sweep_stale(self) -> int:
        """Drop queued samples stale for the current step; returns how many were dropped."""
        floor = self._min_fresh()
        self._swept_step = self._step
        if floor is None:
            return 0
        stale = [k for k, s in self._queue.items() if s.policy_version < floor]
        for k in stale:
            self._queued_tokens -= self._queue.pop(k).num_tokens
        self._book("stale", len(stale))
        if stale:
            logger.warning(
                "dropped %d queued samples past max_off_policy_steps=%s (step %d)",
                len(stale),
                self.config.max_off_policy_steps,
                self._step,
            )
        return len(stale)

    def ready(self) -> bool:
        """Whether a batch can be cut; sweeps stale work first (at most once per step)."""
        if self._swept_step != self._step:
            self.sweep_stale()
        if self.config.batch_size is not None:
            return len(self._queue) >= self.config.batch_size
        assert self.config.token_batch_size is not None
        return self._queued_tokens >= self.config.token_batch_size

    def detach_batch(self, *, force: bool = False) -> DetachedBatch:
        """Select and detach the next batch on the loop: oldest policy version first, stable on
        arrival order; ``batch_size`` samples, or samples until ``token_batch_size`` tokens (the
        crossing sample included). ``force`` cuts what there is when not ready (draining).
        """
        if not self.ready() and not force:
            raise TrainSinkError(
                f"take_batch: not ready ({len(self._queue)} samples, {self._queued_tokens} tokens)"
            )
        order = sorted(self._queue.values(), key=lambda s: (s.policy_version, s.arrival))
        if self.config.batch_size is not None:
            chosen = order[: self.config.batch_size]
        else:
            assert self.config.token_batch_size is not None
            chosen, running = [], 0
            for s in order:
                if running >= self.config.token_batch_size:
                    break
                chosen.append(s)
                running += s.num_tokens
        for s in chosen:
            del self._queue[s.arrival]
            self._queued_tokens -= s.num_tokens
            self._in_cut[s.arrival] = s
        return DetachedBatch(samples=chosen, step=self._step)

    def settle_batch(
        self, detached: DetachedBatch, pruned: PruneResult | None = None
    ) -> TrainBatch:
        """Finish a cut on the loop: book pruned and shipped samples; a non-empty batch takes the
        window and advances the step, an empty one leaves both as they are.
        """
        if detached.settled:
            raise TrainSinkError(f"batch for step {detached.step} settled twice")
        if detached.step != self._step:
            raise TrainSinkError(f"batch for step {detached.step} settled at step {self._step}")
        detached.settled = True
        for s in detached.samples:
            self._in_cut.pop(s.arrival, None)
        kept = pruned.kept if pruned is not None else detached.samples
        self._book("pruned", len(pruned.pruned) if pruned is not None else 0)
        if not kept:
            logger.warning("skipping empty train batch at step %d (all pruned)", self._step)
            return TrainBatch(samples=[], step=self._step, window=None)
        self._book("shipped", len(kept))
        w = self._window
        window = attrs.evolve(w, shipped_tokens=w.shipped_tokens + sum(s.num_tokens for s in kept))
        self._window = SinkWindow()
        batch = TrainBatch(samples=kept, step=self._step, window=window)
        self._unread[self._step] = min(s.policy_version for s in kept)
        self._step += 1
        return batch

    def requeue_batch(self, detached: DetachedBatch, pruned: PruneResult | None = None) -> None:
        """Undo a cut that was not shipped (cancelled or failed publication).

        The samples (``pruned.kept`` if pruning ran) go back into the queue in arrival order;
        ``pruned.pruned`` are booked as pruned. Window and step are untouched.
        """
        if detached.settled:
            raise TrainSinkError(f"batch for step {detached.step} settled twice")
        detached.settled = True
        for s in detached.samples:
            self._in_cut.pop(s.arrival, None)
        back = detached.samples if pruned is None else pruned.kept
        self._book("pruned", 0 if pruned is None else len(pruned.pruned))
        for s in back:
            self._enqueue(s)
        self._queue = dict(sorted(self._queue.items()))

    @asynccontextmanager
    async def cut(
        self, *, force: bool = False, limiter: trio.CapacityLimiter | None = None
    ) -> AsyncIterator[Cut]:
        """The one way a batch is cut: detach it on the loop, prune it in a worker thread in
        ``AFTER_SELECTION`` mode, and yield the :class:`Cut`. The body ships ``cut.samples`` and
        calls ``cut.settle()`` once they are out (an empty cut is settled the same way: it
        books the pruned samples and advances nothing). Leaving the block by an exception or
        cancellation before ``settle`` requeues the cut (:meth:`requeue_batch`: pruned samples
        stay booked as pruned, the rest go back in arrival order) and re-raises; leaving it
        normally without settling requeues it too.

        Cancellation: before the cut nothing changes; during pruning the worker is waited for
        (shielded) and the cut is requeued as above. Nothing is lost or counted twice.
        """
        detached = self.detach_batch(force=force)
        pruned: PruneResult | None = None
        try:
            started = time.perf_counter()
            if self.config.prune is PruneMode.AFTER_SELECTION:
                with trio.CancelScope(shield=True):
                    pruned = await trio.to_thread.run_sync(
                        prune_detached, list(detached.samples), limiter=limiter
                    )
                await trio.lowlevel.checkpoint_if_cancelled()
            yield Cut(self, detached, pruned, time.perf_counter() - started)
        finally:
            if not detached.settled:
                self.requeue_batch(detached, pruned)

    async def take_batch(
        self, *, limiter: trio.CapacityLimiter | None = None, force: bool = False
    ) -> TrainBatch:
        """Cut the next batch and book it at once (:meth:`cut` with nothing to ship in
        between): for tests, tools and trainers that consume batches in-process.

        On cancellation before the cut nothing changes. A cancellation during pruning waits for
        the worker (shielded), puts the surviving samples back in the queue (the pruned ones are
        booked as pruned) and re-raises: nothing is lost or counted twice.
        """
        await trio.lowlevel.checkpoint()
        async with self.cut(force=force, limiter=limiter) as cut:
            return cut.settle()
        raise AssertionError("unreachable")  # pragma: no cover - the block always returns

    def discard_queued(self) -> int:
        """Shutdown: drop every queued sample, booked as cancelled. Returns how many."""
        n = len(self._queue)
        self._queue.clear()
        self._queued_tokens = 0
        self._book("cancelled", n)
        return n

    # -- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> SinkState:
        """An owned snapshot, taken on the loop.

        Containers are copied. Queued samples are shared, not copied: once queued, the library
        never mutates a training sample (post-selection pruning works on copies), so sharing them
        costs nothing and cannot tear. Callers must not mutate queued or shipped samples in place
        while a save of an earlier snapshot is still running. Members of open groups are copied
        with their lists. Samples in a cut are saved as queued. Groups in flight in the rollout
        layer (see :meth:`track_in_flight`) are saved as open groups.
        """
        queued: Iterable[TrainingSample] = self._queue.values()  # kept in arrival order
        if self._in_cut:
            queued = sorted([*queued, *self._in_cut.values()], key=lambda s: s.arrival)
        open_groups = {
            g.group_id: OpenGroupState(
                group_id=g.group_id,
                prompt=g.prompt,
                group_size=g.group_size,
                policy_version_at_start=g.start,
                members=tuple(copy_sample(m) for m in g.members),
            )
            for g in self._open.values()
        }
        # Work in flight (see track_in_flight): members the sink has not seen yet are saved as
        # arrived and count as dispatched; on restore the sink holds them, and they settle
        # exactly once like any other arrival.
        added = 0
        for group in self._in_flight() if self._in_flight is not None else ():
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
        counters = self._counters
        if added:
            counters = attrs.evolve(counters, dispatched=counters.dispatched + added)
        return SinkState(
            step=self._step,
            next_arrival=self._next_arrival,
            counters=counters,
            window=self._window,
            queued=tuple(queued),
            open_groups=tuple(open_groups.values()),
        )

    def load_state_dict(
        self, state: SinkState, *, missing_files: Collection[str] = ()
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
        self._step = state.step
        self._next_arrival = state.next_arrival
        self._counters = state.counters
        self._window = state.window
        self._queue, self._queued_tokens, self._open = {}, 0, {}
        self._in_cut, self._unread = {}, {}
        missing = set(missing_files)
        q_missing = q_stale = m_missing = m_stale = 0
        for ts in state.queued:
            if missing and any(seg.file in missing for seg in ts.payload or ()):
                q_missing += 1
            elif self._is_stale(ts.policy_version):
                q_stale += 1
            else:
                self._enqueue(ts)
                self._next_arrival = max(self._next_arrival, ts.arrival + 1)
        self._book("filtered", q_missing)
        self._book("stale", q_stale)
        resumed: list[ResumedGroup] = []
        completed: list[str] = []
        for og in state.open_groups:
            fresh: list[Sample] = []
            for m in og.members:
                if missing and _sample_files(m) & missing:
                    m_missing += 1
                elif self._is_stale(sample_version(m, og.policy_version_at_start)):
                    m_stale += 1
                else:
                    fresh.append(copy_sample(m))
            g = _OpenGroup(og.group_id, og.prompt, og.group_size, og.policy_version_at_start)
            g.members = fresh
            g.seen = {m.index for m in fresh}
            self._open[og.group_id] = g
            # A full group is scored now only when every member has its reward; otherwise its
            # group reward had not run at the checkpoint, and it goes back to the rollout layer,
            # which dispatches nothing for it and only runs the reward.
            if g.complete and (
                len(fresh) < og.group_size or all(m.reward is not None for m in fresh)
            ):
                completed.append(og.group_id)
                self._finalize(og.group_id)
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
        self._book("filtered", m_missing)
        self._book("stale", m_stale)
        self._swept_step = self._step
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
            queued=len(self._queue),
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
            files |= _sample_files(m)
    return files
