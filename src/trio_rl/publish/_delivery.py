"""Getting settled steps to the trainer exactly once: durable before visible, then sent, and
re-sent with identical bytes until a send is confirmed (see `Publisher.publish`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import trio

from ..sink import CheckpointManager, CheckpointSnapshot, IncrementalSnapshot, TrainSink
from ..transport import Payload, Sender
from ._encoding import Encoded, InMemory
from ._errors import PublishError
from ._workers import Workers

__all__ = ["Checkpointer", "Delivery", "Outbox", "SinkCheckpointer"]

SnapshotT = TypeVar("SnapshotT")


class Checkpointer(Protocol[SnapshotT]):
    """Checkpointing split in two: an owned snapshot on the loop, the write in a worker."""

    def snapshot(self, step: int) -> SnapshotT:
        """Owned copy of the state right after batch ``step`` was settled. On the event loop."""

    def write(self, snapshot: SnapshotT) -> object:
        """Serialize and write atomically. In a worker thread."""


@runtime_checkable
class Outbox(Protocol):
    """Durable storage of a step's payload bytes until its delivery is confirmed.

    A checkpointer that also implements this makes shipping exactly-once as the trainer sees
    it (see `Publisher.publish`). Both methods block and run in a worker thread.
    """

    def write_outbox(self, step: int, payloads: Sequence[Payload]) -> object:
        """Write ``payloads`` of ``step`` atomically and durably (before its checkpoint).

        ``payloads`` may be a lazy sequence that opens each rank's bytes as it is iterated
        (a streamed step): iterate it once, in order, and keep no item longer than needed.
        """

    def clear_outbox(self, step: int) -> None:
        """The delivery of ``step`` is confirmed: delete its payload bytes."""


@attrs.frozen
class SinkCheckpointer:
    """A `Checkpointer` over `trio_rl.sink.CheckpointManager`: the sink's state, plus the
    data-source ``cursor`` and ``progress`` read on the loop when the snapshot is taken."""

    manager: CheckpointManager
    sink: TrainSink
    cursor: Callable[[], Any] = attrs.field(default=lambda: None)
    progress: Callable[[], Mapping[str, Any]] = attrs.field(default=dict)

    def snapshot(self, step: int) -> CheckpointSnapshot | IncrementalSnapshot:
        snap: CheckpointSnapshot | IncrementalSnapshot = self.manager.snapshot(
            self.sink, step=step, cursor=self.cursor(), progress=self.progress()
        )
        return snap

    def write(self, snapshot: CheckpointSnapshot | IncrementalSnapshot) -> Path:
        return self.manager.write(snapshot)

    def write_outbox(self, step: int, payloads: Sequence[Payload]) -> Path:
        return self.manager.write_outbox(step, payloads)

    def clear_outbox(self, step: int) -> None:
        self.manager.clear_outbox(step)


@attrs.define(eq=False, kw_only=True)
class Delivery:
    """The publisher's sending half: sends with a deadline, the outbox and checkpoint writes,
    and the steps settled as shipped whose delivery is not confirmed yet (``pending``)."""

    sender: Sender
    checkpointer: Checkpointer[Any] | None
    workers: Workers
    send_timeout: float
    _pending: dict[int, Encoded] = attrs.field(factory=dict, init=False)

    @property
    def pending_steps(self) -> list[int]:
        return sorted(self._pending)

    def add_pending(self, step: int, payloads: Sequence[Payload]) -> None:
        self._pending[step] = InMemory(step, list(payloads))

    async def send(self, encoded: Encoded) -> None:
        """Deliver ``encoded`` within ``send_timeout`` (else `PublishError`)."""
        with trio.move_on_after(self.send_timeout) as scope:
            await encoded.deliver(self.sender)
        if scope.cancelled_caught:
            raise PublishError(
                f"step {encoded.step}: sending did not finish within {self.send_timeout:g} s"
            )

    def make_durable(self, snapshot: Any, encoded: Encoded) -> None:
        """Blocking (a worker): the outbox first, then the checkpoint that records the step."""
        checkpointer = self.checkpointer
        assert checkpointer is not None
        outbox: object = checkpointer
        if isinstance(outbox, Outbox):
            outbox.write_outbox(encoded.step, encoded.outbox())
        checkpointer.write(snapshot)

    async def send_durable(self, encoded: Encoded) -> None:
        """Send a step that is durable (settled, checkpointed): it stays pending until the send
        is confirmed, so a failed or cancelled send leaves it to be re-sent, identical."""
        self._pending[encoded.step] = encoded
        await self.send(encoded)
        await self._confirm(encoded.step)

    async def _confirm(self, step: int) -> None:
        self._pending.pop(step, None)
        outbox: object = self.checkpointer
        if isinstance(outbox, Outbox):
            with trio.CancelScope(shield=True):
                await self.workers.run(outbox.clear_outbox, step)

    async def checkpoint_now(self, step: int) -> object | None:
        """Snapshot (now, on the loop) and write (in a worker) a checkpoint at ``step``; what
        the checkpointer's ``write`` returned, or None without a checkpointer."""
        if self.checkpointer is None:
            await trio.lowlevel.checkpoint()
            return None
        snapshot = self.checkpointer.snapshot(step)
        return await self.workers.run(self.checkpointer.write, snapshot)

    async def resend_pending(self) -> list[int]:
        """Send every pending step again, in order; return them. On error or cancellation the
        unsent steps stay pending (and their outbox files on disk for a resumed run)."""
        done = []
        for step in sorted(self._pending):
            await self.send(self._pending[step])
            await self._confirm(step)
            done.append(step)
        return done
