"""A step's encoded payloads: held in memory, or streamed rank by rank into a staging sender.

With a `trio_rl.transport.StagingSender` (the filesystem transport) and the default wire
encoder, each rank is encoded with `trio_rl.wire.encode_into` straight into its staged file,
one rank after the other, so the publisher's peak memory is one micro-batch's encoding
buffer, not the whole step. Any other sender gets every rank's payload as bytes (ZeroMQ frames
need them anyway).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from typing import BinaryIO, TypeAlias, overload

import attrs
import trio

from ..transport import Payload, Sender, StagingSender
from ..wire import MicroBatch, encode_into
from ..wire import encode as wire_encode
from ._release import Container
from ._workers import Workers

__all__ = ["Encoded", "InMemory", "Staged", "encode_in_memory", "encode_staged", "encode_step"]

#: One rank's MessagePack payload for its micro-batches (default `trio_rl.wire.encode`).
Encoder: TypeAlias = Callable[[Sequence[MicroBatch]], Payload]


@attrs.define(eq=False)
class InMemory:
    """Every rank's payload as bytes (sent with `Sender.send`)."""

    step: int
    payloads: list[Payload]

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self.payloads)

    async def deliver(self, sender: Sender) -> None:
        await sender.send(self.step, self.payloads)

    def outbox(self) -> Sequence[Payload]:
        return self.payloads

    def discard(self) -> None:
        """Nothing to undo."""

    def containers(self) -> list[Container]:
        return [self.payloads]


@attrs.define(eq=False)
class Staged:
    """Every rank's payload written to the sender's staging area (delivered by ``commit``)."""

    step: int
    sender: StagingSender
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    async def deliver(self, sender: Sender) -> None:
        await self.sender.commit(self.step)

    def outbox(self) -> Sequence[Payload]:
        """The staged bytes, opened one rank at a time as the outbox writer iterates."""
        return _StagedPayloads(self)

    def discard(self) -> None:
        """Blocking: remove the staged files (the step was not settled)."""
        self.sender.unstage(self.step)

    def containers(self) -> list[Container]:
        return []


Encoded: TypeAlias = InMemory | Staged


class _StagedPayloads(Sequence[Payload]):
    __slots__ = ("_staged",)

    def __init__(self, staged: Staged) -> None:
        self._staged = staged

    def __len__(self) -> int:
        return len(self._staged.sizes)

    @overload
    def __getitem__(self, index: int) -> Payload: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Payload]: ...
    def __getitem__(self, index: int | slice) -> Payload | Sequence[Payload]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._staged.sender.open_staged(self._staged.step, index)


def encode_in_memory(encode: Encoder, grid: Sequence[Sequence[MicroBatch]], step: int) -> InMemory:
    """Blocking (a worker): every rank's payload, one rank at a time, checking for cancellation
    in between; the wire encoder packs one micro-batch per C call, so the loop gets the GIL back
    between calls instead of waiting for a whole payload."""
    payloads: list[Payload] = []
    for rank_batches in grid:
        trio.from_thread.check_cancelled()
        if encode is wire_encode and not isinstance(rank_batches, list):
            # A lazy rank (`PackedRank`): stream it so one micro-batch is built at a time
            # (the same bytes; `wire.encode` would build them all first).
            buffer = io.BytesIO()
            encode_into(rank_batches, buffer)
            payloads.append(buffer.getvalue())
        else:
            payloads.append(encode(rank_batches))
    return InMemory(step, payloads)


def _encode_to(micro_batches: Sequence[MicroBatch], out: BinaryIO) -> int:
    return encode_into(micro_batches, out)


def encode_staged(sender: StagingSender, grid: Sequence[Sequence[MicroBatch]], step: int) -> Staged:
    """Blocking (a worker): encode each rank straight into its staged file, one rank at a
    time, checking for cancellation in between. On error or cancellation the ranks already
    staged are removed."""
    sizes: list[int] = []
    try:
        for rank, rank_batches in enumerate(grid):
            trio.from_thread.check_cancelled()
            sizes.append(sender.stage(step, rank, functools.partial(_encode_to, rank_batches)))
    except BaseException:
        sender.unstage(step)
        raise
    return Staged(step, sender, sizes)


async def encode_step(
    workers: Workers,
    encoder: Encoder,
    sender: Sender,
    grid: Sequence[Sequence[MicroBatch]],
    step: int,
) -> Encoded:
    """Encode ``grid`` in a worker: streamed into a staging sender's files when the encoder is
    the default one (`trio_rl.wire.encode`, whose bytes `encode_into` reproduces), else in
    memory. Cancellation: as `Workers.run` (a started encoding stops at its next rank)."""
    if encoder is wire_encode and isinstance(sender, StagingSender) and sender.can_stage:
        return await workers.run(encode_staged, sender, grid, step)
    return await workers.run(encode_in_memory, encoder, grid, step)
