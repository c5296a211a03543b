"""The sender and receiver interfaces every batch transport implements.

A transport moves opaque payload bytes, one per (step, rank); it knows nothing of their format
(decoding belongs to the trainer's `trio_rl.trainer.BatchReceiver`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import BinaryIO, Protocol, TypeAlias, runtime_checkable

import attrs
import trio

from ..errors import InvalidArgumentError

__all__ = ["Payload", "ReceivedPayload", "Receiver", "Sender", "StagingSender"]

#: What a sender accepts and a receiver returns: any contiguous bytes-like buffer.
Payload: TypeAlias = bytes | bytearray | memoryview


@attrs.frozen
class ReceivedPayload:
    """One rank's payload of one step.

    ``source`` names where it came from (a file path, or the ZeroMQ endpoint, rank and step),
    so a decoding error can say which payload was bad.
    """

    step: int
    rank: int
    data: Payload
    source: str


def _check_same_limiter(transport: Sender | Receiver, limiter: trio.CapacityLimiter) -> None:
    own = transport.limiter
    if own is not None and own is not limiter:
        raise InvalidArgumentError(
            f"{type(transport).__name__} was given its own CapacityLimiter "
            f"({own.total_tokens} tokens); pass the pipeline's limiter to it instead (one "
            "limiter for every worker thread of the pipeline)"
        )


class Sender(trio.abc.AsyncResource):
    """Sends each step's payloads, one per data-parallel rank. Use as ``async with``.

    Implementations: `FileSender`, `ZmqSender`, `MemorySender`.
    """

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks; every `send` carries exactly this many payloads."""

    @abc.abstractmethod
    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        """Send ``payloads[r]`` to rank ``r`` for ``step``.

        Raises `~trio_rl.errors.InvalidArgumentError` (a ``ValueError``) if ``len(payloads) !=
        world_size``. Payload buffers must not be mutated while the send is in progress
        (zero-copy transports may still read them).

        Delivery: when `send` returns, the step is delivered: handed to the transport for every
        rank (written and renamed into place, published, or queued), and a receiver of any rank
        can get it without the sender doing anything more. The publisher books a step as
        shipped on that guarantee.

        Cancellation: all or nothing. A send that raises `trio.Cancelled` delivered the step
        to no rank; a send that returns delivered it to every rank, even if a cancellation
        arrived meanwhile (the `trio.Cancelled` then comes at the caller's next checkpoint).
        After any other error the step may have reached some ranks: send it again (a repeated
        step replaces the earlier one, or is skipped by receivers already past it).
        """

    @property
    def limiter(self) -> trio.CapacityLimiter | None:
        """The limiter this transport's worker threads borrow from (``None``: it runs none,
        or has not been given one yet)."""
        return None

    def use_limiter(self, limiter: trio.CapacityLimiter) -> None:
        """Borrow worker threads from ``limiter``, the pipeline's one limiter, from now on.

        The publisher passes its limiter down with this, so the file writes count against the
        same thread budget as packing, encoding and checkpointing. A transport constructed with
        a different limiter raises `~trio_rl.errors.InvalidArgumentError` (two budgets is the
        misconfiguration this catches). The default does nothing: the transport runs no worker
        threads.
        """
        _check_same_limiter(self, limiter)

    @abc.abstractmethod
    async def end_stream(self, step: int) -> None:
        """Tell every rank that the stream ended: no step ``>= step`` will come.

        ``step`` is the step after the last one sent (the step a next `send` would have had).
        A receiver waiting for ``step`` or later then raises `EndOfStreamError` (and
        ``BatchReceiver``'s ``async for`` ends). Later sends raise `RuntimeError`.

        Cancellation: if `trio.Cancelled` is raised, the stream is not known to have ended:
        call `end_stream` again (receivers may already have seen the end).
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every resource; idempotent. Later sends raise `trio.ClosedResourceError`.

        Cancellation: closing always completes (what it must wait for is shielded).
        """


class Receiver(trio.abc.AsyncResource):
    """Receives one rank's payloads, step after step. Use as ``async with``.

    Implementations: `FileReceiver`, `ZmqReceiver`, `MemoryReceiver`. Not to be confused with
    the trainer's `trio_rl.trainer.BatchReceiver`, which wraps one of these and decodes what it
    receives.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """The data-parallel rank whose payloads this receives."""

    @property
    @abc.abstractmethod
    def next_step(self) -> int:
        """The step the next `receive` returns."""

    @abc.abstractmethod
    async def receive(self) -> ReceivedPayload:
        """Wait for and return the payload of `next_step`, then advance `next_step` by one.

        Raises `EndOfStreamError` if the sender ended the stream at or before `next_step`.

        Cancellation: a receive that raises `trio.Cancelled` has not advanced `next_step` and
        has consumed nothing: the payload it was waiting for (or reading) is returned by the
        next `receive`, of this receiver or, for transports that keep payloads until they are
        acknowledged, of a new receiver of the same rank.
        """

    @property
    def limiter(self) -> trio.CapacityLimiter | None:
        """The limiter this transport's worker threads borrow from (``None``: it runs none,
        or has not been given one yet)."""
        return None

    def use_limiter(self, limiter: trio.CapacityLimiter) -> None:
        """Borrow worker threads from ``limiter`` from now on (as `Sender.use_limiter`; the
        trainer's `BatchReceiver` passes its decoding limiter down with this)."""
        _check_same_limiter(self, limiter)

    async def ack(self, step: int) -> None:
        """Acknowledge that the payload of ``step`` (and every earlier one) was consumed.

        A transport that keeps payloads until they are consumed (the filesystem one) may
        forget them now; a new receiver never returns an acknowledged step again. The default
        does nothing.

        Cancellation: like a checkpoint: if `trio.Cancelled` is raised, the step may still be
        unacknowledged; callers that must not lose an acknowledgement shield it.
        """
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every resource; idempotent. Later receives raise `trio.ClosedResourceError`.

        Cancellation: closing always completes (what it must wait for is shielded).
        """


class SteppedReceiver(Receiver):
    """A receiver that knows its step from the start: it keeps its rank and the step of its
    next receive, which `receive` advances (``self._next_step = step + 1``)."""

    def __init__(self, rank: int, next_step: int) -> None:
        self._rank = rank
        self._next_step = next_step

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def next_step(self) -> int:
        return self._next_step


@runtime_checkable
class StagingSender(Protocol):
    """A sender that can take a step one rank at a time (`FileSender` is one).

    The publisher streams each rank's encoding straight into `stage`, then calls `commit` for
    the step, so it never holds more than one rank's encoding buffer.
    """

    @property
    def world_size(self) -> int: ...

    @property
    def can_stage(self) -> bool:
        """Whether to use `stage` + `commit` for a step (else `Sender.send`)."""

    def stage(self, step: int, rank: int, write: Callable[[BinaryIO], object]) -> int:
        """Blocking: write rank ``rank``'s payload of ``step`` through ``write(file)``, out of
        receivers' sight; return its size in bytes."""

    def open_staged(self, step: int, rank: int) -> Payload:
        """Blocking: the staged bytes of rank ``rank``, before `commit` (e.g. memory-mapped)."""

    def unstage(self, step: int) -> None:
        """Blocking: drop every staged file of ``step`` (it will not be committed)."""

    async def commit(self, step: int) -> None:
        """Deliver the staged step, with `Sender.send`'s delivery and cancellation guarantees;
        idempotent (call again after a failure)."""
