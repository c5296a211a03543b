"""`ZmqSocket`: pyzmq on trio, over real sockets."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import trio
import trio.testing
import zmq

from trio_rl.transport import ZmqSocket

_counter = itertools.count()

Context = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _pair(
    ctx: zmq.Context[zmq.Socket[bytes]], a_type: int, b_type: int, hwm: int = 10
) -> tuple[ZmqSocket, ZmqSocket]:
    endpoint = f"inproc://test-{next(_counter)}"
    a = ctx.socket(a_type)
    b = ctx.socket(b_type)
    for s in (a, b):
        s.setsockopt(zmq.SNDHWM, hwm)
        s.setsockopt(zmq.RCVHWM, hwm)
    a.bind(endpoint)
    b.connect(endpoint)
    return ZmqSocket(a), ZmqSocket(b)


async def test_queued_messages_are_all_received_despite_the_edge_triggered_fd(ctx: Context) -> None:
    # Three messages queued before anyone waits: a naive wait_readable loop gets one and hangs.
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL)
    try:
        for i in range(3):
            await push.send_multipart([b"m%d" % i])
        with trio.fail_after(5):
            got = [await pull.recv_multipart() for _ in range(3)]
        assert got == [[b"m0"], [b"m1"], [b"m2"]]
    finally:
        push.close()
        pull.close()


async def test_a_receive_waits_for_a_later_send(ctx: Context) -> None:
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL)
    got: list[list[bytes]] = []
    try:
        async with trio.open_nursery() as nursery:

            async def receiver() -> None:
                got.append(await pull.recv_multipart())

            nursery.start_soon(receiver)
            await trio.sleep(0.05)
            assert got == []
            await push.send_multipart([b"late", b"second frame"])
        assert got == [[b"late", b"second frame"]]
    finally:
        push.close()
        pull.close()


async def test_cancelled_receives_lose_no_message(ctx: Context) -> None:
    """Receives cancelled constantly by tiny timeouts: every message still arrives, in order."""
    n = 2000
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL, hwm=10)
    got: list[int] = []
    cancelled = 0
    try:
        async with trio.open_nursery() as nursery:

            async def sender() -> None:
                for i in range(n):
                    await push.send_multipart([i.to_bytes(4, "big")])
                    if i % 7 == 0:
                        await trio.sleep(0.001)  # make some receives wait, to be cancelled

            nursery.start_soon(sender)
            with trio.fail_after(60):
                while len(got) < n:
                    with trio.move_on_after(0.0002) as scope:
                        [msg] = await pull.recv_multipart()
                        got.append(int.from_bytes(msg, "big"))
                    cancelled += scope.cancelled_caught
        assert got == list(range(n))
        assert cancelled > 0  # the receives really were cancelled
    finally:
        push.close()
        pull.close()


async def test_duplex_send_and_receive_tasks_share_one_socket(ctx: Context) -> None:
    """A send task and a receive task per PAIR socket, both ways: nobody's edge is lost."""
    n = 3000
    a, b = _pair(ctx, zmq.PAIR, zmq.PAIR, hwm=5)
    received: dict[str, list[int]] = {"a": [], "b": []}
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def send(sock: ZmqSocket) -> None:
                    for i in range(n):
                        await sock.send_multipart([i.to_bytes(4, "big")])

                async def recv(sock: ZmqSocket, name: str) -> None:
                    for _ in range(n):
                        [msg] = await sock.recv_multipart()
                        received[name].append(int.from_bytes(msg, "big"))

                for sock, name in ((a, "a"), (b, "b")):
                    nursery.start_soon(send, sock)
                    nursery.start_soon(recv, sock, name)
        assert received["a"] == list(range(n))
        assert received["b"] == list(range(n))
    finally:
        a.close()
        b.close()


async def test_send_waits_for_room_and_can_be_cancelled_without_sending(ctx: Context) -> None:
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL, hwm=1)
    try:
        sent = 0
        with trio.move_on_after(0.3) as scope:
            while True:
                await push.send_multipart([sent.to_bytes(4, "big")])
                sent += 1
        assert scope.cancelled_caught  # PUSH blocked once the pipes were full
        got = []
        with trio.fail_after(5):
            for _ in range(sent):
                [msg] = await pull.recv_multipart()
                got.append(int.from_bytes(msg, "big"))
        assert got == list(range(sent))
        with trio.move_on_after(0.1):
            await pull.recv_multipart()
            pytest.fail("the cancelled send must not have been sent")
    finally:
        push.close()
        pull.close()


async def test_close_wakes_a_parked_receiver_with_closed_resource_error(ctx: Context) -> None:
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL)
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:

                async def parked() -> None:
                    with pytest.raises(trio.ClosedResourceError):
                        await pull.recv_multipart()

                nursery.start_soon(parked)
                await trio.sleep(0.05)
                pull.close()
        assert pull.closed
        assert pull.socket.closed
        with pytest.raises(trio.ClosedResourceError):
            await pull.recv_multipart()
    finally:
        push.close()
        pull.close()


async def test_two_concurrent_receives_are_refused(ctx: Context) -> None:
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull.recv_multipart)
            await trio.sleep(0.02)
            with pytest.raises(trio.BusyResourceError, match="already receiving"):
                await pull.recv_multipart()
            nursery.cancel_scope.cancel()
    finally:
        push.close()
        pull.close()


async def test_large_frames_round_trip_without_copy(ctx: Context) -> None:
    push, pull = _pair(ctx, zmq.PUSH, zmq.PULL, hwm=2)
    payloads = [bytes([i]) * (8 << 20) + i.to_bytes(4, "big") for i in range(4)]
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    for p in payloads:
                        await push.send_multipart([b"h", memoryview(p)], copy=False)

                nursery.start_soon(sender)
                for p in payloads:
                    header, frame = await pull.recv_multipart(copy=False)
                    assert header.bytes == b"h"
                    assert frame.buffer == p
    finally:
        push.close()
        pull.close()


async def test_an_events_read_by_another_task_wakes_the_parked_receiver(ctx: Context) -> None:
    """Pitfall: reading ZMQ_EVENTS consumes the fd's edge. Through the wrapper, the read wakes
    the receiver it concerns instead of leaving it parked on an fd that will never signal."""
    a, b = _pair(ctx, zmq.PAIR, zmq.PAIR)
    got: list[list[bytes]] = []
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:

                async def parked() -> None:
                    got.append(await b.recv_multipart())

                nursery.start_soon(parked)
                await trio.testing.wait_all_tasks_blocked()
                # No schedule point from here on: the loop cannot poll the fd before we read
                # EVENTS, which drains the signal the parked receiver waits for.
                a.socket.send(b"hello")
                assert b.events() & zmq.POLLIN
                assert got == []
        assert got == [[b"hello"]]
    finally:
        a.close()
        b.close()
