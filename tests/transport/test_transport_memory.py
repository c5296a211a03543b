"""The in-memory transport keeps the transport contract: world size, steps in order, end of
stream, acknowledgement, all-or-nothing cancellation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_rl.trainer import BatchReceiver
from trio_rl.transport import (
    EndOfStreamError,
    MemoryReceiver,
    MemorySender,
    Receiver,
    Sender,
    TransportError,
)
from trio_rl.wire import MicroBatch, encode


def _mb(n: int) -> MicroBatch:
    return MicroBatch(
        input_ids=list(range(n)),
        loss_mask=[True] * n,
        advantages=[0.5] * n,
        inference_logprobs=[-1.0] * n,
        position_ids=list(range(n)),
        sequence_lengths=[n],
        temperatures=[1.0] * n,
        env_names=["env"],
        seq_lens=[n],
    )


async def test_every_rank_gets_its_payload_in_step_order_then_the_end() -> None:
    async with MemorySender(3) as sender:
        assert isinstance(sender, Sender)
        assert sender.world_size == 3
        receivers = [sender.receiver(r, start_step=1) for r in range(3)]
        assert all(isinstance(r, Receiver) for r in receivers)
        for step in (1, 2):
            await sender.send(step, [f"{step}:{r}".encode() for r in range(3)])
        await sender.end_stream(3)
        with pytest.raises(RuntimeError, match="ended at step 3"):
            await sender.send(3, [b"", b"", b""])
        for rank, rx in enumerate(receivers):
            with trio.fail_after(5):
                got = [await rx.receive() for _ in range(2)]
                assert [(p.step, p.rank, bytes(p.data)) for p in got] == [
                    (1, rank, f"1:{rank}".encode()),
                    (2, rank, f"2:{rank}".encode()),
                ]
                for _ in range(2):  # again on every later call
                    with pytest.raises(EndOfStreamError) as info:
                        await rx.receive()
                    assert info.value.step == 3
            assert rx.next_step == 3


async def test_bad_sends_raise_and_send_nothing() -> None:
    async with MemorySender(2) as sender:
        rx = sender.receiver(0)
        with pytest.raises(ValueError, match="world_size 2"):
            await sender.send(0, [b"x"])
        await sender.send(1, [b"a", b"b"])
        with pytest.raises(ValueError, match="step 1 was already sent"):
            await sender.send(0, [b"a", b"b"])
        with pytest.raises(ValueError, match="step 1 was already sent"):
            await sender.end_stream(1)
        with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
            sender.receiver(2)
        with pytest.raises(TransportError, match="expected step 0, got step 1"):
            await rx.receive()


async def test_a_re_sent_step_is_skipped_by_a_receiver_past_it() -> None:
    async with MemorySender(1) as sender:
        rx = sender.receiver(0)
        await sender.send(0, [b"first"])
        assert bytes((await rx.receive()).data) == b"first"
        await sender.send(0, [b"again"])  # a resumed publisher re-sends its pending step
        await sender.send(1, [b"next"])
        assert (await rx.receive()).step == 1


async def test_a_cancelled_send_sends_nothing_and_a_cancelled_receive_takes_nothing() -> None:
    async with MemorySender(2) as sender:
        rx = sender.receiver(1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await sender.send(0, [b"a", b"b"])
        assert scope.cancelled_caught
        with trio.move_on_after(0.01):
            await rx.receive()  # nothing to take: waits, then is cancelled
        await sender.send(0, [b"c", b"d"])
        with trio.CancelScope() as scope:
            scope.cancel()
            await rx.receive()
        assert scope.cancelled_caught
        assert rx.next_step == 0
        with trio.fail_after(5):
            got = await rx.receive()
        assert (got.step, bytes(got.data)) == (0, b"d"), "the cancelled send left nothing behind"


async def test_an_unacknowledged_payload_goes_to_the_next_receiver_of_the_rank() -> None:
    async with MemorySender(1) as sender:
        for step in range(3):
            await sender.send(step, [bytes([step])])
        async with sender.receiver(0) as first:
            assert (await first.receive()).step == 0
            await first.ack(0)
            assert (await first.receive()).step == 1  # returned, never acknowledged
            with pytest.raises(ValueError, match="not received yet"):
                await first.ack(2)
        with pytest.raises(trio.ClosedResourceError):
            await first.receive()
        async with sender.receiver(0) as second:
            assert second.next_step == 1, "resumes after the last acknowledged step"
            assert [(await second.receive()).step for _ in range(2)] == [1, 2]
            await second.ack(2)
        assert sender.receiver(0).next_step == 3


async def test_a_sender_closed_without_ending_the_stream_fails_its_receivers_loudly() -> None:
    sender = MemorySender(1)
    rx = sender.receiver(0)
    await sender.send(0, [b"x"])
    await sender.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sender.send(1, [b"y"])
    with trio.fail_after(5):
        assert (await rx.receive()).step == 0, "queued steps are still delivered"
        with pytest.raises(TransportError, match="closed without ending the stream"):
            await rx.receive()


async def test_batch_receiver_decodes_over_the_memory_transport() -> None:
    async with MemorySender(2) as sender:
        for step in (1, 2):
            await sender.send(step, [encode([_mb(step + r)]) for r in range(2)])
        await sender.end_stream(3)
        for rank in range(2):
            got = []
            with trio.fail_after(5):
                async with BatchReceiver(sender.receiver(rank, start_step=1)) as batches:
                    async for step, micro_batches in batches:
                        got.append((step, [len(mb.input_ids) for mb in micro_batches]))
            assert got == [(1, [1 + rank]), (2, [2 + rank])]
            assert isinstance(batches.transport, MemoryReceiver)
