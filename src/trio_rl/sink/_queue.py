"""The sink's tally and its sample queue: ready, the cut (detach, prune, settle or requeue), and
staleness. The queue's methods are synchronous and run on the event loop, except :meth:`cut`
and :meth:`take_batch`, whose pruning runs in a worker thread on samples already detached.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Literal

import attrs
import trio

from .._validation import at_least
from ..errors import InvalidArgumentError
from ..samples import PolicyVersion
from ._changes import ChangeLog
from ._errors import TrainSinkError
from ._scoring import (
    DEFAULT_STALENESS,
    STALENESS_RULES,
    PruneResult,
    ScoringConfig,
    StalenessRule,
    prune_detached,
)
from ._types import TrainingSample

__all__ = [
    "Cut",
    "DetachedBatch",
    "PruneMode",
    "SampleQueue",
    "SinkTally",
    "SinkConfig",
    "SinkCounters",
    "SinkWindow",
    "TrainBatch",
]

logger = logging.getLogger("trio_rl.sink")


class PruneMode(enum.Enum):
    """When zero-advantage pruning runs.

    ``BEFORE_QUEUE``: per group, before queueing; the queue holds only samples that train, so
    every batch has exactly ``batch_size`` samples. ``AFTER_SELECTION``: on the cut, in a worker
    thread, so a batch may shrink (or come out empty, which does not advance the step).
    """

    BEFORE_QUEUE = "before_queue"
    AFTER_SELECTION = "after_selection"


@attrs.frozen(kw_only=True)
class SinkConfig:
    """Exactly one of ``batch_size`` (samples) or ``token_batch_size`` (tokens) must be set
    (keyword arguments only).

    ``max_off_policy_steps=None`` disables the staleness filter. ``staleness`` says which
    version a sample is judged by: ``"group_start"`` (default, prime-rl's rule) the version its
    group started with; ``"oldest_token"`` the oldest version behind any of its tokens (keeps
    the samples of a group that started old but was generated, or continued, under newer
    weights). Either way batch ``S`` drops a sample judged at ``v < (S - 1) -
    max_off_policy_steps``.

    Each knob's meaning is its field's ``metadata["help"]``: the ``[sink]`` section of the
    configuration files (``trio_rl.config``) is generated from these fields, so a knob added
    here is a key there, with ``--set sink.<key>=...``, and a line of the reference.
    """

    batch_size: int | None = attrs.field(
        default=None,
        validator=at_least(1),
        metadata={"help": "samples per batch (the commands: rollout.batch_groups x group_size)"},
    )
    token_batch_size: int | None = attrs.field(
        default=None, validator=at_least(1), metadata={"help": "tokens per batch"}
    )
    max_off_policy_steps: int | None = attrs.field(
        default=8,
        validator=at_least(0),
        metadata={"help": "drop samples more than this many versions behind (unset: keep all)"},
    )
    prune: PruneMode = attrs.field(
        default=PruneMode.BEFORE_QUEUE,
        metadata={
            "help": "when zero-advantage samples are pruned: before_queue (per group, every "
            "batch full) or after_selection (on the cut; a batch may shrink)"
        },
    )
    scoring: ScoringConfig = attrs.field(factory=ScoringConfig)
    staleness: StalenessRule = attrs.field(
        default=DEFAULT_STALENESS,
        metadata={
            "help": "the version a sample is judged stale by: `group_start` (its group's start "
            "version, prime-rl's rule) or `oldest_token` (the oldest version behind any of its "
            "tokens)"
        },
    )

    @staleness.validator
    def _check_staleness(self, _: attrs.Attribute[str], value: str) -> None:
        if value not in STALENESS_RULES:
            raise TrainSinkError(
                f"SinkConfig.staleness must be one of {list(STALENESS_RULES)}, got {value!r}"
            )

    def __attrs_post_init__(self) -> None:
        if (self.batch_size is None) == (self.token_batch_size is None):
            raise InvalidArgumentError(
                "SinkConfig needs exactly one of batch_size or token_batch_size"
            )


Outcome = Literal["shipped", "pruned", "stale", "filtered", "failed", "cancelled"]


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

    The value lists are the window's exact observations, for the publication's distributions
    (computed in a worker once the cut hands the window over): ``rewards`` of every scored
    sample (as ``reward_sum``), ``completion_lengths`` of every finished sample the sink settled
    from a scored group (stale and filtered ones included). ``zero_length`` counts the finished
    samples filtered for having no trained (completion) token; ``failure_types`` counts failed
    attempts' errors by exception type name (``"failed_status"``: a member that arrived FAILED,
    its error recorded on the sample). While the window is the sink's, counting appends to the
    lists in place; the cut hands them over and the sink starts new ones (`copy` for a snapshot).
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
    zero_length: int = 0
    rewards: list[float] = attrs.field(factory=list)
    completion_lengths: list[int] = attrs.field(factory=list)
    failure_types: dict[str, int] = attrs.field(factory=dict)

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.reward_count if self.reward_count else None

    def copy(self) -> SinkWindow:
        """An owned copy (its lists and counts new objects), for a snapshot taken on the loop."""
        return attrs.evolve(
            self,
            rewards=list(self.rewards),
            completion_lengths=list(self.completion_lengths),
            failure_types=dict(self.failure_types),
        )


@attrs.define(slots=True, eq=False)
class SinkTally:
    """The cumulative counters and the current metrics window, counted together: every sample
    the sink settles (see `Outcome`) and every one dispatched to it."""

    counters: SinkCounters = attrs.field(factory=SinkCounters)
    window: SinkWindow = attrs.field(factory=SinkWindow)

    def settle(self, outcome: Outcome, n: int) -> None:
        if n:
            c, w = self.counters, self.window
            self.counters = attrs.evolve(c, **{outcome: getattr(c, outcome) + n})
            self.window = attrs.evolve(w, **{outcome: getattr(w, outcome) + n})

    def dispatched(self, n: int) -> None:
        self.counters = attrs.evolve(self.counters, dispatched=self.counters.dispatched + n)


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
    """Samples detached by :meth:`SampleQueue.detach_batch`, to be settled exactly once."""

    samples: list[TrainingSample]
    step: int
    settled: bool = False


@attrs.define(slots=True, eq=False)
class Cut:
    """A batch being cut (see :meth:`SampleQueue.cut`): detached from the queue and, in
    ``AFTER_SELECTION`` mode, pruned. ``samples`` are what would ship. :meth:`settle` counts it;
    leaving the ``cut`` block any other way puts it back."""

    queue: SampleQueue
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
        """Settle the cut (on the loop): see :meth:`SampleQueue.settle_batch`."""
        return self.queue.settle_batch(self.detached, self.pruned)


class SampleQueue:
    """Training samples waiting for a batch, keyed by arrival, and the one cut.

    ``step`` is the batch being collected (1-based); batch ``S`` trains on policy ``S - 1``, and
    a sample generated at version ``v`` is stale for it when
    ``v < (S - 1) - max_off_policy_steps``. Outcomes are counted in the shared ``tally``.
    """

    def __init__(
        self,
        config: SinkConfig,
        tally: SinkTally,
        *,
        step: int = 1,
        changes: ChangeLog | None = None,
    ) -> None:
        self.config = config
        self.tally = tally
        #: What an incremental checkpoint saves that changed (see `ChangeLog`).
        self.changes = ChangeLog() if changes is None else changes
        self.step = step
        self._queue: dict[int, TrainingSample] = {}
        self._tokens = 0
        self._in_cut: dict[int, TrainingSample] = {}
        self._unread: dict[int, PolicyVersion] = {}
        self._swept_step: int | None = None

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def held(self) -> int:
        """Queued samples and samples of a cut being shipped."""
        return len(self._queue) + len(self._in_cut)

    def samples(self) -> list[TrainingSample]:
        """The queue in arrival order (the objects themselves: do not mutate)."""
        return list(self._queue.values())

    def saved(self) -> tuple[TrainingSample, ...]:
        """What a checkpoint saves as queued: the queue and any cut, in arrival order."""
        queued: Iterable[TrainingSample] = self._queue.values()
        if self._in_cut:
            queued = sorted([*queued, *self._in_cut.values()], key=lambda s: s.arrival)
        return tuple(queued)

    def live_versions(self) -> set[PolicyVersion]:
        """Versions of queued samples, samples in a cut and batches shipped but not read."""
        live = {s.policy_version for s in self._queue.values()}
        live.update(s.policy_version for s in self._in_cut.values())
        live.update(self._unread.values())
        return live

    def mark_read(self, step: int) -> None:
        """The trainer has read batch ``step``: its payload files no longer need protecting."""
        self._unread.pop(step, None)

    def reset(self, step: int) -> None:
        """Empty the queue and start at ``step`` (a restore; it counts as swept)."""
        self.step = step
        self._queue, self._tokens, self._in_cut, self._unread = {}, 0, {}, {}
        self._swept_step = step
        self.changes.invalidate()

    def enqueue(self, ts: TrainingSample) -> None:
        self._queue[ts.arrival] = ts
        self._tokens += ts.num_tokens
        changes = self.changes
        if changes.active:
            changes.queued[ts.arrival] = ts
            if len(changes.queued) & 0xFFF == 0:
                changes.check_bound(len(self._queue))

    def is_stale(self, version: PolicyVersion) -> bool:
        m = self.config.max_off_policy_steps
        floor = None if m is None else (self.step - 1) - m
        return floor is not None and floor > 0 and version < floor

    def sweep_stale(self) -> int:
        """Drop queued samples stale for the current step; returns how many were dropped."""
        self._swept_step = self.step
        stale = [k for k, s in self._queue.items() if self.is_stale(s.policy_version)]
        for k in stale:
            self._tokens -= self._queue.pop(k).num_tokens
            self.changes.remove(k)
        self.tally.settle("stale", len(stale))
        if stale:
            logger.warning(
                "dropped %d queued samples past max_off_policy_steps=%s (step %d)",
                len(stale),
                self.config.max_off_policy_steps,
                self.step,
            )
        return len(stale)

    def ready(self) -> bool:
        """Whether a batch can be cut; sweeps stale work first (at most once per step)."""
        if self._swept_step != self.step:
            self.sweep_stale()
        if self.config.batch_size is not None:
            return len(self._queue) >= self.config.batch_size
        assert self.config.token_batch_size is not None
        return self._tokens >= self.config.token_batch_size

    def detach_batch(self, *, force: bool = False) -> DetachedBatch:
        """Select and detach the next batch on the loop: oldest policy version first, stable on
        arrival order; ``batch_size`` samples, or samples until ``token_batch_size`` tokens (the
        crossing sample included). ``force`` cuts what there is when not ready (draining).
        """
        if not self.ready() and not force:
            raise TrainSinkError(
                f"take_batch: not ready ({len(self._queue)} samples, {self._tokens} tokens)"
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
            self._tokens -= s.num_tokens
            self._in_cut[s.arrival] = s
        return DetachedBatch(samples=chosen, step=self.step)

    def settle_batch(
        self, detached: DetachedBatch, pruned: PruneResult | None = None
    ) -> TrainBatch:
        """Finish a cut on the loop: count pruned and shipped samples; a non-empty batch takes the
        window and advances the step, an empty one leaves both as they are.
        """
        if detached.settled:
            raise TrainSinkError(f"batch for step {detached.step} settled twice")
        if detached.step != self.step:
            raise TrainSinkError(f"batch for step {detached.step} settled at step {self.step}")
        detached.settled = True
        for s in detached.samples:
            self._in_cut.pop(s.arrival, None)
            self.changes.remove(s.arrival)
        kept = pruned.kept if pruned is not None else detached.samples
        self.tally.settle("pruned", len(pruned.pruned) if pruned is not None else 0)
        if not kept:
            logger.warning("skipping empty train batch at step %d (all pruned)", self.step)
            return TrainBatch(samples=[], step=self.step, window=None)
        self.tally.settle("shipped", len(kept))
        w = self.tally.window
        window = attrs.evolve(w, shipped_tokens=w.shipped_tokens + sum(s.num_tokens for s in kept))
        self.tally.window = SinkWindow()
        batch = TrainBatch(samples=kept, step=self.step, window=window)
        self._unread[self.step] = min(s.policy_version for s in kept)
        self.step += 1
        return batch

    def requeue_batch(self, detached: DetachedBatch, pruned: PruneResult | None = None) -> None:
        """Undo a cut that was not shipped (cancelled or failed publication).

        The samples (``pruned.kept`` if pruning ran) go back into the queue in arrival order;
        ``pruned.pruned`` are counted as pruned. Window and step are untouched.
        """
        if detached.settled:
            raise TrainSinkError(f"batch for step {detached.step} settled twice")
        detached.settled = True
        for s in detached.samples:
            self._in_cut.pop(s.arrival, None)
            self.changes.remove(s.arrival)
        back = detached.samples if pruned is None else pruned.kept
        self.tally.settle("pruned", 0 if pruned is None else len(pruned.pruned))
        for s in back:
            self.enqueue(s)
        self._queue = dict(sorted(self._queue.items()))

    @asynccontextmanager
    async def cut(
        self, *, force: bool = False, limiter: trio.CapacityLimiter | None = None
    ) -> AsyncIterator[Cut]:
        """The one way a batch is cut: detach it on the loop, prune it in a worker thread in
        ``AFTER_SELECTION`` mode, and yield the :class:`Cut`. The body ships ``cut.samples`` and
        calls ``cut.settle()`` once they are out (an empty cut is settled the same way: it
        counts the pruned samples and advances nothing). Leaving the block by an exception or
        cancellation before ``settle`` requeues the cut (:meth:`requeue_batch`: pruned samples
        stay counted as pruned, the rest go back in arrival order) and re-raises; leaving it
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
        """Cut the next batch and settle it at once (:meth:`cut` with nothing to ship in
        between): for tests, tools and trainers that consume batches in-process.

        On cancellation before the cut nothing changes. A cancellation during pruning waits for
        the worker (shielded), puts the surviving samples back in the queue (the pruned ones are
        counted as pruned) and re-raises: nothing is lost or counted twice.
        """
        await trio.lowlevel.checkpoint()
        async with self.cut(force=force, limiter=limiter) as cut:
            return cut.settle()
        raise AssertionError("unreachable")  # pragma: no cover - the block always returns

    def discard_queued(self) -> int:
        """Shutdown: drop every queued sample, counted as cancelled. Returns how many."""
        n = len(self._queue)
        self._queue.clear()
        self._tokens = 0
        self.changes.invalidate()
        self.tally.settle("cancelled", n)
        return n
