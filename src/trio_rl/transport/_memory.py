"""The in-memory transport: a sender and its receivers over trio memory channels.

For tests and single-process runs (httpx's ``MockTransport`` plays the same part): the same
contract as the filesystem and ZeroMQ transports (world size, steps in order, end of stream,
acknowledgement) with nothing on disk or on the network. A `MemorySender` owns one unbounded
memory channel per rank; ``sender.receiver(rank)`` opens a `MemoryReceiver` on it.

Like the filesystem transport, a payload returned by `MemoryReceiver.receive` is held until it
is acknowledged; a receiver closed before acknowledging it leaves it to the next receiver of
the same rank, so a trainer rank can be "restarted" within one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import trio

from ..errors import InvalidArgumentError
from ._base import Payload, ReceivedPayload, Sender, SteppedReceiver
from ._errors import EndOfStreamError, TransportError
from ._wait import Wait, timeout_seconds

__all__ = ["MemoryReceiver", "MemorySender"]


@attrs.frozen
class _End:
    step: int


_Item = ReceivedPayload | _End


@attrs.define
class _RankLine:
    """One rank's channel, and what its receivers share across reopening."""

    send: trio.MemorySendChannel[_Item]
    receive: trio.MemoryReceiveChannel[_Item]
    #: A payload returned but not acknowledged: the next receiver of the rank returns it first.
    held: ReceivedPayload | None = None
    acked: int = -1
    ended_at: int | None = None


