"""`BatchReceiver`: a trio trainer rank's ``async for`` over its decoded micro-batches."""

from __future__ import annotations

import os
from typing import Self

import trio

from trio_rl.errors import InvalidArgumentError
from trio_rl.transport import (
    EndOfStreamError,
    FileReceiver,
    ReceivedPayload,
    Receiver,
    TransportTimeoutError,
    ZmqReceiver,
)
from trio_rl.wire import MicroBatch, decode

from ._payloads import read_payload_arrays, release_payload_files
from ._tensors import TrainerTensors, to_torch

__all__ = ["BatchReceiver"]

#: Payloads at least this large are decoded in a worker thread.
DEFAULT_THREAD_THRESHOLD = 256 * 1024


def _decode_and_release(box: list[ReceivedPayload]) -> list[MicroBatch]:
    received = box[0]
    micro_batches = decode(received.data, source=received.source)
    box.clear()
    return micro_batches


def _read_tensors(
    micro_batches: list[MicroBatch], lo: int, hi: int | None, root: str | os.PathLike[str] | None
) -> list[TrainerTensors]:
    return [to_torch(mb, read_payload_arrays(mb, lo=lo, hi=hi, root=root)) for mb in micro_batches]


def _share_limiter(
    transport: Receiver, limiter: trio.CapacityLimiter | None
) -> trio.CapacityLimiter:
    # One limiter for the decoding and the transport (ValueError if it has another one).
    if limiter is None:
        limiter = transport.limiter if transport.limiter is not None else trio.CapacityLimiter(1)
    transport.use_limiter(limiter)
    return limiter


