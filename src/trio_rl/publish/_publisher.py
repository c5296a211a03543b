"""The publisher: finalizes train batches off the event loop and ships them.

What runs where (docs/publish.md, "What runs where"):

- on the event loop, never across an await: detaching the selected samples from the sink,
  the policy-wait snapshot, settling the batch with the sink (which books the outcome, reads
  and resets its metrics window and advances the step), the counter snapshot and the
  checkpoint snapshot;
- in worker threads, through one shared `trio.CapacityLimiter`: pruning after selection,
  packing, the metrics over the shipped cohort, MessagePack encoding, the file writes (pass
  ``publisher.limiter`` to the `FileSender`), the checkpoint write and the deferred
  memory release.

Nothing the loop still mutates is handed to a worker: the batch is detached first.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypeVar, runtime_checkable

import attrs
import trio

from ..train import (
    CheckpointManager,
    CheckpointSnapshot,
    Cut,
    DetachedBatch,
    PruneResult,
    SinkConfig,
    SinkCounters,
    SinkWindow,
    TrainBatch,
    TrainingSample,
    TrainSink,
)
from ..transport import Payload, Sender
from ..wire import MicroBatch, encode
from ._errors import MonitorTimeoutError, PublishError
from ._metrics import ShipRecord, ShipTimings, ThreadStats, attempt_stats, cohort_stats
from ._release import Container, DeferredRelease, ReleaseFn, release_containers

__all__ = [
    "BatchSource",
    "Checkpointer",
    "Encoder",
    "Monitor",
    "Outbox",
    "Packer",
    "Publisher",
    "Shipment",
    "SinkCheckpointer",
    "open_publisher",
]

T = TypeVar("T")
SnapshotT = TypeVar("SnapshotT")

#: Packs the shipped samples into one list of micro-batches per data-parallel rank (pure, sync).
Packer: TypeAlias = Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]
#: One rank's MessagePack payload for its micro-batches (default `trio_rl.wire.encode`).
Encoder: TypeAlias = Callable[[Sequence[MicroBatch]], Payload]


class BatchSource(Protocol):
    """The train sink as the publisher uses it (`trio_rl.train.TrainSink` is one).

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
        """The sink's one cut (see `trio_rl.train.TrainSink.cut`): detach, prune after
        selection in a worker, then settle, or requeue when the block is left unsettled."""


class Checkpointer(Protocol[SnapshotT]):
    """Checkpointing split in two: an owned snapshot on the loop, the write in a worker."""

    def snapshot(self, step: int) -> SnapshotT:
        """Owned copy of the state right after batch ``step`` was booked. On the event loop."""

    def write(self, snapshot: SnapshotT) -> object:
        """Serialize and write atomically. In a worker thread."""


@runtime_checkable
class Outbox(Protocol):
    """Durable storage of a step's payload bytes until its delivery is confirmed.

    A checkpointer that also implements this makes shipping exactly-once as the trainer sees
    it (see `Publisher.publish`). Both methods block and run in a worker thread.
    """

    def write_outbox(self, step: int, payloads: Sequence[Payload]) -> object:
        """Write ``payloads`` of ``step`` atomically and durably (before its checkpoint)."""

    def clear_outbox(self, step: int) -> None:
        """The delivery of ``step`` is confirmed: delete its payload bytes."""


@attrs.frozen
class SinkCheckpointer:
    """A `Checkpointer` over `trio_rl.train.CheckpointManager`: the sink's state, plus the
    data-source ``cursor`` and ``progress`` read on the loop when the snapshot is taken."""

    manager: CheckpointManager
    sink: TrainSink
    cursor: Callable[[], Any] = attrs.field(default=lambda: None)
    progress: Callable[[], Mapping[str, Any]] = attrs.field(default=dict)

    def snapshot(self, step: int) -> CheckpointSnapshot:
        return self.manager.snapshot(
            self.sink, step=step, cursor=self.cursor(), progress=self.progress()
        )

    def write(self, snapshot: CheckpointSnapshot) -> Path:
        return self.manager.write(snapshot)

    def write_outbox(self, step: int, payloads: Sequence[Payload]) -> Path:
        return self.manager.write_outbox(step, payloads)

    def clear_outbox(self, step: int) -> None:
        self.manager.clear_outbox(step)


@attrs.frozen
class Shipment:
    """What a monitor receives per shipped batch: the record and its *own* list of the shipped
    samples (the publisher's lists are emptied by the deferred release; this one is not)."""

    record: ShipRecord
    samples: list[TrainingSample]


