"""pyzmq on trio: non-blocking socket operations that wait on the socket's file descriptor.

A zmq socket exposes one file descriptor that signals *edges*, not levels: it becomes readable
when the socket's state may have changed, and any call that touches the socket (a send, a
receive, reading ``ZMQ_EVENTS``) may consume that edge. So:

- ``ZMQ_EVENTS`` is checked before every wait on the fd, never after;
- trio allows one waiter per fd: one task at a time owns the fd wait, the other direction's
  waiter (if any) parks on a per-waiter event;
- every ``ZMQ_EVENTS`` read wakes each waiter whose direction it reports ready, so an edge that
  one task consumed is never lost to another; when the fd owner leaves, the other waiter is woken
  to take over;
- the operation itself is always ``NOBLOCK``; cancellation can only land while waiting, before a
  message has been taken off the socket, so a cancelled receive never loses a message.

No thread is used per message and the event loop never blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, overload

import trio
import trio_util
import zmq

__all__ = ["ZmqSocket"]

Frame = bytes | bytearray | memoryview | zmq.Frame


class _Wakeup(Protocol):
    """The typed face of :class:`trio_util.RepeatedEvent` (trio-util ships no annotations):
    ``set`` wakes every current waiter, nothing is latched."""

    def set(self) -> None: ...

    async def wait(self) -> None: ...


class _Waiter:
    __slots__ = ("event", "flag", "scope")

    def __init__(self, flag: int) -> None:
        self.flag = flag
        # Woken (not latched) when the socket may be ready: the waiter re-checks ZMQ_EVENTS
        # after each wake-up, with no await between its check and its next wait.
        self.event: _Wakeup = trio_util.RepeatedEvent()  # type: ignore[no-untyped-call]
        self.scope: trio.CancelScope | None = None

    def wake(self) -> None:
        self.event.set()
        if self.scope is not None:
            self.scope.cancel()


class ZmqSocket:
    """A trio wrapper that owns a ``zmq.Socket``.

    At most one send and one receive may be in progress at a time (a second concurrent one of
    the same direction raises `trio.BusyResourceError`). Every use of the socket must go
    through this wrapper, or an edge of the fd may be consumed behind its back.

    Args:
        sock: the socket to wrap; the wrapper closes it in `close`.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._fd: int = sock.FD
        self._waiters: dict[int, _Waiter] = {}
        self._busy: set[int] = set()
        self._fd_owner: _Waiter | None = None
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The wrapped socket, for options only (``setsockopt``, ``bind``, ``connect``)."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def events(self) -> int:
        """Read ``ZMQ_EVENTS``, waking any waiter whose direction is ready."""
        events = int(self._sock.get(zmq.EVENTS))
        for waiter in list(self._waiters.values()):
            if events & waiter.flag:
                waiter.wake()
        return events

    def _after_op(self) -> None:
        # The op may have consumed an edge the other direction's waiter needed.
        if self._waiters:
            self.events()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this zmq socket was closed")

    async def _wait(self, flag: int) -> None:
        waiter = _Waiter(flag)
        self._waiters[flag] = waiter
        try:
            while True:
                self._check_open()
                if self.events() & flag:
                    return
                if self._fd_owner is None:
                    self._fd_owner = waiter
                    try:
                        with trio.CancelScope() as waiter.scope:
                            await trio.lowlevel.wait_readable(self._fd)
                    finally:
                        waiter.scope = None
                        self._fd_owner = None
                        # Hand the fd over to the other direction's waiter.
                        for other in self._waiters.values():
                            if other is not waiter:
                                other.wake()
                else:
                    await waiter.event.wait()
        finally:
            del self._waiters[flag]

    def _claim(self, flag: int, what: str) -> None:
        self._check_open()
        if flag in self._busy:
            raise trio.BusyResourceError(f"another task is already {what} on this zmq socket")
        self._busy.add(flag)

    async def send_multipart(self, parts: Sequence[Frame], *, copy: bool = True) -> None:
        """Send one multipart message.

        With ``copy=False`` large frames are handed to zmq without copying: do not mutate their
        buffers afterwards. On a PUB socket this never waits (PUB drops messages past a
        subscriber's high-water mark instead).

        Cancellation: only while waiting for room to send; the message is then not sent.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._claim(zmq.POLLOUT, "sending")
        try:
            while True:
                self._check_open()
                try:
                    self._sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy)
                except zmq.Again:
                    await self._wait(zmq.POLLOUT)
                else:
                    break
                finally:
                    if not self._closed:
                        self._after_op()
        finally:
            self._busy.discard(zmq.POLLOUT)
        await trio.lowlevel.cancel_shielded_checkpoint()

    @overload
    async def recv_multipart(self, *, copy: Literal[True] = ...) -> list[bytes]: ...
    @overload
    async def recv_multipart(self, *, copy: Literal[False]) -> list[zmq.Frame]: ...
    async def recv_multipart(self, *, copy: bool = True) -> list[bytes] | list[zmq.Frame]:
        """Receive one multipart message (``zmq.Frame`` objects when ``copy=False``).

        Cancellation: only while waiting, before a message is taken off the socket, so a
        cancelled receive loses nothing: the message is there for the next receive.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._claim(zmq.POLLIN, "receiving")
        try:
            while True:
                self._check_open()
                try:
                    msg: list[bytes] | list[zmq.Frame]
                    if copy:
                        msg = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                    else:
                        msg = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    await self._wait(zmq.POLLIN)
                else:
                    break
                finally:
                    if not self._closed:
                        self._after_op()
        finally:
            self._busy.discard(zmq.POLLIN)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return msg

    def close(self, linger: int | None = 0) -> None:
        """Close the socket; tasks waiting on it get `trio.ClosedResourceError`.

        ``linger`` (ms) is how long zmq may keep delivering queued messages in the background
        (``None``: zmq's default, forever; ``Context.term`` waits for it).
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        for waiter in list(self._waiters.values()):
            waiter.wake()
        self._sock.close(linger=linger)
