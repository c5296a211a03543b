"""A ZeroMQ receiver outlives its sender: a sender process SIGKILLed mid-run and restarted from
an earlier step (as a resumed orchestrator does) is picked up, and the receiver still returns
every step exactly once, in order."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
import zmq
from zmq_restart_sender import payload

from trio_rl.transport import (
    EndOfStreamError,
    TransportError,
    TransportTimeoutError,
    ZmqReceiver,
    ZmqSocket,
    _wait,
    free_port_pair,
    rank_topic,
    step_topic,
)

SENDER = Path(__file__).with_name("zmq_restart_sender.py")

WORLD = 2


async def start_sender(port: int, start: int, stop: int, *, end: bool) -> trio.Process:
    args = [sys.executable, str(SENDER), str(port), str(WORLD), str(start), str(stop), "0.05"]
    return await trio.lowlevel.open_process(
        [*args, "--end"] if end else args, stdout=subprocess.DEVNULL
    )


async def receive_all(rx: ZmqReceiver, got: list[int], ends: list[int], eight: trio.Event) -> None:
    """Receive until the end of the stream, checking each payload; set ``eight`` at 8 steps."""
    while True:
        try:
            item = await rx.receive()
        except EndOfStreamError as end:
            ends.append(end.step)
            return
        assert bytes(item.data) == payload(item.step, rx.rank)
        got.append(item.step)
        if len(got) == 8:
            eight.set()


async def test_receivers_survive_a_sigkilled_and_restarted_sender_process() -> None:
    port, steps = free_port_pair(), 30
    got: list[list[int]] = [[] for _ in range(WORLD)]
    ends: list[int] = []
    first = second = None
    try:
        with trio.fail_after(60):
            async with AsyncExitStack() as stack:
                receivers = [
                    await stack.enter_async_context(ZmqReceiver(r, port=port, timeout=30))
                    for r in range(WORLD)
                ]
                eight = trio.Event()
                async with trio.open_nursery() as nursery:
                    for rx in receivers:
                        nursery.start_soon(receive_all, rx, got[rx.rank], ends, eight)
                    first = await start_sender(port, 0, steps, end=False)
                    await eight.wait()
                    first.send_signal(signal.SIGKILL)
                    assert await first.wait() == -signal.SIGKILL
                    # The restarted sender resumes from an older checkpoint: steps 4.. again.
                    second = await start_sender(port, 4, steps, end=True)
                assert await second.wait() == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.kill()
    assert got == [list(range(steps))] * WORLD
    assert ends == [steps] * WORLD


async def test_the_step_travels_in_a_marker_and_a_gap_is_reported() -> None:
    """A data message is numbered by the step marker sent before it (a topic a prime-rl SUB
    never subscribes to); an unmarked one, as a prime-rl sender sends, by arrival; an older
    trio-rl sender's step in the topic (``data_rank|R|S``) is read too."""
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
            await trio.sleep(0.1)
            pub.send_multipart([rank_topic(0), b"unmarked"])  # prime-rl's frames: step 2
            pub.send_multipart([step_topic(0), b"2"])
            pub.send_multipart([rank_topic(0), b"duplicate"])
            pub.send_multipart([step_topic(0), b"3"])
            pub.send_multipart([rank_topic(0), b"three"])
            pub.send_multipart([rank_topic(0) + b"4", b"four"])  # an older trio-rl sender's
            pub.send_multipart([step_topic(0), b"9"])
            pub.send_multipart([rank_topic(0), b"nine"])
            with trio.fail_after(5):
                item = await rx.receive()
                assert (item.step, bytes(item.data)) == (2, b"unmarked")
                item = await rx.receive()
                assert (item.step, bytes(item.data)) == (3, b"three")
                item = await rx.receive()
                assert (item.step, bytes(item.data)) == (4, b"four")
                with pytest.raises(TransportError) as info:
                    await rx.receive()
        assert "got step 9" in str(info.value)
        assert "4 step(s) were lost" in str(info.value)
    finally:
        pub.close(linger=0)
        pull.close()
        ctx.term()


async def test_a_malformed_step_marker_is_reported() -> None:
    port = free_port_pair()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pull = ZmqSocket(ctx.socket(zmq.PULL))
    try:
        pub.bind(f"tcp://127.0.0.1:{port}")
        pull.socket.bind(f"tcp://127.0.0.1:{port + 1}")
        async with ZmqReceiver(0, port=port) as rx:
            with trio.fail_after(5):
                assert await pull.recv_multipart() == [b"0"]
            await trio.sleep(0.1)
            pub.send_multipart([step_topic(0), b"x1"])
            with trio.fail_after(5), pytest.raises(TransportError) as info:
                await rx.receive()
        assert "step marker is malformed" in str(info.value)
    finally:
        pub.close(linger=0)
        pull.close()
        ctx.term()


async def test_receive_times_out_and_logs_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_wait, "WAIT_LOG_INTERVAL", 0.1)
    caplog.set_level(logging.INFO, logger="trio_rl.transport")
    port = free_port_pair()
    with trio.fail_after(10):
        async with ZmqReceiver(0, port=port, timeout=0.5) as rx:
            with pytest.raises(TransportTimeoutError) as info:
                await rx.receive()
            assert rx.next_step == 0
    assert f"tcp://127.0.0.1:{port} rank 0 step 0" in str(info.value)
    assert "no message from the sender after waiting 0.5 s" in str(info.value)
    waits = [r for r in caplog.records if "still waiting" in r.getMessage()]
    assert 2 <= len(waits) <= 6
