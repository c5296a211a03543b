"""The ZeroMQ end-of-stream message, on real sockets on loopback."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import zmq

from trio_rl.trainer import BatchReceiver
from trio_rl.transport import (
    EndOfStreamError,
    TransportError,
    ZmqReceiver,
    ZmqSender,
    ZmqSocket,
    free_port_pair,
    rank_topic,
)
from trio_rl.transport._zmq_transport import end_topic, step_topic
from trio_rl.wire import MicroBatch, encode


def mbs(step: int) -> list[MicroBatch]:
    return [
        MicroBatch(
            input_ids=[step, step + 1],
            loss_mask=[True, False],
            advantages=[0.5, 0.5],
            inference_logprobs=[-0.1, -0.2],
            position_ids=[0, 1],
            sequence_lengths=[2],
            temperatures=[1.0, 1.0],
            env_names=["env"],
            seq_lens=[2],
        )
    ]


async def test_end_stream_ends_every_ranks_iteration_and_later_receives_raise() -> None:
    world, steps, port = 2, 3, free_port_pair()
    seen: dict[int, list[int]] = {}
    with trio.fail_after(30):
        async with (
            ZmqSender(world, port=port, ready_timeout=10) as sender,
            trio.open_nursery() as nursery,
        ):

            async def trainer(rank: int) -> None:
                async with BatchReceiver.zmq(rank, port=port) as receiver:
                    seen[rank] = []
                    async for step, got in receiver:
                        assert got == mbs(step)
                        seen[rank].append(step)
                    for _ in range(2):
                        with pytest.raises(EndOfStreamError) as info:
                            await receiver.receive()
                        assert info.value.step == steps

            for rank in range(world):
                nursery.start_soon(trainer, rank)
            for s in range(steps):
                await sender.send(s, [encode(mbs(s))] * world)
            await sender.end_stream(steps)
            with pytest.raises(RuntimeError, match="ended at step 3"):
                await sender.send(steps, [encode(mbs(steps))] * world)
    assert seen == {0: [0, 1, 2], 1: [0, 1, 2]}


async def test_a_stream_that_ends_before_its_first_step() -> None:
    port = free_port_pair()
    with trio.fail_after(30):
        async with (
            ZmqSender(1, port=port, ready_timeout=10) as sender,
            ZmqReceiver(0, port=port, start_step=5) as receiver,
        ):
            await sender.end_stream(5)  # waits for READY like a first send
            with pytest.raises(EndOfStreamError):
                await receiver.receive()


async def test_a_prime_rl_style_subscriber_never_sees_the_end_message() -> None:
    """A SUB subscribed to ``data_rank|0|`` only, like prime-rl's receiver, gets the data and
    nothing else (no step marker, no end); trio-rl's receiver on the same sender gets the end."""
    port = free_port_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    raw = ZmqSocket(ctx.socket(zmq.SUB))
    try:
        raw.socket.setsockopt(zmq.SUBSCRIBE, rank_topic(0))
        raw.socket.connect(f"tcp://127.0.0.1:{port}")
        with trio.fail_after(30):
            async with (
                ZmqSender(1, port=port, ready_timeout=10) as sender,
                ZmqReceiver(0, port=port) as ours,
            ):
                await ours.announce()
                await trio.sleep(0.2)  # the raw subscription reaches the sender
                await sender.send(0, [b"zero"])
                await sender.end_stream(1)
                assert bytes((await ours.receive()).data) == b"zero"
                with pytest.raises(EndOfStreamError):
                    await ours.receive()
                # prime-rl's receive: ``topic, payload = recv_multipart()``, topic unread.
                topic, data = await raw.recv_multipart()
                assert (topic, data) == (rank_topic(0), b"zero")  # the reference's frames
                with trio.move_on_after(0.3) as nothing_more:
                    await raw.recv_multipart()
                assert nothing_more.cancelled_caught
    finally:
        raw.close()
        ctx.term()
    assert not end_topic(0).startswith(rank_topic(0))
    assert not step_topic(0).startswith(rank_topic(0))


async def test_an_end_at_another_step_than_counted_is_reported() -> None:
    port = free_port_pair()
    with trio.fail_after(30):
        async with (
            ZmqSender(1, port=port, ready_timeout=10) as sender,
            ZmqReceiver(0, port=port, start_step=0) as receiver,
        ):
            await sender.send(7, [b"seven"])  # the receiver expects step 0
            await sender.end_stream(8)
            with pytest.raises(TransportError, match="expected step 0, got step 7"):
                await receiver.receive()
            with pytest.raises(TransportError, match="8 message\\(s\\) were dropped"):
                await receiver.receive()
            with pytest.raises(EndOfStreamError):
                await receiver.receive()