#: A sync callback (called on the loop; keep it short) or a channel (awaited with a deadline).
Monitor: TypeAlias = "Callable[[Shipment], None] | trio.MemorySendChannel[Shipment]"


def _encode_ranks(encode: Encoder, grid: Sequence[Sequence[MicroBatch]]) -> list[Payload]:
    # Runs in a worker. One rank at a time, checking for cancellation in between; the wire
    # encoder packs one micro-batch (one field list) per C call, so the loop gets the GIL back
    # between calls instead of waiting for a whole payload.
    payloads: list[Payload] = []
    for rank_batches in grid:
        trio.from_thread.check_cancelled()
        payloads.append(encode(rank_batches))
    return payloads


def _check_grid(grid: list[list[MicroBatch]], world_size: int, step: int) -> None:
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


@attrs.define(eq=False, kw_only=True)
class Publisher:
    """Ships the train sink's batches. Create it with `open_publisher` (its fields are
    keyword-only: they are `open_publisher`'s arguments, resolved).

    Publications are serialized (one batch at a time, in step order); `publish` may be called
    from any task of the publisher's lifetime.
    """

    _nursery: trio.Nursery
    sink: BatchSource
    sender: Sender
    _pack: Packer
    _encode: Encoder
    limiter: trio.CapacityLimiter
    _checkpointer: Checkpointer[Any] | None
    _monitor: Monitor | None
    _release: DeferredRelease
    send_timeout: float
    monitor_timeout: float
    _policy_wait: float = attrs.field(default=0.0, init=False)
    _pending: dict[int, list[Payload]] = attrs.field(factory=dict, init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _busy: int = attrs.field(default=0, init=False)

    @property
    def step(self) -> int:
        """The step of the next batch (the sink's)."""
        return self.sink.step

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
        return, so a wait that completes while that batch is being finalized is reported with it.
        """
        if not seconds >= 0:
            raise ValueError(f"policy wait must be >= 0 seconds, got {seconds!r}")
        self._policy_wait += seconds

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(self._job, fn, *args, limiter=self.limiter)

    def _job(self, fn: Callable[..., T], *args: Any) -> T:
        # In the worker, holding its token: how many threads are busy now (this one included).
        self._busy = max(self._busy, self.limiter.borrowed_tokens)
        return fn(*args)

    def _threads(self) -> ThreadStats:
        # Read and reset on the loop, with the record.
        busy, self._busy = self._busy, 0
        return ThreadStats(limit=int(self.limiter.total_tokens), busy_max=busy)

    async def publish(self, *, force: bool = False) -> ShipRecord | None:
        """Cut the sink's next batch and ship it; return its record.

        Returns ``None`` without advancing the step when the sink has no batch ready (``force``
        cuts what there is, for draining), or when pruning after selection left nothing to train
        (the sink keeps its window for the next batch).

        Steps still pending (see `resend_pending`) are re-sent first.

        Without a checkpointer: on cancellation or error before the send completed, the batch
        goes back to the sink's queue (pruned samples stay booked as pruned) and the step is
        unchanged; a worker job already running finishes first (workers are never abandoned;
        encoding stops at its next cancellation check). Once the send completed the batch is
        booked and the step advances.

        With a checkpointer, a step is *durable before it is visible*: once encoded, the batch is
        booked (the step advances), the snapshot is taken, and then, shielded, the payload bytes
        are written to the checkpointer's outbox (when it is an `Outbox`) and the checkpoint of
        the step is written; only then is the step sent, and on success its outbox is deleted.
        A send that fails or is cancelled after that does not requeue: the step stays pending,
        and is re-sent with identical bytes before the next step (or, by a resumed run, from the
        outbox file). So a trainer never sees a step change once visible. A cancellation before
        the batch was booked requeues it as above.
        """
        if self._closed:
            raise trio.ClosedResourceError("publish() called on a closed publisher")
        async with self._lock:
            if self._closed:
                raise trio.ClosedResourceError("publish() called on a closed publisher")
            await self._resend_pending()
            if not (self.sink.ready() or (force and self.sink.queued)):
                return None
            return await self._ship(force)

    async def _ship(self, force: bool) -> ShipRecord | None:
        started = time.perf_counter()
        timings: dict[str, float] = {}
        policy_wait = 0.0
        batch: TrainBatch | None = None
        try:
            # The sink's cut: leaving this block before `settle` requeues the batch.
            async with self.sink.cut(force=force, limiter=self.limiter) as cut:
                step, detached, pruned = cut.step, cut.detached, cut.pruned
                if pruned is not None:
                    timings["prune"] = cut.prune_seconds
                    if not pruned.kept:
                        cut.settle()  # empty: no step, window carried over
                        return None
                samples = list(cut.samples)

                mark = time.perf_counter()
                grid = await self._run(self._pack, samples)
                timings["pack"] = time.perf_counter() - mark
                _check_grid(grid, self.sender.world_size, step)

                mark = time.perf_counter()
                effective = await self._run(cohort_stats, samples, step)
                timings["metrics"] = time.perf_counter() - mark
                # Read-and-reset with no await since the worker returned: a wait that completed
                # while the metrics were computed is reported now, a later one next time.
                policy_wait, self._policy_wait = self._policy_wait, 0.0

                mark = time.perf_counter()
                payloads = await self._run(_encode_ranks, self._encode, grid)
                if self._checkpointer is None:
                    await self._send(step, payloads)
                    timings["send"] = time.perf_counter() - mark
                batch = cut.settle()
        except BaseException:
            if batch is None:
                self._policy_wait += policy_wait  # not reported: keep it for the next record
            raise

        # Booked. Everything up to the send is sync or shielded.
        # the window the sink read and reset (scalars: constant time, fine on the loop)
        all_stats = attempt_stats(batch.window if batch.window is not None else SinkWindow())
        counters = attrs.asdict(self.sink.counters)
        if self._checkpointer is not None:
            # Durable before visible: the outbox (this step's exact bytes) and the checkpoint
            # that covers this step are on disk before any rank can see the step, so a resumed
            # run re-sends these bytes instead of regenerating the step. Shielded: a cancellation
            # arriving now must not leave a booked step without its checkpoint.
            snapshot = self._checkpointer.snapshot(step)
            encoded = time.perf_counter() - mark
            mark = time.perf_counter()
            with trio.CancelScope(shield=True):
                await self._run(self._make_durable, step, snapshot, payloads)
            timings["checkpoint"] = time.perf_counter() - mark
            del snapshot
            self._pending[step] = list(payloads)
            mark = time.perf_counter()
            # A failure or cancellation here does not requeue (the books say shipped): the
            # step stays pending and is re-sent, identical, before the next step. The monitor
            # follows the books, so it sees the step either way (shielded when the send failed).
            finish = functools.partial(
                self._finish, step, started, timings, samples, detached, payloads, grid, pruned,
                all_stats, effective, counters, policy_wait,
            )  # fmt: skip
            try:
                await self._send(step, payloads)
                await self._confirm(step)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await finish()
                raise
            timings["send"] = encoded + time.perf_counter() - mark
            return await finish()
        timings["checkpoint"] = 0.0
        return await self._finish(
            step, started, timings, samples, detached, payloads, grid, pruned,
            all_stats, effective, counters, policy_wait,
        )  # fmt: skip

    async def _finish(
        self,
        step: int,
        started: float,
        timings: dict[str, float],
        samples: list[TrainingSample],
        detached: DetachedBatch,
        payloads: list[Payload],
        grid: list[list[MicroBatch]],
        pruned: PruneResult | None,
        all_stats: Any,
        effective: Any,
        counters: dict[str, Any],
        policy_wait: float,
    ) -> ShipRecord:
        # A booked step: schedule its memory release, then tell the monitor.
        monitor_copy = list(samples)
        ranks, per_rank = len(grid), len(grid[0]) if grid else 0
        payload_bytes = sum(len(p) for p in payloads)
        mark = time.perf_counter()
        containers: list[Container] = [samples, detached.samples, payloads, *grid, grid]
        if pruned is not None:
            containers += [pruned.kept, pruned.pruned]
        await self._schedule_release(containers)
        timings["release_wait"] = time.perf_counter() - mark
        record = ShipRecord(
            step=step,
            all=all_stats,
            effective=effective,
            counters=counters,
            policy_wait=policy_wait,
            ranks=ranks,
            micro_batches_per_rank=per_rank,
            payload_bytes=payload_bytes,
            timings=ShipTimings(total=time.perf_counter() - started, **timings),
            threads=self._threads(),
        )
        await self._deliver(Shipment(record=record, samples=monitor_copy))
        return record

    def _make_durable(self, step: int, snapshot: Any, payloads: Sequence[Payload]) -> None:
        # In a worker: the outbox first, then the checkpoint that books the step as shipped.
        checkpointer = self._checkpointer
        assert checkpointer is not None
        outbox: object = checkpointer
        if isinstance(outbox, Outbox):
            outbox.write_outbox(step, payloads)
        checkpointer.write(snapshot)

    async def _send(self, step: int, payloads: Sequence[Payload]) -> None:
        with trio.move_on_after(self.send_timeout) as send_scope:
            await self.sender.send(step, payloads)
        if send_scope.cancelled_caught:
            raise PublishError(
                f"step {step}: sending did not finish within {self.send_timeout:g} s"
            )

    async def _confirm(self, step: int) -> None:
        self._pending.pop(step, None)
        outbox: object = self._checkpointer
        if isinstance(outbox, Outbox):
            with trio.CancelScope(shield=True):
                await self._run(outbox.clear_outbox, step)

    @property
    def pending_steps(self) -> list[int]:
        """Steps booked as shipped whose delivery is not confirmed yet (re-sent first)."""
        return sorted(self._pending)

    def add_pending(self, step: int, payloads: Sequence[Payload]) -> None:
        """Adopt a step already booked and checkpointed whose delivery was not confirmed (e.g.
        read back from its outbox on resume): it is re-sent, these exact bytes, before the next
        batch. Sync; call on the loop."""
        self._pending[step] = list(payloads)

    async def resend_pending(self) -> list[int]:
        """Send every pending step again, in order, with its identical bytes; return them.

        `publish` does this first. On error or cancellation the unsent steps stay pending (and
        their outbox files stay on disk for a resumed run).
        """
        async with self._lock:
            return await self._resend_pending()

    async def _resend_pending(self) -> list[int]:
        done = []
        for step in sorted(self._pending):
            await self._send(step, self._pending[step])
            await self._confirm(step)
            done.append(step)
        return done

    async def save_checkpoint(self) -> object | None:
        """Write a checkpoint of the state as it is now, between publications; return what the
        checkpointer's ``write`` returned (None without a checkpointer).

        For stopping mid-step without losing the work collected since the last shipped step:
        the checkpoint carries the step of the last shipped batch and everything queued or open
        now. It waits for a publication in progress to finish first. Shielded: a cancellation
        arriving meanwhile lands after the checkpoint is written.
        """
        if self._checkpointer is None:
            return None
        written: object = None
        with trio.CancelScope(shield=True):
            async with self._lock:
                snapshot = self._checkpointer.snapshot(self.sink.step - 1)
                written = await self._run(self._checkpointer.write, snapshot)
        return written

    async def _schedule_release(self, containers: list[Container]) -> None:
        if self._closed:
            # The nursery may be gone: release here (shielded: it must happen exactly once).
            await self._release.wait()
            with trio.CancelScope(shield=True):
                await self._run(self._release.release, containers)
            return
        await self._release.schedule(self._nursery, containers)

    async def _deliver(self, shipment: Shipment) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        if isinstance(monitor, trio.MemorySendChannel):
            with trio.move_on_after(self.monitor_timeout) as scope:
                await monitor.send(shipment)
            if scope.cancelled_caught:
                raise MonitorTimeoutError(
                    f"step {shipment.record.step}: the monitor channel did not accept the "
                    f"record within {self.monitor_timeout:g} s"
                )
        else:
            monitor(shipment)

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
) -> AsyncIterator[Publisher]:
    """Open a publisher for ``sink``'s batches; it owns a nursery for its deferred releases.

    Args:
        sink: the train sink; in ``PruneMode.AFTER_SELECTION`` the publisher prunes the
            detached batch in a worker.
        sender: where payloads go; its ``world_size`` must match the packer's rank count.
        pack: samples -> one list of micro-batches per rank (runs in a worker).
        encode: one rank's MessagePack payload (default `trio_rl.wire.encode`, which packs one
            micro-batch at a time; runs in a worker).
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

    On exit (or cancellation) the pending release is awaited, shielded, before the nursery
    closes; a release never outlives the block.
    """
    if limiter is None:
        limiter = sender.limiter if sender.limiter is not None else trio.CapacityLimiter(4)
    sender.use_limiter(limiter)
    async with trio.open_nursery() as nursery:
        publisher = Publisher(
            nursery=nursery,
            sink=sink,
            sender=sender,
            pack=pack,
            encode=encode,
            limiter=limiter,
            checkpointer=checkpointer,
            monitor=monitor,
            release=DeferredRelease(limiter, release, release_timeout),
            send_timeout=send_timeout,
            monitor_timeout=monitor_timeout,
        )
        try:
            yield publisher
        finally:
            await publisher.aclose()
