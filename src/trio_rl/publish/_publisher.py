"""The publisher: finalizes train batches off the event loop and ships them.

What runs where (docs/publish.md, "What runs where"):

- on the event loop, never across an await: detaching the selected samples from the sink,
  the policy-wait snapshot, settling the batch with the sink (which counts the outcome, reads
  and resets its metrics window and advances the step), the counter snapshot and the
  checkpoint snapshot;
- in worker threads, through the pipeline's one `trio.CapacityLimiter` (passed down to the
  sender too): pruning after selection, packing, the metrics over the shipped cohort,
  MessagePack encoding (streamed rank by rank into a staging sender's files, see
  `_encoding`), the file writes, the outbox and checkpoint writes and the deferred memory
  release.

Nothing the loop still mutates is handed to a worker: the batch is detached first. The
publisher's jobs live in three parts: this module cuts and reports, `_encoding` holds a step's
encoded payloads, `_delivery` makes settled steps durable and gets them delivered exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, TypeAlias

import attrs
import trio

from ..sink import (
    Cut,
    PruneResult,
    SinkConfig,
    SinkCounters,
    SinkWindow,
    TrainingSample,
)
from ..transport import Payload, Sender
from ..wire import MicroBatch, encode
from ._delivery import Checkpointer, Delivery
from ._encoding import Encoded, Encoder, encode_step
from ._errors import MonitorTimeoutError, PublishError
from ._metrics import (
    Annotation,
    AttemptStats,
    CohortStats,
    ProgressTotals,
    SelectionStats,
    ShipRecord,
    ShipTimings,
    ThreadStats,
    attempt_stats,
    batch_stats,
    ship_warnings,
)
from ._policy_wait import PolicyWaits
from ._release import Container, DeferredRelease, ReleaseFn, release_containers
from ._workers import Workers

logger = logging.getLogger("trio_rl.publish")
# The batch-quality warnings (#3806's: little trainable, much discarded, zero-length outputs)
# have a logger of their own, so an application that shows them per step can quiet them alone.
quality_logger = logging.getLogger("trio_rl.publish.quality")

__all__ = ["BatchSource", "Monitor", "Packer", "Publisher", "Shipment", "open_publisher"]

#: Packs the shipped samples into one sequence of micro-batches per data-parallel rank (pure,
#: sync). `trio_rl.publish.pack_lazily` returns ranks that build each micro-batch as the encoder
#: reads it, which keeps the step's token data out of young Python lists (the GC walks those).
Packer: TypeAlias = Callable[[Sequence[TrainingSample]], Sequence[Sequence[MicroBatch]]]


class BatchSource(Protocol):
    """The train sink as the publisher uses it (`trio_rl.sink.TrainSink` is one).

    Every method is sync and is called on the event loop.
    """

    @property
    def config(self) -> SinkConfig: ...

    @property
    def step(self) -> int: ...

    @property
    def counters(self) -> SinkCounters: ...

    @property
    def queued(self) -> int: ...

    def ready(self) -> bool: ...

    def cut(
        self, *, force: bool = False, limiter: trio.CapacityLimiter | None = None
    ) -> AbstractAsyncContextManager[Cut]:
        """The sink's one cut (see `trio_rl.sink.TrainSink.cut`): detach, prune after
        selection in a worker, then settle, or requeue when the block is left unsettled."""


@attrs.frozen
class Shipment:
    """What a monitor receives per shipped batch: the record and its *own* list of the shipped
    samples (the publisher's lists are emptied by the deferred release; this one is not).

    The samples are freed where the last reference to them drops. A callback monitor that keeps
    nothing leaves that to the release worker. A channel consumer holds the only references
    once the release ran, and dropping a big step's shipment on the loop frees its token lists
    in one pause (tens of ms at 166 MiB): when done with it, empty the list in a worker instead,
    ``await trio.to_thread.run_sync(release_containers, [shipment.samples])``.
    """

    record: ShipRecord
    samples: list[TrainingSample]
    #: One per shipped sample, in order (`Annotation`).
    annotations: list[Annotation] = attrs.field(factory=list)


#: A sync callback (called on the loop; keep it short) or a channel (awaited with a deadline).
Monitor: TypeAlias = "Callable[[Shipment], None] | trio.MemorySendChannel[Shipment]"


def _check_grid(grid: Sequence[Sequence[MicroBatch]], world_size: int, step: int) -> None:
    if len(grid) != world_size:
        raise PublishError(
            f"step {step}: the packer returned {len(grid)} rank lists for a sender of "
            f"world size {world_size}"
        )
    lengths = {len(ranks) for ranks in grid}
    if len(lengths) > 1:
        raise PublishError(
            f"step {step}: ranks got different numbers of micro-batches {sorted(lengths)}; "
            "every rank must get the same number"
        )


@attrs.frozen
class _Settled:
    """A batch the sink settled as shipped, with everything its record and release need."""

    step: int
    started: float
    timings: dict[str, float]
    samples: list[TrainingSample]
    detached: list[TrainingSample]
    encoded: Encoded
    grid: Sequence[Sequence[MicroBatch]]
    pruned: PruneResult | None
    #: The window the sink handed over with the batch (its value lists are this batch's now);
    #: `_finish` summarizes it in a worker.
    window: SinkWindow
    effective: CohortStats
    selection: SelectionStats
    annotations: list[Annotation]
    counters: dict[str, Any]
    policy_wait: float
    step_time: float
    #: (ranks, micro-batches per rank, payload bytes), measured at settling: the deferred release
    #: empties the grid and the payloads before the record is built.
    shape: tuple[int, int, int] = attrs.field(
        default=attrs.Factory(
            lambda b: (len(b.grid), len(b.grid[0]) if b.grid else 0, b.encoded.nbytes),
            takes_self=True,
        )
    )

    def containers(self, *, pending: bool) -> list[Container]:
        """What the deferred release empties (a pending step's bytes are kept: re-sent)."""
        # Lists a packer built are emptied; a lazy rank (`PackedRank`) holds no token data.
        containers: list[Container] = [self.samples, self.detached]
        containers += [c for c in (*self.grid, self.grid) if isinstance(c, list)]
        if not pending:
            containers += self.encoded.containers()
        if self.pruned is not None:
            containers += [self.pruned.kept, self.pruned.pruned]
        return containers

    def record(self, threads: ThreadStats, all_stats: AttemptStats) -> ShipRecord:
        ranks, per_rank, nbytes = self.shape
        return ShipRecord(
            step=self.step,
            all=all_stats,
            effective=self.effective,
            counters=self.counters,
            policy_wait=self.policy_wait,
            step_time=self.step_time,
            ranks=ranks,
            micro_batches_per_rank=per_rank,
            payload_bytes=nbytes,
            timings=ShipTimings(total=time.perf_counter() - self.started, **self.timings),
            threads=threads,
            selection=self.selection,
            warnings=ship_warnings(
                self.step, self.selection, all_stats, (self.policy_wait, self.step_time)
            ),
        )


async def _window_stats(workers: Workers, settled: _Settled) -> AttemptStats:
    """The ``all`` side of a settled step's record. The window's distributions sort its value
    lists: a worker job, shielded (the step is settled, its record must follow); its time is
    added to the step's ``metrics`` timing."""
    mark = time.perf_counter()
    with trio.CancelScope(shield=True):
        stats = await workers.run(attempt_stats, settled.window)
    settled.timings["metrics"] = settled.timings.get("metrics", 0.0) + time.perf_counter() - mark
    return stats


def _log_warnings(record: ShipRecord) -> None:
    for warning in record.warnings:
        quality_logger.warning("%s", warning.message)


async def deliver_to_monitor(monitor: Monitor | None, shipment: Shipment, patience: float) -> None:
    """Hand ``shipment`` to a callback, or to a channel within ``patience`` seconds (else
    `MonitorTimeoutError`). Cancellation: a channel send that raises `trio.Cancelled` did not
    deliver the shipment."""
    if monitor is None:
        return
    if isinstance(monitor, trio.MemorySendChannel):
        with trio.move_on_after(patience) as scope:
            await monitor.send(shipment)
        if scope.cancelled_caught:
            raise MonitorTimeoutError(
                f"step {shipment.record.step}: the monitor channel did not accept the "
                f"record within {patience:g} s"
            )
    else:
        monitor(shipment)


async def _report(
    monitor: Monitor | None, record: ShipRecord, settled: _Settled, patience: float
) -> None:
    """Log the record's warnings and hand the monitor its own copy of the samples.

    Called before the step's release is scheduled, and the copy lives only in this frame (and
    the monitor), so the release's pops drop the last reference to each sample and free it in
    the worker. Dropped on the loop after the release, the copy freed a 166 MiB step's token
    lists in one ~80 ms pause.
    """
    _log_warnings(record)
    if monitor is not None:
        shipment = Shipment(record, list(settled.samples), settled.annotations)
        await deliver_to_monitor(monitor, shipment, patience)


@attrs.define(eq=False, kw_only=True)
class Publisher:
    """Ships the train sink's batches; create it with `open_publisher` (its keyword-only
    fields are that function's arguments, resolved). Publications are serialized (one batch
    at a time, in step order); `publish` may be called from any task of its lifetime."""

    _nursery: trio.Nursery
    sink: BatchSource
    _pack: Packer
    _encode: Encoder
    _workers: Workers
    _delivery: Delivery
    _monitor: Monitor | None
    _release: DeferredRelease
    monitor_timeout: float
    #: Tokens, samples and problems over every batch settled (restored on resume).
    progress: ProgressTotals = attrs.field(factory=ProgressTotals)
    _waits: PolicyWaits = attrs.field(factory=PolicyWaits, init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def step(self) -> int:
        """The step of the next batch (the sink's)."""
        return self.sink.step

    @property
    def sender(self) -> Sender:
        return self._delivery.sender

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """The pipeline's one limiter (the sender borrows from it too)."""
        return self._workers.limiter

    @property
    def send_timeout(self) -> float:
        return self._delivery.send_timeout

    @property
    def release(self) -> DeferredRelease:
        """The deferred memory release (counts of scheduled and completed releases)."""
        return self._release

    @property
    def closed(self) -> bool:
        return self._closed

    def add_policy_wait(self, seconds: float) -> None:
        """Account time spent waiting for the policy (the ship gate). Sync; call on the loop.

        The total is read and reset right after the threaded metrics of the next shipped batch
        return, so a wait that completes while that batch is being finalized is reported with it;
        the same snapshot warns when the wait was at least half the step (`WarningKind`).
        """
        self._waits.add(seconds)

    async def publish(self, *, force: bool = False) -> ShipRecord | None:
        """Cut the sink's next batch and ship it; return its record.

        Returns ``None`` without advancing the step when the sink has no batch ready (``force``
        cuts what there is, for draining), or when pruning after selection left nothing to train
        (the sink keeps its window for the next batch).

        Steps still pending (see `resend_pending`) are re-sent first.

        Without a checkpointer: on cancellation or error before the send completed, the batch
        goes back to the sink's queue (pruned samples stay settled as pruned), a step streamed
        into the sender's staging area is removed from it, and the step is unchanged; a worker
        job already running finishes first (workers are never abandoned; encoding stops at its
        next cancellation check). Once the send completed the batch is settled and the step
        advances.

        With a checkpointer, a step is *durable before it is visible*: once encoded, the batch is
        settled (the step advances), the snapshot is taken, and then, shielded, the payload bytes
        are written to the checkpointer's outbox (when it is an `Outbox`) and the checkpoint of
        the step is written; only then is the step sent, and on success its outbox is deleted.
        A send that fails or is cancelled after that does not requeue: the step stays pending,
        and is re-sent with identical bytes before the next step (or, by a resumed run, from the
        outbox file). So a trainer never sees a step change once visible. A cancellation before
        the batch was settled requeues it as above.
        """
        if self._closed:
            raise trio.ClosedResourceError("publish() called on a closed publisher")
        async with self._lock:
            if self._closed:
                raise trio.ClosedResourceError("publish() called on a closed publisher")
            await self._delivery.resend_pending()
            if not (self.sink.ready() or (force and self.sink.queued)):
                return None
            settled = await self._cut_and_settle(force)
            return None if settled is None else await self._deliver_settled(settled)

    async def _cut_and_settle(self, force: bool) -> _Settled | None:
        # Cut, pack, measure and encode in workers; settle with the sink (without a checkpointer,
        # only once the send completed). Leaving the cut before `settle` requeues the batch.
        started = time.perf_counter()
        timings: dict[str, float] = {}
        policy_wait = step_time = 0.0
        encoded: Encoded | None = None
        settled = False
        try:
            async with self.sink.cut(force=force, limiter=self.limiter) as cut:
                step, pruned = cut.step, cut.pruned
                if pruned is not None:
                    timings["prune"] = cut.prune_seconds
                    if not pruned.kept:
                        cut.settle()  # empty: no step, window carried over
                        return None
                samples = list(cut.samples)

                mark = time.perf_counter()
                grid = await self._workers.run(self._pack, samples)
                timings["pack"] = time.perf_counter() - mark
                _check_grid(grid, self.sender.world_size, step)

                mark = time.perf_counter()
                effective, selection, annotations = await self._workers.run(
                    batch_stats, samples, cut.detached.samples, step, time.time()
                )
                timings["metrics"] = time.perf_counter() - mark
                # Read-and-reset with no await since the worker returned: a wait that completed
                # while the metrics were computed is reported now, a later one next time.
                policy_wait, step_time = self._waits.snapshot()

                mark = time.perf_counter()
                encoded = await encode_step(self._workers, self._encode, self.sender, grid, step)
                if self._delivery.checkpointer is None:
                    await self._delivery.send(encoded)
                timings["send"] = time.perf_counter() - mark
                batch = cut.settle()
                self.progress.add_batch(samples)  # settled: before its snapshot
                settled = True
        except BaseException:
            if not settled:
                self._waits.give_back(policy_wait)  # not reported: kept for the next record
                if encoded is not None:
                    with trio.CancelScope(shield=True):
                        await self._workers.run(encoded.discard)
            raise
        # Settled. The window the sink read and reset is summarized in a worker by `_finish`.
        return _Settled(
            step=step,
            started=started,
            timings=timings,
            samples=samples,
            detached=cut.detached.samples,
            encoded=encoded,
            grid=grid,
            pruned=pruned,
            window=batch.window if batch.window is not None else SinkWindow(),
            effective=effective,
            selection=selection,
            annotations=annotations,
            counters=attrs.asdict(self.sink.counters),
            policy_wait=policy_wait,
            step_time=step_time,
        )

    async def _deliver_settled(self, settled: _Settled) -> ShipRecord:
        checkpointer = self._delivery.checkpointer
        if checkpointer is None:
            settled.timings["checkpoint"] = 0.0
            return await self._finish(settled)
        # Durable before visible: the outbox (this step's exact bytes) and the checkpoint that
        # covers this step are on disk before any rank can see the step, so a resumed run
        # re-sends these bytes instead of regenerating the step. Shielded: a cancellation
        # arriving now must not leave a settled step without its checkpoint.
        snapshot = checkpointer.snapshot(settled.step)
        mark = time.perf_counter()
        with trio.CancelScope(shield=True):
            await self._workers.run(self._delivery.make_durable, snapshot, settled.encoded)
        settled.timings["checkpoint"] = time.perf_counter() - mark
        del snapshot
        mark = time.perf_counter()
        # A failure or cancellation here does not requeue (the sink says shipped): the step
        # stays pending and is re-sent, identical, before the next step. The monitor follows
        # the sink's tally, so it sees the step either way (shielded when the send failed).
        try:
            await self._delivery.send_durable(settled.encoded)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._finish(settled)
            raise
        settled.timings["send"] += time.perf_counter() - mark
        return await self._finish(settled)

    async def _finish(self, settled: _Settled) -> ShipRecord:
        # A settled step: summarize its window, report it, then schedule its memory release.
        try:
            mark = time.perf_counter()
            await self._release.wait()  # the previous step's release
            settled.timings["release_wait"] = time.perf_counter() - mark
            stats = await _window_stats(self._workers, settled)
            record = settled.record(self._workers.stats(), stats)
            await _report(self._monitor, record, settled, self.monitor_timeout)
        finally:
            containers = settled.containers(pending=settled.step in self._delivery.pending_steps)
            if self._closed:  # the nursery may be gone: release here, shielded, exactly once
                await self._release.run_now(containers)
            else:
                await self._release.schedule(self._nursery, containers)
        return record

    @property
    def pending_steps(self) -> list[int]:
        """Steps settled as shipped whose delivery is not confirmed yet (re-sent first)."""
        return self._delivery.pending_steps

    def add_pending(self, step: int, payloads: Sequence[Payload]) -> None:
        """Adopt a step already settled and checkpointed whose delivery was not confirmed (e.g.
        read back from its outbox on resume): it is re-sent, these exact bytes, before the next
        batch. Sync; call on the loop."""
        self._delivery.add_pending(step, payloads)

    async def resend_pending(self) -> list[int]:
        """Send every pending step again, in order, with its identical bytes; return them.

        `publish` does this first. On error or cancellation the unsent steps stay pending (and
        their outbox files stay on disk for a resumed run).
        """
        async with self._lock:
            return await self._delivery.resend_pending()

    async def save_checkpoint(self) -> object | None:
        """Write a checkpoint of the state as it is now, between publications; return what the
        checkpointer's ``write`` returned (None without a checkpointer).

        For stopping mid-step without losing the work collected since the last shipped step:
        the checkpoint carries the step of the last shipped batch and everything queued or open
        now. It waits for a publication in progress to finish first. Shielded: a cancellation
        arriving meanwhile lands after the checkpoint is written.
        """
        with trio.CancelScope(shield=True):
            async with self._lock:
                written = await self._delivery.checkpoint_now(self.sink.step - 1)
        return written

    async def aclose(self) -> None:
        """Stop accepting batches and wait for the pending release. Idempotent.

        On cancellation: the wait for the pending release is shielded (with the release
        deadline inside the shield), so teardown never orphans it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            await self._release.wait()
        finally:
            self._nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_publisher(
    sink: BatchSource,
    sender: Sender,
    *,
    pack: Packer,
    encode: Encoder = encode,
    limiter: trio.CapacityLimiter | None = None,
    checkpointer: Checkpointer[Any] | None = None,
    monitor: Monitor | None = None,
    release: ReleaseFn = release_containers,
    release_timeout: float = 60.0,
    send_timeout: float = 300.0,
    monitor_timeout: float = 60.0,
    progress: ProgressTotals | None = None,
) -> AsyncIterator[Publisher]:
    """Open a publisher for ``sink``'s batches; it owns a nursery for its deferred releases.

    Args:
        sink: the train sink; in ``PruneMode.AFTER_SELECTION`` the publisher prunes the
            detached batch in a worker.
        sender: where payloads go; its ``world_size`` must match the packer's rank count.
        pack: samples -> one list of micro-batches per rank (runs in a worker).
        encode: one rank's MessagePack payload (default `trio_rl.wire.encode`, which packs one
            micro-batch at a time; runs in a worker). With the default and a sender that can
            stage (`trio_rl.transport.StagingSender`, e.g. `FileSender`), each rank is instead
            streamed through `trio_rl.wire.encode_into` into its staged file, one rank at a
            time, so the publisher never holds a whole step's payloads.
        limiter: the pipeline's one `trio.CapacityLimiter`: every worker job of the publisher
            borrows from it, and it is passed down to the sender
            (`trio_rl.transport.Sender.use_limiter`), so the file writes share its budget.
            Size it from configuration (the run's worker-thread count). Default: the sender's
            limiter if it was built with one, else a new one of 4 tokens. A sender built with a
            different limiter raises `ValueError`.
        checkpointer: snapshot on the loop, write in a worker, once per shipped step.
        monitor: receives a `Shipment` per shipped batch.
        release: empties shipped containers and trims the heap (runs in a worker).
        release_timeout: how long the next ship or the teardown waits for a pending release.
        send_timeout, monitor_timeout: deadlines of the send and of a channel monitor.
        progress: the run's totals so far (a resumed run's, from its checkpoint); every batch
            settled adds to them (`Publisher.progress`).

    On exit (or cancellation) the pending release is awaited, shielded, before the nursery
    closes; a release never outlives the block.
    """
    if limiter is None:
        limiter = sender.limiter if sender.limiter is not None else trio.CapacityLimiter(4)
    sender.use_limiter(limiter)
    async with trio.open_nursery() as nursery:
        workers = Workers(limiter)
        publisher = Publisher(
            nursery=nursery,
            sink=sink,
            pack=pack,
            encode=encode,
            workers=workers,
            delivery=Delivery(
                sender=sender,
                checkpointer=checkpointer,
                workers=workers,
                send_timeout=send_timeout,
            ),
            monitor=monitor,
            release=DeferredRelease(limiter, release, release_timeout),
            monitor_timeout=monitor_timeout,
            progress=progress if progress is not None else ProgressTotals(),
        )
        try:
            yield publisher
        finally:
            await publisher.aclose()
