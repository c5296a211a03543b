"""The ZeroMQ transport (the reference's wire protocol, on trio).

- Data: the sender binds a PUB socket at ``tcp://host:port`` and sends one two-frame message
  per rank and step, ``[b"data_rank|<R>|", payload]``, byte for byte prime-rl's frames. The
  trailing ``|`` keeps rank 1's prefix subscription from matching rank 10.
- Step markers: right before each data message the sender sends ``[b"step_rank|<R>|",
  b"<S>"]`` (S in ASCII) on a topic of its own. A prime-rl receiver subscribes to
  ``data_rank|<R>|`` only, and PUB filters by subscription before anything is queued, so it
  never receives a marker and reads exactly the reference's messages. A trio-rl receiver
  subscribes to the markers too and numbers the data message that follows a marker by it; an
  unmarked message (from a prime-rl sender) is numbered by arrival order. An older trio-rl
  sender's tagged topic ``data_rank|<R>|<S>`` is still read.
- READY barrier: the sender binds a PULL socket at ``tcp://host:port+1``. Each trainer rank
  subscribes its SUB socket to its topic, connects, and sends its rank as ASCII over a PUSH
  socket each time its SUB connection's handshake succeeds (so again when a restarted sender
  binds). Before its first send the sender waits (up to ``ready_timeout``) until it has heard
  ``world_size`` distinct ranks.
- End of stream: `ZmqSender.end_stream(S)` sends ``[b"end_rank|<R>|", b"<S>"]`` to every
  rank (S in ASCII: no step ``>= S`` will come). prime-rl receivers, subscribed to
  ``data_rank|<R>|`` only, never see it either; trio-rl receivers subscribe to all three topics.
- Sender restarts: a restarted sender (a resumed orchestrator) may start again at an older
  step; a receiver drops tagged steps it has already returned and raises `TransportError` at
  a step past the one it expects (messages were lost).
- A slow or dead receiver never blocks the sender: PUB queues up to ``hwm`` messages per
  subscriber (plus what the kernel's socket buffers hold) and silently drops newer messages
  past that. The orchestrator's ship gate keeps at most ``max_lag + 1`` steps unconsumed per
  rank; a trio-rl receiver holds two messages per step (marker and data), so ``2 x (max_lag +
  1)`` must stay below ``hwm``. A dropped message is reported by the receiver at the next
  marked step that arrives.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any, NoReturn

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import InvalidArgumentError
from . import _wait
from ._base import Payload, ReceivedPayload, Sender, SteppedReceiver
from ._errors import EndOfStreamError, TransportError, TransportTimeoutError
from ._wait import Wait, timeout_seconds
from ._zmq import ZmqSocket

__all__ = ["end_topic", "free_port_pair", "ZmqReceiver", "ZmqSender", "rank_topic", "step_topic"]

logger = logging.getLogger("trio_rl.transport")


def rank_topic(rank: int) -> bytes:
    """The topic frame of rank ``rank``'s data messages."""
    return b"data_rank|" + str(rank).encode() + b"|"


def step_topic(rank: int) -> bytes:
    """The topic frame of rank ``rank``'s step markers (``[step_topic(R), b"<S>"]``, sent right
    before the data message of step S; prime-rl's receivers never subscribe to it)."""
    return b"step_rank|" + str(rank).encode() + b"|"


def end_topic(rank: int) -> bytes:
    """The topic frame of rank ``rank``'s end-of-stream message."""
    return b"end_rank|" + str(rank).encode() + b"|"


def _endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def _check_port(port: int) -> None:
    if not 0 < port < 65535:
        raise InvalidArgumentError(f"port must be in 1..65534 (port + 1 is used too), got {port}")


async def _term(ctx: zmq.Context[Any]) -> None:
    # Context.term blocks until every socket's linger has expired: run it in a thread, shielded,
    # so a cancelled close still releases the context (the wait is bounded by the linger).
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(ctx.term)


def _fresh_context(entered: bool, what: str) -> zmq.Context[Any]:
    """The context of a sender or receiver being entered; entering one twice is a bug."""
    if entered:
        raise RuntimeError(f"a {what} can be entered only once")
    return zmq.Context()


