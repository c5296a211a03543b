"""ZmqSender's frames are prime-rl's, byte for byte, as prime-rl's own receiver reads them.

The reference sender and receiver below are written from the reference's description
(``zmq.py``): PUB bound at ``port`` and PULL at ``port + 1``; the first send waits until every
rank's READY (its rank in ASCII) arrived; each step sends ``[b"data_rank|R|", payload]`` per
rank and nothing else (no step on the wire). A receiver subscribes SUB to ``data_rank|R|``,
sends READY once over PUSH, and reads ``topic, payload = recv_multipart()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio
import zmq

from trio_rl.transport import ZmqReceiver, ZmqSender, ZmqSocket, free_port_pair
from trio_rl.wire import MicroBatch, encode

WORLD, STEPS = 2, 3


def payload(step: int, rank: int) -> bytes:
    mb = MicroBatch(
        input_ids=[step, rank, 7],
        loss_mask=[False, True, True],
        advantages=[0.0, 0.5, -0.5],
        inference_logprobs=[0.0, -0.1, -0.2],
        position_ids=[0, 1, 2],
        sequence_lengths=[3],
        temperatures=[1.0, 1.0, 1.0],
        env_names=["env"],
        seq_lens=[3],
    )
    return encode([mb])


class ReferenceSender:
    """prime-rl's ZMQ sender as the reference describes it."""

    def __init__(self, ctx: zmq.Context[Any], port: int, world: int, hwm: int = 10) -> None:
        self.world = world
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        pub.bind(f"tcp://127.0.0.1:{port}")
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, hwm)
        pull.bind(f"tcp://127.0.0.1:{port + 1}")
        self.pub, self.pull = ZmqSocket(pub), ZmqSocket(pull)
        self.ready: set[int] = set()

    async def send(self, payloads: Sequence[bytes]) -> None:
        while len(self.ready) < self.world:  # the READY barrier, on the first send only
            [msg] = await self.pull.recv_multipart()
            try:
                self.ready.add(int(msg.decode()))
            except ValueError:
                continue
        for rank, data in enumerate(payloads):
            topic = b"data_rank|" + str(rank).encode() + b"|"
            await self.pub.send_multipart([topic, data], copy=False)

    def close(self) -> None:
        self.pub.close(linger=1000)
        self.pull.close()


class ReferenceReceiver:
    """prime-rl's ZMQ receiver as the reference describes it; keeps every frame it reads."""

    def __init__(self, ctx: zmq.Context[Any], port: int, rank: int, hwm: int = 10) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, hwm)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|" + str(rank).encode() + b"|")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, hwm)
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        self.sub, self.push = ZmqSocket(sub), ZmqSocket(push)
        self.rank = rank

    async def announce(self) -> None:
        await self.push.send_multipart([str(self.rank).encode()])

    async def frames(self, n: int) -> list[list[bytes]]:
        """The next ``n`` messages, then proof that nothing else arrives."""
        got = [await self.sub.recv_multipart() for _ in range(n)]
        with trio.move_on_after(0.3) as nothing_more:
            got.append(await self.sub.recv_multipart())
        assert nothing_more.cancelled_caught, got[-1][:1]
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.push.close(linger=0)


async def _frames_from(sender_kind: str) -> list[list[list[bytes]]]:
    """What prime-rl's receivers read, per rank, from ``STEPS`` steps of either sender."""
    port = free_port_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    receivers = [ReferenceReceiver(ctx, port, rank) for rank in range(WORLD)]
    try:
        with trio.fail_after(30):
            if sender_kind == "reference":
                reference = ReferenceSender(ctx, port, WORLD)
                try:
                    for r in receivers:
                        await r.announce()
                    await trio.sleep(0.2)  # the subscriptions reach the sender
                    for step in range(STEPS):
                        await reference.send([payload(step, r) for r in range(WORLD)])
                    return [await r.frames(STEPS) for r in receivers]
                finally:
                    reference.close()
            async with ZmqSender(WORLD, port=port, ready_timeout=10) as ours:
                for r in receivers:
                    await r.announce()
                await trio.sleep(0.2)
                for step in range(STEPS):
                    await ours.send(step, [payload(step, r) for r in range(WORLD)])
                # the end of the stream is sent too: a reference receiver never gets it
                await ours.end_stream(STEPS)
                return [await r.frames(STEPS) for r in receivers]
    finally:
        for r in receivers:
            r.close()
        ctx.term()


async def test_a_reference_receiver_reads_the_reference_senders_bytes_from_ours() -> None:
    ours = await _frames_from("trio-rl")
    reference = await _frames_from("reference")
    assert ours == reference
    # and they are what the reference documents: two frames, topic then the payload
    for rank, frames in enumerate(ours):
        assert frames == [
            [b"data_rank|" + str(rank).encode() + b"|", payload(step, rank)]
            for step in range(STEPS)
        ]


async def test_our_receiver_reads_the_reference_sender_in_arrival_order() -> None:
    port = free_port_pair()
    ctx: zmq.Context[Any] = zmq.Context()
    reference = ReferenceSender(ctx, port, 1)
    try:
        with trio.fail_after(30):
            async with ZmqReceiver(0, port=port, start_step=4) as rx:
                await rx.announce()
                await trio.sleep(0.2)
                for step in (4, 5):
                    await reference.send([payload(step, 0)])
                for step in (4, 5):
                    item = await rx.receive()
                    assert (item.step, bytes(item.data)) == (step, payload(step, 0))
    finally:
        reference.close()
        ctx.term()