class MemorySender(Sender):
    """Sends each step's payloads to in-process receivers over trio memory channels.

    ::

        async with MemorySender(world_size=2) as sender:
            receivers = [sender.receiver(rank) for rank in range(2)]
            ...

    A send never waits (the channels are unbounded; the orchestrator's ship gate bounds how
    far the receivers can fall behind). Steps must not go back: a step below the last one sent
    raises `ValueError`; the same step again is a re-send, which a receiver already past it
    skips, as it skips every step below its `MemoryReceiver.next_step`.

    Args:
        world_size: the number of ranks.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
        self._world_size = world_size
        self._lines: list[_RankLine] = []
        for _ in range(world_size):
            send, receive = trio.open_memory_channel[_Item](math.inf)
            self._lines.append(_RankLine(send, receive))
        self._last_step: int | None = None
        self._ended_at: int | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return self._world_size

    def receiver(
        self, rank: int, *, start_step: int = 0, timeout: float | None = None
    ) -> MemoryReceiver:
        """A receiver of rank ``rank``'s payloads, from ``start_step`` on.

        ``timeout``: seconds one receive waits for its step before raising
        `TransportTimeoutError` (``None``: until cancelled), as `FileReceiver`'s.

        Open one receiver per rank at a time; a new one, opened after the previous one was
        closed, returns first the payload that one received but did not acknowledge.
        """
        if not 0 <= rank < self._world_size:
            raise InvalidArgumentError(f"rank must be in 0..{self._world_size - 1}, got {rank}")
        if start_step < 0:
            raise InvalidArgumentError(f"start_step must be >= 0, got {start_step}")
        return MemoryReceiver(self._lines[rank], rank, start_step, timeout_seconds(timeout))

    def _check_step(self, step: int, what: str) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this MemorySender is closed")
        if self._ended_at is not None:
            raise RuntimeError(f"the stream was ended at step {self._ended_at} (end_stream)")
        if step < 0:
            raise InvalidArgumentError(f"step must be >= 0, got {step}")
        if self._last_step is not None and step < self._last_step:
            raise InvalidArgumentError(f"{what}({step}): step {self._last_step} was already sent")

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        """Queue ``payloads[r]`` for rank ``r`` (the buffers are passed on, not copied).

        Cancellation: all or nothing. If `trio.Cancelled` is raised (only on entry), nothing
        of this step was queued; otherwise every rank's payload is queued and the call returns.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_step(step, "send")
        if len(payloads) != self._world_size:
            raise InvalidArgumentError(
                f"step {step}: got {len(payloads)} payloads for world_size {self._world_size}"
            )
        for rank, (line, payload) in enumerate(zip(self._lines, payloads, strict=True)):
            source = f"memory rank {rank} step {step}"
            line.send.send_nowait(ReceivedPayload(step, rank, payload, source))
        self._last_step = step
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def end_stream(self, step: int) -> None:
        """Queue the end of the stream for every rank: no step ``>= step`` will come.

        ``step`` must be greater than every step sent. Later sends raise `RuntimeError`.

        Cancellation: all or nothing, like `send`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_step(step, "end_stream")
        if self._last_step is not None and step == self._last_step:
            raise InvalidArgumentError(f"end_stream({step}): step {step} was already sent")
        for line in self._lines:
            line.send.send_nowait(_End(step))
        self._ended_at = step
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def aclose(self) -> None:
        """Close the channels. Receivers still get every step queued before; after that a
        receiver of a stream that was not ended raises `TransportError`.

        Cancellation: closing completes at once; `trio.Cancelled` may still be raised.
        """
        if not self._closed:
            self._closed = True
            for line in self._lines:
                line.send.close()
        await trio.lowlevel.checkpoint()


class MemoryReceiver(SteppedReceiver):
    """Receives one rank's payloads from a `MemorySender` (made by `MemorySender.receiver`).

    A returned payload is held until acknowledged: by `ack`, or implicitly by the next
    `receive` (`trio_rl.trainer.BatchReceiver` acks each payload once decoded). A step below
    `next_step` (a re-send) is skipped; a step above it raises `TransportError` (the receiver
    started past the first step sent, or an earlier receiver of the rank consumed steps
    without acknowledging them). While a receive waits it logs (``trio_rl.transport``, INFO)
    every 60 s; past the receiver's timeout it raises `TransportTimeoutError`.
    """

    def __init__(self, line: _RankLine, rank: int, start_step: int, timeout: float) -> None:
        super().__init__(rank, max(start_step, line.acked + 1))
        self._line = line
        self._timeout = timeout
        self._closed = False

    async def __aenter__(self) -> MemoryReceiver:
        """Nothing to open (the receiver is ready when made).

        Cancellation: a checkpoint; if it raises `trio.Cancelled` the receiver is unchanged.
        """
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the receiver (`aclose`); a payload not yet acknowledged stays held.

        Cancellation: closing completes at once; `trio.Cancelled` may still be raised.
        """
        await self.aclose()

    def _end_of_stream(self, end: int) -> EndOfStreamError:
        return EndOfStreamError(
            f"memory rank {self._rank}: the stream ended before step {end}; "
            f"no step {self._next_step}",
            end,
        )

    async def receive(self) -> ReceivedPayload:
        """Wait for the payload of `next_step` and return it (held until acknowledged).

        First acknowledges the step it returned last. Raises `EndOfStreamError` at the end of the
        stream (and on every later call), `TransportError` at a step gap or if the sender was
        closed without ending the stream, `TransportTimeoutError` if nothing came within the
        receiver's timeout.

        Cancellation: safe; a cancelled receive takes nothing off the channel.
        """
        if self._closed:
            raise trio.ClosedResourceError("this MemoryReceiver is closed")
        line = self._line
        if line.held is not None and line.held.step < self._next_step:
            line.acked = max(line.acked, line.held.step)
            line.held = None
        if line.ended_at is not None and self._next_step >= line.ended_at:
            await trio.lowlevel.checkpoint()
            raise self._end_of_stream(line.ended_at)
        if line.held is not None:
            item: _Item = line.held
            await trio.lowlevel.checkpoint()
        else:
            wait = Wait(self._timeout, f"memory rank {self._rank}: no step {self._next_step}")
            while True:
                try:
                    got = None
                    with trio.move_on_after(wait.until_next_event()):
                        got = await line.receive.receive()
                    if got is None:
                        continue  # a log line or the deadline: `until_next_event` says which
                    item = got
                except trio.EndOfChannel:
                    raise TransportError(
                        f"memory rank {self._rank}: the sender was closed without ending the "
                        f"stream; no step {self._next_step}"
                    ) from None
                if isinstance(item, _End) or item.step >= self._next_step:
                    break
        if isinstance(item, _End):
            line.ended_at = item.step
            if item.step > self._next_step:
                raise TransportError(
                    f"memory rank {self._rank}: the stream ended before step {item.step}, "
                    f"but step {self._next_step} never came"
                )
            raise self._end_of_stream(item.step)
        if item.step != self._next_step:
            line.held = None
            raise TransportError(
                f"memory rank {self._rank}: expected step {self._next_step}, got step "
                f"{item.step} (did this receiver start past the first step sent?)"
            )
        line.held = item
        self._next_step = item.step + 1
        return item

    async def ack(self, step: int) -> None:
        """Forget the payload of ``step``; a new receiver of this rank starts after it.

        Only a step returned by `receive` can be acknowledged (an older one again: a no-op);
        raises `ValueError` for a step not returned yet.

        Cancellation: the acknowledgement is made before the checkpoint, so it holds even if
        `trio.Cancelled` is raised.
        """
        if step >= self._next_step:
            raise InvalidArgumentError(
                f"memory rank {self._rank}: cannot ack step {step}: not received yet"
            )
        line = self._line
        line.acked = max(line.acked, step)
        if line.held is not None and line.held.step <= step:
            line.held = None
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Later receives raise `trio.ClosedResourceError`. A payload returned but not yet
        acknowledged stays held for the next receiver of this rank.

        Cancellation: closing completes at once; `trio.Cancelled` may still be raised.
        """
        self._closed = True
        await trio.lowlevel.checkpoint()