class ZmqSender(Sender):
    """Publishes each step's payloads to the trainer ranks over ZeroMQ.

    Sockets are bound when entering ``async with``.

    Args:
        world_size: the number of trainer ranks.
        host: the interface to bind (``"*"`` for all).
        port: the data port; the READY barrier uses ``port + 1``.
        hwm: the send and receive high-water marks, in messages.
        ready_timeout: seconds the first send waits for every rank's READY before raising
            `TransportTimeoutError`.
        linger: seconds closing may keep delivering queued messages in the background.
    """

    def __init__(
        self,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        port: int = 5555,
        hwm: int = 10,
        ready_timeout: float = 60.0,
        linger: float = 5.0,
    ) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
        _check_port(port)
        if hwm < 1:
            raise InvalidArgumentError(f"hwm must be >= 1, got {hwm}")
        self._world_size = world_size
        self._host = host
        self._port = port
        self._hwm = hwm
        self._ready_timeout = ready_timeout
        self._linger_ms = int(linger * 1000)
        self._ctx: zmq.Context[Any] | None = None
        self._pub: ZmqSocket | None = None
        self._ready_sock: ZmqSocket | None = None
        self._ready_ranks: set[int] = set()
        self._ignored_ready = 0
        self._last_step: int | None = None
        self._ended_at: int | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def data_endpoint(self) -> str:
        return _endpoint(self._host, self._port)

    @property
    def ready_endpoint(self) -> str:
        return _endpoint(self._host, self._port + 1)

    @property
    def ready_ranks(self) -> frozenset[int]:
        """The ranks heard from so far in the READY barrier."""
        return frozenset(self._ready_ranks)

    async def __aenter__(self) -> ZmqSender:
        """Bind both sockets; `TransportError` if a port is taken.

        Cancellation: a checkpoint on entry; if it raises `trio.Cancelled` nothing was bound.
        """
        await trio.lowlevel.checkpoint()
        ctx = self._ctx = _fresh_context(self._closed or self._ctx is not None, "ZmqSender")
        try:
            pub = ctx.socket(zmq.PUB)
            self._pub = ZmqSocket(pub)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pull = ctx.socket(zmq.PULL)
            self._ready_sock = ZmqSocket(pull)
            pull.setsockopt(zmq.RCVHWM, self._hwm)
            for sock, endpoint in ((pub, self.data_endpoint), (pull, self.ready_endpoint)):
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    raise TransportError(f"cannot bind {endpoint}: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise
        return self

    def _sockets(self) -> tuple[ZmqSocket, ZmqSocket]:
        if self._closed:
            raise trio.ClosedResourceError("this ZmqSender is closed")
        if self._pub is None or self._ready_sock is None:
            raise RuntimeError("use ZmqSender as `async with ZmqSender(...) as s`")
        return self._pub, self._ready_sock

    @property
    def is_ready(self) -> bool:
        return len(self._ready_ranks) == self._world_size

    async def wait_ready(self) -> None:
        """Wait until every rank ``0..world_size-1`` has sent READY (done once, for good).

        Messages that are not a rank in range are ignored (and counted in the timeout error);
        duplicates count once. Logs at WARNING every 10 s the ranks it still waits for, with
        the time left; raises `TransportTimeoutError` naming the missing ranks after
        ``ready_timeout`` seconds.

        Cancellation: safe; the ranks heard so far are kept for the next call.
        """
        _, ready = self._sockets()
        start = trio.current_time()
        deadline = start + self._ready_timeout
        next_log = start + _wait.WAIT_LOG_INTERVAL
        while not self.is_ready:
            now = trio.current_time()
            if now >= deadline:
                raise TransportTimeoutError(
                    f"READY barrier on {self.ready_endpoint}: ranks {self._missing()} of "
                    f"{self._world_size} did not report within {self._ready_timeout:g} s"
                    + (
                        f" ({self._ignored_ready} malformed READY messages ignored)"
                        if self._ignored_ready
                        else ""
                    )
                )
            if now >= next_log:
                logger.warning(
                    "READY barrier on %s: still waiting for ranks %s of %d after %.0f s, "
                    "giving up in %.0f s",
                    self.ready_endpoint,
                    self._missing(),
                    self._world_size,
                    now - start,
                    deadline - now,
                )
                next_log = now + _wait.WAIT_LOG_INTERVAL
            # a cancelled receive takes nothing off the socket: waking up to log is free
            with trio.move_on_at(min(deadline, next_log)):
                [msg, *_] = await ready.recv_multipart()
                try:
                    rank = int(msg.decode("ascii"))
                except (UnicodeDecodeError, ValueError):
                    rank = -1
                if 0 <= rank < self._world_size:
                    self._ready_ranks.add(rank)
                else:
                    self._ignored_ready += 1

    def _missing(self) -> list[int]:
        return sorted(set(range(self._world_size)) - self._ready_ranks)

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        """Publish ``payloads[r]`` to rank ``r``; the first call waits for the READY barrier.

        Each data message, ``[rank_topic(r), payloads[r]]``, is the reference's, byte for byte;
        a step marker ``[step_topic(r), b"<step>"]`` goes right before it (a reference
        receiver is never sent one: it does not subscribe to it). Steps must be consecutive after
        the first (which may be any step: a restarted sender resumes where its checkpoint
        says, and receivers drop the steps they already have); after `end_stream` a send raises
        `RuntimeError`. Never blocks on a slow or dead
        receiver: past its high-water mark PUB drops the message. Payloads are sent without
        copying; do not mutate their buffers afterwards.

        Cancellation: all or nothing. If `trio.Cancelled` is raised (while waiting for the
        barrier, or cancelled on entry), nothing of this step was sent. Otherwise the step is
        published to every rank, shielded (it never waits), and the call returns normally.
        """
        if len(payloads) != self._world_size:
            raise InvalidArgumentError(
                f"step {step}: got {len(payloads)} payloads for world_size {self._world_size}"
            )
        mark = str(step).encode("ascii")
        messages: list[list[Payload]] = []
        for rank, payload in enumerate(payloads):
            messages += [[step_topic(rank), mark], [rank_topic(rank), payload]]
        await self._publish(step, messages)

    async def end_stream(self, step: int) -> None:
        """Tell every rank that no step ``>= step`` will come: ``[b"end_rank|<R>|", b"<step>"]``.

        ``step`` must be the step after the last one sent (or any step if none was sent); the
        first call waits for the READY barrier like `send`. A receiver that counted a different
        step raises `TransportError` (messages were dropped), otherwise `EndOfStreamError`. Like
        data, the message is dropped for a receiver more than its high-water mark behind.
        Later sends raise `RuntimeError`.

        Cancellation: all or nothing, like `send`.
        """
        end = str(step).encode("ascii")
        await self._publish(step, [[end_topic(rank), end] for rank in range(self._world_size)])
        self._ended_at = step

    async def _publish(self, step: int, messages: list[list[Payload]]) -> None:
        pub, _ = self._sockets()
        if self._ended_at is not None:
            raise RuntimeError(f"the stream was ended at step {self._ended_at} (end_stream)")
        if step < 0:
            raise InvalidArgumentError(f"step must be >= 0, got {step}")
        if self._last_step is not None and step != self._last_step + 1:
            raise InvalidArgumentError(
                f"ZeroMQ steps must be consecutive (receivers count them): "
                f"got step {step} after step {self._last_step}"
            )
        if not self.is_ready:
            await self.wait_ready()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        # Reading ZMQ_EVENTS makes libzmq process the subscribers' pending "I have read up to
        # here" notices now; a plain send processes them at most about once a millisecond, so
        # back-to-back sends would otherwise see a stale count and drop below the HWM.
        pub.events()
        # A step goes to every rank or to none: a cancellation between ranks would leave the
        # ranks' step counts out of line for good. Shielding is safe: PUB never waits.
        with trio.CancelScope(shield=True):
            for message in messages:
                await pub.send_multipart(message, copy=False)
        self._last_step = step

    async def aclose(self) -> None:
        """Close both sockets and the context.

        Queued messages get up to ``linger`` seconds to be delivered.

        Cancellation: that wait runs in a thread and is shielded (it is bounded by
        ``linger``), so closing always completes.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._ready_sock is not None:
            self._ready_sock.close(linger=0)
        if self._pub is not None:
            self._pub.close(linger=self._linger_ms)
        if self._ctx is not None:
            await _term(self._ctx)
        else:
            await trio.lowlevel.checkpoint()


class ZmqReceiver(SteppedReceiver):
    """Receives one rank's payloads from a `ZmqSender`.

    Entering ``async with`` subscribes and connects the SUB socket (the sender may come up
    later; zmq keeps reconnecting) and starts a background task, owned by the ``async with``,
    that sends READY each time the SUB connection's handshake succeeds (so the subscription is
    on its way before READY), whether or not `receive` is called yet. If that task fails, the
    error cancels the ``async with`` body and surfaces at its exit.

    A sender may die and be restarted (it binds the same ports): zmq reconnects, READY is sent
    again for the new sender's barrier, and the steps the new sender sends again (it resumes
    from its checkpoint, at or before `next_step`) are dropped, so `receive` still returns
    every step once, in order.

    Args:
        rank: this trainer's data-parallel rank.
        host: the sender's host.
        port: the sender's data port (READY goes to ``port + 1``).
        hwm: the receive and send high-water marks, in messages.
        start_step: the step number of the first message received.
        timeout: seconds one `receive` waits for its step before raising
            `TransportTimeoutError` (``None``: until cancelled). A line is logged every 60 s
            while it waits.
    """

    def __init__(
        self,
        rank: int,
        *,
        host: str = "127.0.0.1",
        port: int = 5555,
        hwm: int = 10,
        start_step: int = 0,
        timeout: float | None = None,
    ) -> None:
        if rank < 0:
            raise InvalidArgumentError(f"rank must be >= 0, got {rank}")
        if start_step < 0:
            raise InvalidArgumentError(f"start_step must be >= 0, got {start_step}")
        _check_port(port)
        super().__init__(rank, start_step)
        self._host = host
        self._port = port
        self._hwm = hwm
        self._topic = rank_topic(rank)
        self._step_topic = step_topic(rank)
        self._end_topic = end_topic(rank)
        #: The step of the last marker read whose data message has not been read yet.
        self._marked: int | None = None
        self._ended_at: int | None = None
        self._timeout = timeout_seconds(timeout)
        self._ctx: zmq.Context[Any] | None = None
        self._sub: ZmqSocket | None = None
        self._monitor: ZmqSocket | None = None
        self._push: ZmqSocket | None = None
        self._announced = trio.Event()
        self._tasks = AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._closed = False

    @property
    def data_endpoint(self) -> str:
        return _endpoint(self._host, self._port)

    async def __aenter__(self) -> ZmqReceiver:
        """Subscribe, connect and start the READY task (the sender may come up later).

        Cancellation: a checkpoint on entry; if it raises `trio.Cancelled` nothing was opened.
        """
        await trio.lowlevel.checkpoint()
        ctx = self._ctx = _fresh_context(self._closed or self._ctx is not None, "ZmqReceiver")
        try:
            sub = ctx.socket(zmq.SUB)
            self._sub = ZmqSocket(sub)
            sub.setsockopt(zmq.RCVHWM, self._hwm)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.setsockopt(zmq.SUBSCRIBE, self._step_topic)
            sub.setsockopt(zmq.SUBSCRIBE, self._end_topic)
            self._monitor = ZmqSocket(sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            sub.connect(self.data_endpoint)
            push = ctx.socket(zmq.PUSH)
            self._push = ZmqSocket(push)
            push.setsockopt(zmq.SNDHWM, self._hwm)
            self._nursery = await self._tasks.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._announce, self._sub, self._monitor, self._push)
        except BaseException:
            await self.aclose()
            raise
        return self

    def _require_sub(self) -> ZmqSocket:
        if self._closed:
            raise trio.ClosedResourceError("this ZmqReceiver is closed")
        if self._sub is None:
            raise RuntimeError("use ZmqReceiver as `async with ZmqReceiver(...) as r`")
        return self._sub

    async def _announce(self, sub: ZmqSocket, monitor: ZmqSocket, push: ZmqSocket) -> None:
        # One READY per successful handshake: the first sender's barrier, and a restarted
        # sender's (zmq reconnects by itself; without a new READY its barrier would time out).
        ready = str(self._rank).encode("ascii")
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                continue
            if not self._announced.is_set():
                # Connect only now: READY then travels a fresh connection, set up after the
                # subscription was sent on the data connection, so it cannot overtake it in
                # practice. On a reconnect the PUSH queues READY until it is reconnected too.
                push.socket.connect(_endpoint(self._host, self._port + 1))
            await push.send_multipart([ready])
            self._announced.set()

    @property
    def announced(self) -> bool:
        """Whether READY has been sent."""
        return self._announced.is_set()

    async def announce(self) -> None:
        """Wait until the data connection is up and READY has been sent.

        Cancellation: safe; READY is sent by the background task regardless.
        """
        self._require_sub()
        await self._announced.wait()

    async def receive(self) -> ReceivedPayload:
        """Wait for this rank's step `next_step` and return it.

        The payload is a read-only memoryview of the received zmq frame (no copy). A data
        message is numbered by the step marker before it; one marked with an earlier step (sent
        again by a restarted sender) is dropped; an unmarked one (from a prime-rl sender) is
        numbered `next_step`. Raises `TransportTimeoutError`
        after ``timeout`` seconds without this step (logging every 60 s while it waits),
        `EndOfStreamError` at the sender's end message (and on every later call), or
        `TransportError` if a message names a later step than `next_step` or the end message
        another step (messages were lost, or the sender and this receiver started at
        different steps).

        Cancellation: safe; a receive that raises `trio.Cancelled` has taken no message for
        `next_step` off the socket (it may have dropped duplicates of earlier steps).
        """
        sub = self._require_sub()
        step = self._next_step
        source = f"{self.data_endpoint} rank {self._rank} step {step}"
        if self._ended_at is not None:
            await trio.lowlevel.checkpoint()
            raise EndOfStreamError(
                f"{source}: the stream ended before step {self._ended_at}", self._ended_at
            )
        wait = Wait(self._timeout, f"{source}: no message from the sender")
        while True:
            frames = await self._next_message(sub, wait)
            topic = frames[0].bytes
            if len(frames) == 2 and topic == self._end_topic:
                self._check_end(frames[1].bytes, step, source)
            if len(frames) == 2 and topic == self._step_topic:
                self._marked = _ascii_step(frames[1].bytes, f"{source}: step marker")
                continue
            tag = topic[len(self._topic) :]
            if len(frames) != 2 or not topic.startswith(self._topic) or not tag.isdigit():
                if not (len(frames) == 2 and topic == self._topic):
                    raise TransportError(
                        f"{source}: malformed message: expected [{self._topic!r}, payload], "
                        f"got {len(frames)} frame(s) starting {topic[:32]!r}"
                    )
                # marked by the message before it, or (a prime-rl sender) by arrival order
                tagged = step if self._marked is None else self._marked
            else:
                tagged = int(tag)  # an older trio-rl sender's step in the topic
            self._marked = None
            if tagged == step:
                break
            if tagged > step:
                raise TransportError(
                    f"{source}: expected step {step}, got step {tagged}: {tagged - step} "
                    "step(s) were lost (dropped past the high-water mark, or the sender "
                    "started past this receiver's step)"
                )
            logger.debug("%s: dropped step %d, sent again by a restarted sender", source, tagged)
        self._next_step = step + 1
        return ReceivedPayload(step=step, rank=self._rank, data=frames[1].buffer, source=source)

    async def _next_message(self, sub: ZmqSocket, wait: Wait) -> list[zmq.Frame]:
        while True:
            # A cancelled receive takes nothing off the socket, so waking up to log is free.
            with trio.move_on_after(wait.until_next_event()):
                return await sub.recv_multipart(copy=False)

    def _check_end(self, raw: bytes, step: int, source: str) -> NoReturn:
        end = _ascii_step(raw, f"{source}: end-of-stream message")
        self._ended_at = end
        if end != step:
            raise TransportError(
                f"{source}: the sender ended the stream before step {end}, but this receiver "
                f"counted its next step as {step}: "
                + (
                    f"{end - step} message(s) were dropped"
                    if end > step
                    else "sender and receiver started at different steps"
                )
            )
        raise EndOfStreamError(f"{source}: the stream ended before step {end}", end)

    async def aclose(self) -> None:
        """Stop the READY task, close the sockets (dropping anything queued) and the context.

        Call it from the task that entered (``async with`` does).

        Cancellation: closing always completes (the context's release is shielded).
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        try:
            await self._tasks.aclose()
        finally:
            for sock in (self._monitor, self._push, self._sub):
                if sock is not None:
                    sock.close(linger=0)
            if self._ctx is not None:
                await _term(self._ctx)


def _ascii_step(raw: bytes, what: str) -> int:
    """A step number sent in ASCII; `TransportError` naming ``what`` if it is not one."""
    if not raw.isdigit():
        raise TransportError(f"{what} is malformed: {raw[:32]!r} is not a step number")
    return int(raw)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` (data and READY) are both free on ``host``.

    Free *now*: another process may take them before they are bound, so use it for tests and
    demos, not to coordinate a production deployment.
    """
    for _ in range(200):
        with socket.socket() as first:
            first.bind((host, 0))
            port: int = first.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise TransportError(f"no pair of adjacent free ports found on {host}")
