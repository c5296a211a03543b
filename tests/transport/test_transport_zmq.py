"""The ZeroMQ transport over real TCP sockets on loopback (real clock)."""

from __future__ import annotations

import logging
import warnings
from contextlib import AsyncExitStack

import pytest
import trio
import zmq

from operations_waits import documented
from trio_rl.transport import (
    TransportError,
    TransportTimeoutError,
    ZmqReceiver,
    ZmqSender,
    ZmqSocket,
    _wait,
    free_port_pair,
    rank_topic,
)


def payload(step: int, rank: int, size: int) -> bytes:
    head = step.to_bytes(4, "big") + rank.to_bytes(4, "big")
    body = bytes((step * 31 + rank * 7 + i) % 251 for i in range(256))
    return (head + body * (size // 256 + 1))[:size]


def ident(data: object) -> tuple[int, int]:
    raw = bytes(memoryview(data)[:8])  # type: ignore[arg-type]
    return int.from_bytes(raw[:4], "big"), int.from_bytes(raw[4:], "big")


async def test_several_ranks_receive_their_own_multi_mib_payloads_in_order() -> None:
    port, world, steps, size = free_port_pair(), 3, 4, 2 << 20
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(
            ZmqSender(world, port=port, hwm=8, ready_timeout=10)
        )
        receivers = [
            await stack.enter_async_context(ZmqReceiver(r, port=port, hwm=8)) for r in range(world)
        ]
        got: dict[int, list[tuple[int, bytes]]] = {r: [] for r in range(world)}
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def receive(rx: ZmqReceiver) -> None:
                    for _ in range(steps):
                        item = await rx.receive()
                        assert item.rank == rx.rank
                        assert (
                            item.source == f"tcp://127.0.0.1:{port} rank {rx.rank} step {item.step}"
                        )
                        got[rx.rank].append((item.step, bytes(item.data)))

                for rx in receivers:
                    nursery.start_soon(receive, rx)
                for step in range(steps):
                    await sender.send(step, [payload(step, r, size + r) for r in range(world)])
        for r in range(world):
            assert got[r] == [(s, payload(s, r, size + r)) for s in range(steps)]


async def test_rank_topics_do_not_prefix_match() -> None:
    assert rank_topic(1) == b"data_rank|1|"
    assert not rank_topic(10).startswith(rank_topic(1))


async def test_sender_waits_for_late_receivers_at_the_barrier() -> None:
    port = free_port_pair()
    async with ZmqSender(2, port=port, ready_timeout=10) as sender:
        sent = trio.Event()
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await sender.send(0, [b"zero", b"one"])
                sent.set()

            nursery.start_soon(send)
            await trio.sleep(0.2)
            assert not sent.is_set()  # nobody is there yet
            async with ZmqReceiver(1, port=port) as r1:
                with trio.move_on_after(0.2):
                    await r1.receive()  # announces; no data before the barrier
                assert not sent.is_set()
                assert sender.ready_ranks == {1}
                async with ZmqReceiver(0, port=port) as r0:
                    with trio.fail_after(10):
                        got0 = await r0.receive()
                        await sent.wait()
                        got1 = await r1.receive()
        assert (got0.step, bytes(got0.data)) == (0, b"zero")
        assert (got1.step, bytes(got1.data)) == (0, b"one")


async def test_receivers_that_start_before_the_sender_connect_when_it_binds() -> None:
    port = free_port_pair()
    async with ZmqReceiver(0, port=port, start_step=5) as rx:
        got = []
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                got.append(await rx.receive())
                done.set()

            done = trio.Event()
            nursery.start_soon(receive)
            await trio.sleep(0.3)  # zmq keeps retrying the connection meanwhile
            async with ZmqSender(1, port=port, ready_timeout=10) as sender:
                with trio.fail_after(10):
                    await sender.send(5, [b"five"])
                    await done.wait()
        assert [(g.step, bytes(g.data)) for g in got] == [(5, b"five")]


async def test_barrier_timeout_names_the_missing_ranks_and_ignores_junk(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_wait, "WAIT_LOG_INTERVAL", 0.2)  # 10 s in a run
    caplog.set_level(logging.WARNING, logger="trio_rl.transport")
    port = free_port_pair()
    async with ZmqSender(3, port=port, ready_timeout=0.5) as sender:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        junk = ctx.socket(zmq.PUSH)
        try:
            junk.connect(f"tcp://127.0.0.1:{port + 1}")
            for msg in (b"1", b"1", b"x", b"7"):  # rank 1 twice, a non-integer, out of range
                junk.send(msg)
            with pytest.raises(TransportTimeoutError) as info:
                await sender.send(0, [b"a", b"b", b"c"])
        finally:
            junk.close(linger=0)
            ctx.term()
    assert "ranks [0, 2] of 3" in str(info.value)
    assert "2 malformed READY messages ignored" in str(info.value)
    assert sender.ready_ranks == {1}
    # never a silent wait: the ranks still missing, with the time left (a line every 0.2 s)
    lines = [r.getMessage() for r in caplog.records if "READY barrier" in r.getMessage()]
    assert 1 <= len(lines) <= 2, lines
    assert lines[0].startswith(
        f"READY barrier on tcp://127.0.0.1:{port + 1}: still waiting for ranks [0, 2] of 3 "
        "after 0 s, giving up in 0 s"
    ), lines[0]
    documented("the ZeroMQ sender's READY barrier", lines[0])


async def test_a_dead_receiver_never_blocks_the_sender() -> None:
    """Rank 1 dies after the barrier; the sender keeps publishing, rank 0 gets everything."""
    port, steps, size = free_port_pair(), 30, 1 << 20
    async with (
        ZmqSender(2, port=port, hwm=4, ready_timeout=10) as sender,
        ZmqReceiver(0, port=port, hwm=4) as r0,
    ):
        await r0.announce()
        async with ZmqReceiver(1, port=port, hwm=4) as r1:
            await r1.announce()
            with trio.fail_after(10):
                await sender.send(0, [payload(0, 0, size), payload(0, 1, size)])
        # r1 is gone now (its sockets closed): every message for it is dropped by PUB.
        got: list[tuple[int, int]] = []
        progress = [trio.Event()]
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    for _ in range(steps):
                        item = await r0.receive()
                        got.append(ident(item.data))
                        assert bytes(item.data) == payload(*ident(item.data), size)
                        progress[0].set()
                        progress[0] = trio.Event()

                nursery.start_soon(receive)
                for step in range(1, steps):
                    # rank 0 is live and keeps up (the ship gate's role); rank 1 never reads
                    while step - len(got) >= 2:
                        await progress[0].wait()
                    with trio.fail_after(5):  # a hang detector, not a speed assertion
                        await sender.send(step, [payload(step, 0, size), payload(step, 1, size)])
        assert got == [(step, 0) for step in range(steps)]


async def test_a_slow_receiver_loses_the_newest_messages_past_its_high_water_mark() -> None:
    """A receiver that does not read: the sender still never waits; PUB keeps the oldest
    messages (up to the HWMs plus the kernel's socket buffers) and drops newer ones. What
    arrives is in order, starts at the first message, and the first gap is reported by the
    step tag on the wire."""
    port, steps, size = free_port_pair(), 60, 1 << 20
    async with (
        ZmqSender(1, port=port, hwm=2, ready_timeout=10) as sender,
        ZmqReceiver(0, port=port, hwm=2) as rx,
    ):
        await rx.announce()
        with trio.fail_after(20):  # hang detector: 60 MiB into a receiver that never reads
            for step in range(steps):
                await sender.send(step, [payload(step, 0, size)])
        await trio.sleep(0.3)  # let everything that will arrive arrive
        received: list[tuple[int, int]] = []  # (receiver's step number, sender's step)

        async def receive_until_quiet() -> None:
            while True:
                with trio.move_on_after(0.5) as quiet:
                    item = await rx.receive()
                if quiet.cancelled_caught:
                    return
                sent_step, _ = ident(item.data)
                assert bytes(item.data) == payload(sent_step, 0, size)
                received.append((item.step, sent_step))

        async def until_the_gap() -> None:
            await receive_until_quiet()
            # Everything after the gap may have been dropped: the next step, sent into an
            # empty queue, arrives and shows the gap.
            await sender.send(steps, [payload(steps, 0, size)])
            await rx.receive()

        with trio.fail_after(20), pytest.raises(TransportError) as info:
            await until_the_gap()
    assert received == [(n, n) for n in range(len(received))]  # in order, no gap, numbered
    assert 1 <= len(received) < steps
    assert f"expected step {len(received)}, got step" in str(info.value)


async def test_cancelled_receives_lose_no_message() -> None:
    n = 600
    port = free_port_pair()
    async with (
        ZmqSender(1, port=port, hwm=10, ready_timeout=10) as sender,
        ZmqReceiver(0, port=port, hwm=10) as rx,
    ):
        await rx.announce()
        got: list[int] = []
        cancelled = 0
        progress = [trio.Event()]
        async with trio.open_nursery() as nursery:

            async def send_all() -> None:
                for step in range(n):
                    # At most 3 unread, back to back: well below the HWM of 10, so nothing
                    # may be dropped (plain pyzmq drops some here; see ZmqSender.send).
                    while step - len(got) >= 3:
                        await progress[0].wait()
                    await sender.send(step, [step.to_bytes(4, "big")])
                    if step % 10 == 0:
                        await trio.sleep(0.002)  # make some receives wait, to be cancelled

            nursery.start_soon(send_all)
            with trio.fail_after(60):
                while len(got) < n:
                    with trio.move_on_after(0.0002) as scope:
                        item = await rx.receive()
                        assert item.step == len(got)
                        got.append(int.from_bytes(item.data, "big"))
                        progress[0].set()
                        progress[0] = trio.Event()
                    cancelled += scope.cancelled_caught
    assert got == list(range(n))
    assert cancelled > 0


async def test_steps_must_be_consecutive_and_payload_counts_match() -> None:
    port = free_port_pair()
    async with (
        ZmqSender(1, port=port, ready_timeout=10) as sender,
        ZmqReceiver(0, port=port, start_step=3) as rx,
    ):
        await rx.announce()
        with pytest.raises(ValueError, match="got 2 payloads for world_size 1"):
            await sender.send(0, [b"a", b"b"])
        await sender.send(3, [b"three"])  # the first step may be any step (a restart)
        with pytest.raises(ValueError, match="got step 5 after step 3"):
            await sender.send(5, [b"five"])
        await sender.send(4, [b"four"])
        with trio.fail_after(5):
            assert bytes((await rx.receive()).data) == b"three"
            assert bytes((await rx.receive()).data) == b"four"


async def test_a_frame_that_is_not_topic_and_payload_is_a_transport_error() -> None:
    port = free_port_pair()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pull = ZmqSocket(ctx.socket(zmq.PULL))
    try:
        pub.bind(f"tcp://127.0.0.1:{port}")
        pull.socket.bind(f"tcp://127.0.0.1:{port + 1}")
        async with ZmqReceiver(0, port=port, start_step=2) as rx:
            with trio.fail_after(5):
                assert await pull.recv_multipart() == [b"0"]
            pub.send_multipart([rank_topic(0), b"a", b"b"])
            with trio.fail_after(5), pytest.raises(TransportError) as info:
                await rx.receive()
        assert "rank 0 step 2" in str(info.value)
        assert "3 frame(s)" in str(info.value)
    finally:
        pub.close(linger=0)
        pull.close()
        ctx.term()


async def test_close_releases_sockets_and_context_and_is_idempotent() -> None:
    port = free_port_pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sender = ZmqSender(1, port=port, ready_timeout=10)
        rx = ZmqReceiver(0, port=port)
        async with sender, rx:
            await sender.send(0, [b"x"])
            with trio.fail_after(5):
                await rx.receive()
            socks = [sender._pub, sender._ready_sock, rx._sub, rx._push]
        for s in socks:
            assert s is not None
            assert s.closed
            assert s.socket.closed
        assert sender._ctx is not None
        assert sender._ctx.closed
        assert rx._ctx is not None
        assert rx._ctx.closed
        await sender.aclose()
        await rx.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await sender.send(1, [b"y"])
        with pytest.raises(trio.ClosedResourceError):
            await rx.receive()
        # the port is free again: a new sender can bind it
        async with ZmqSender(1, port=port):
            pass


async def test_closing_wakes_a_receive_parked_in_another_task() -> None:
    port = free_port_pair()
    woken = []
    async with ZmqSender(1, port=port, ready_timeout=10) as sender:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery, ZmqReceiver(0, port=port) as rx:

                async def parked() -> None:
                    with pytest.raises(trio.ClosedResourceError):
                        await rx.receive()
                    woken.append(True)

                nursery.start_soon(parked)
                await sender.wait_ready()
                await trio.sleep(0.05)
            # leaving the receiver's `async with` closed its socket under `parked`
    assert woken == [True]


async def test_binding_a_port_in_use_is_a_transport_error() -> None:
    port = free_port_pair()
    async with ZmqSender(1, port=port):
        with pytest.raises(TransportError, match=f"cannot bind tcp://127.0.0.1:{port}"):
            async with ZmqSender(1, port=port):
                pass


async def test_a_cancelled_send_publishes_the_step_to_every_rank_or_none() -> None:
    port, world = free_port_pair(), 3
    async with AsyncExitStack() as stack:
        sender = await stack.enter_async_context(ZmqSender(world, port=port, ready_timeout=10))
        receivers = [
            await stack.enter_async_context(ZmqReceiver(r, port=port)) for r in range(world)
        ]
        await sender.wait_ready()
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before the send: Cancelled, and nothing sent
            await sender.send(0, [b"x0", b"x1", b"x2"])
        assert scope.cancelled_caught
        await sender.send(0, [b"r0", b"r1", b"r2"])
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:

                async def cancel() -> None:
                    scope.cancel()

                # runs at the first schedule point inside the send, between two ranks
                nursery.start_soon(cancel)
                await sender.send(1, [b"s0", b"s1", b"s2"])  # still goes to every rank
        with trio.fail_after(10):
            for r, rx in enumerate(receivers):
                first, second = await rx.receive(), await rx.receive()
                assert (first.step, bytes(first.data)) == (0, b"r%d" % r)
                assert (second.step, bytes(second.data)) == (1, b"s%d" % r)