class BatchReceiver:
    """Receives and decodes one trainer rank's micro-batches, step after step.

    ::

        async with BatchReceiver.zmq(rank, host="orchestrator", port=5555) as receiver:
            async for step, micro_batches in receiver:
                ...

    The receiver owns its transport: entering opens it, leaving closes it. Iteration ends
    when the sender ends the stream (`trio_rl.transport.Sender.end_stream`); `receive`
    then raises `trio_rl.transport.EndOfStreamError`.

    Each payload is acknowledged to the transport (`Receiver.ack`) only once it is
    decoded, right before it is returned: the filesystem transport deletes a file (with
    ``delete=True``) only then, so a receive cancelled at any point, followed by closing the
    receiver, leaves the step on disk for a new receiver opened at `next_step` (or with
    ``start_step=None``).

    Args:
        transport: the rank's receiving transport (`FileReceiver`, `ZmqReceiver`).
        stop_step: iteration ends before this step (``None``: iterate until cancelled).
        thread_threshold: payloads of at least this many bytes are decoded in a worker thread
            so the event loop keeps running; smaller ones inline.
        limiter: the one limiter of the rank's receiving threads (decoding, payload reads, and
            the transport's, passed down with `trio_rl.transport.Receiver.use_limiter`).
            Default: the transport's if it has one, else a new one of 1.
        timeout: seconds one receive waits for the transport, through its cancel scope (which
            loses no payload), before raising `trio_rl.transport.TransportTimeoutError`
            (``None``: until cancelled). A `FileReceiver`'s own ``timeout`` names the file.
        payload_root: where relative payload segment paths (from checkpoints written before
            paths were absolute) resolve; absolute paths are opened as given.

    A payload that is not a valid micro-batch array raises `trio_rl.wire.WireFormatError`
    whose ``source`` names the file (or the ZeroMQ endpoint, rank and step) and whose
    ``offset`` is the byte offset of the fault; that payload is then acknowledged (deleted,
    with ``delete=True``) and the next receive moves on to the next step.
    """

    def __init__(
        self,
        transport: Receiver,
        *,
        stop_step: int | None = None,
        thread_threshold: int = DEFAULT_THREAD_THRESHOLD,
        limiter: trio.CapacityLimiter | None = None,
        payload_root: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
    ) -> None:
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(
                f"BatchReceiver timeout must be >= 0 seconds or None, got {timeout!r}"
            )
        self._transport = transport
        self._timeout = timeout
        self._payload_root = payload_root
        # A decoded step whose payload files are still being read (`receive_tensors`).
        self._decoded: tuple[int, list[MicroBatch]] | None = None
        self._stop_step = stop_step
        self._thread_threshold = thread_threshold
        self._limiter = _share_limiter(transport, limiter)
        # A one-item box, so the decoding thread can take the last reference to the payload.
        self._pending: list[ReceivedPayload] | None = None

    @classmethod
    def files(
        cls,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        start_step: int | None = 0,
        stop_step: int | None = None,
        timeout: float | None = None,
        delete: bool = False,
        use_mmap: bool = False,
        limiter: trio.CapacityLimiter | None = None,
        payload_root: str | os.PathLike[str] | None = None,
    ) -> BatchReceiver:
        """A receiver over the filesystem transport (see `FileReceiver`; ``start_step=None``
        resumes after the last step this rank acknowledged; ``timeout`` is the file wait's).
        ``limiter`` serves the file reads and the decoding alike."""
        transport = FileReceiver(
            directory,
            rank,
            start_step=start_step,
            timeout=timeout,
            delete=delete,
            use_mmap=use_mmap,
        )
        return cls(transport, stop_step=stop_step, limiter=limiter, payload_root=payload_root)

    @classmethod
    def zmq(
        cls,
        rank: int,
        *,
        host: str = "127.0.0.1",
        port: int = 5555,
        hwm: int = 10,
        start_step: int = 0,
        stop_step: int | None = None,
        timeout: float | None = None,
        limiter: trio.CapacityLimiter | None = None,
        payload_root: str | os.PathLike[str] | None = None,
    ) -> BatchReceiver:
        """A receiver over the ZeroMQ transport (see `ZmqReceiver`); ``timeout`` as ``files``'."""
        transport = ZmqReceiver(rank, host=host, port=port, hwm=hwm, start_step=start_step)
        return cls(
            transport,
            stop_step=stop_step,
            timeout=timeout,
            limiter=limiter,
            payload_root=payload_root,
        )

    @property
    def transport(self) -> Receiver:
        return self._transport

    @property
    def rank(self) -> int:
        return self._transport.rank

    @property
    def next_step(self) -> int:
        """The step the next `receive` returns."""
        if self._decoded is not None:
            return self._decoded[0]
        if self._pending:
            return self._pending[0].step
        return self._transport.next_step

    async def receive(self) -> tuple[int, list[MicroBatch]]:
        """Wait for the next step's payload and return ``(step, micro_batches)``.

        Large payloads are decoded in a worker thread, which also drops the last reference to
        the received buffer: freeing tens of MiB takes milliseconds the loop should not spend.
        Raises `trio_rl.transport.EndOfStreamError` once the sender ended the stream.

        Cancellation: safe. A payload already taken from the transport but not yet decoded is
        kept and returned by the next call; it is acknowledged to the transport only after
        decoding (shielded, with no checkpoint before the return), so it is either returned
        or still held by the transport (on disk) for a new receiver.
        """
        step, micro_batches = await self._decode_next()
        await self._settle(step)
        return step, micro_batches

    async def _settle(self, step: int) -> None:
        # Done with the decoded step: forget it and acknowledge it (shielded).
        self._decoded = self._pending = None
        with trio.CancelScope(shield=True):
            await self._transport.ack(step)

    async def receive_tensors(
        self, *, lo: int = 0, hi: int | None = None
    ) -> tuple[int, list[TrainerTensors]]:
        """`receive`, then `to_torch` each micro-batch with its by-handle payload fields read.

        Each payload field is read over its window of tokens ``[lo, hi)`` (default: the whole
        micro-batch; see `read_payload_arrays`), in a worker thread. Once the step is read it is
        acknowledged to the transport and the payload files it referred to are deleted (both
        shielded, with no checkpoint before the return): the files go only with the step handed
        over. A payload file that is missing raises `trio_rl.errors.PayloadFileMissingError`;
        that step is acknowledged and its files are left to the orchestrator's orphan sweep.

        Cancellation: safe, and deletes nothing. A step decoded but not yet fully read is kept
        and read again by the next call.
        """
        step, micro_batches = await self._decode_next()
        root = self._payload_root
        try:
            tensors = await trio.to_thread.run_sync(
                _read_tensors, micro_batches, lo, hi, root, limiter=self._limiter
            )
        except Exception:
            await self._settle(step)
            raise
        await self._settle(step)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(
                release_payload_files, micro_batches, root, limiter=self._limiter
            )
        return step, tensors

    async def _decode_next(self) -> tuple[int, list[MicroBatch]]:
        # The next step, decoded and not yet acknowledged (kept across a cancelled call).
        if self._decoded is not None:
            return self._decoded
        if self._pending is None:
            self._pending = [await self._receive_payload()]
        box = self._pending
        step = box[0].step
        try:
            if len(box[0].data) >= self._thread_threshold:
                micro_batches = await trio.to_thread.run_sync(
                    _decode_and_release, box, limiter=self._limiter
                )
            else:
                micro_batches = _decode_and_release(box)
        except Exception:
            # The error is this payload's delivery: forget it, so the next receive moves on.
            await self._settle(step)
            raise
        self._pending = None
        self._decoded = (step, micro_batches)
        return self._decoded

    async def _receive_payload(self) -> ReceivedPayload:
        if self._timeout is None:
            return await self._transport.receive()
        with trio.move_on_after(self._timeout):
            # Cancelling a receive loses nothing (the `Receiver.receive` contract).
            return await self._transport.receive()
        raise TransportTimeoutError(
            f"rank {self.rank}: no payload for step {self._transport.next_step} from "
            f"{type(self._transport).__name__} after waiting {self._timeout:g} s"
        )

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[int, list[MicroBatch]]:
        if self._stop_step is not None and self.next_step >= self._stop_step:
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        try:
            return await self.receive()
        except EndOfStreamError:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Close the transport. Idempotent.

        Cancellation: as the transport's ``aclose``: the transport is closed even if
        `trio.Cancelled` is raised; a payload received but not yet acknowledged is not
        acknowledged (the filesystem and memory transports keep it for a new receiver).
        """
        await self._transport.aclose()

    async def __aenter__(self) -> Self:
        """Enter the transport. Cancellation: as the transport's ``__aenter__`` (if it raises
        `trio.Cancelled`, the library's transports opened nothing)."""
        await self._transport.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """`aclose`. Cancellation: the transport is closed even if `trio.Cancelled` is raised."""
        await self.aclose()
