"""`trio_rl.trainer.BatchReceiver`: decoded micro-batches per step, over both transports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from builders import grid
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import (
    FileSender,
    ZmqReceiver,
    ZmqSender,
    batch_path,
    free_port_pair,
)
from trio_rl.wire import MicroBatch, WireFormatError, encode


async def test_files_round_trip_with_async_for(tmp_path: Path) -> None:
    world, steps = 2, 3
    sent = {s: grid(s, world) for s in range(steps)}
    async with FileSender(tmp_path, world_size=world) as sender:
        for s in range(steps):
            await sender.send(s, [encode(mbs) for mbs in sent[s]])
    for rank in range(world):
        got = []
        async with BatchReceiver.files(tmp_path, rank, stop_step=steps, timeout=5) as receiver:
            async for step, micro_batches in receiver:
                got.append((step, micro_batches))
        assert got == [(s, sent[s][rank]) for s in range(steps)]


async def test_zmq_round_trip_of_multi_mib_payloads() -> None:
    # ~3 MiB of routed-expert bytes per micro-batch: decoded in a worker thread
    world, steps, port = 2, 3, free_port_pair()
    sent = {s: grid(s, world, per_rank=1, tokens=4096, experts=96) for s in range(steps)}
    assert len(encode(sent[0][0])) > 3 << 20
    results: dict[int, list[tuple[int, list[MicroBatch]]]] = {}
    async with ZmqSender(world, port=port, hwm=4, ready_timeout=10) as sender:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def trainer(rank: int) -> None:
                    results[rank] = []
                    async with BatchReceiver.zmq(rank, port=port, stop_step=steps) as receiver:
                        async for step, micro_batches in receiver:
                            results[rank].append((step, micro_batches))

                for rank in range(world):
                    nursery.start_soon(trainer, rank)
                for s in range(steps):
                    await sender.send(s, [encode(mbs) for mbs in sent[s]])
    for rank in range(world):
        assert results[rank] == [(s, sent[s][rank]) for s in range(steps)]
        experts = results[rank][1][1][0].routed_experts
        assert experts is not None
        arr = np.frombuffer(experts.data, dtype=experts.dtype).reshape(experts.shape)
        assert arr[0, 0, 0] == 1 * 1000 + rank * 100


async def test_a_corrupt_file_names_the_file_and_offset_then_the_next_step_follows(
    tmp_path: Path,
) -> None:
    async with FileSender(tmp_path, world_size=1) as sender:
        for s in range(3):
            await sender.send(s, [encode(grid(s, 1)[0])])
    bad = batch_path(tmp_path, 1, 0)
    good_bytes = bad.read_bytes()
    bad.write_bytes(good_bytes[:-5])  # truncated inside the last micro-batch
    async with BatchReceiver.files(tmp_path, 0, timeout=5) as receiver:
        assert (await receiver.receive())[0] == 0
        with pytest.raises(WireFormatError) as info:
            await receiver.receive()
        assert info.value.source == str(bad)
        assert str(bad) in str(info.value)
        assert 0 < info.value.offset < len(good_bytes)
        assert receiver.next_step == 2
        step, micro_batches = await receiver.receive()
        assert (step, micro_batches) == (2, grid(2, 1)[0])


async def test_a_garbage_file_header_is_reported_at_offset_zero(tmp_path: Path) -> None:
    path = batch_path(tmp_path, 0, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xc1not msgpack")
    async with BatchReceiver.files(tmp_path, 0, timeout=5) as receiver:
        with pytest.raises(WireFormatError) as info:
            await receiver.receive()
    assert info.value.offset == 0
    assert info.value.source == str(path)


async def test_a_corrupt_zmq_frame_names_the_rank_and_step_and_offset() -> None:
    port = free_port_pair()
    payload = bytearray(encode(grid(1, 1)[0]))
    payload[4] = 0xC1  # the first micro-batch's first field: a never-used msgpack byte
    async with (
        ZmqSender(1, port=port, ready_timeout=10) as sender,
        BatchReceiver.zmq(0, port=port) as receiver,
    ):
        await sender.send(0, [encode(grid(0, 1)[0])])
        await sender.send(1, [bytes(payload)])
        await sender.send(2, [encode(grid(2, 1)[0])])
        with trio.fail_after(10):
            assert (await receiver.receive())[0] == 0
            with pytest.raises(WireFormatError) as info:
                await receiver.receive()
            assert (await receiver.receive()) == (2, grid(2, 1)[0])
    assert info.value.source == f"tcp://127.0.0.1:{port} rank 0 step 1"
    assert info.value.offset == 4


async def test_receiver_with_zmq_transport_object_and_start_step() -> None:
    port = free_port_pair()
    async with (
        ZmqSender(1, port=port, ready_timeout=10) as sender,
        BatchReceiver(ZmqReceiver(0, port=port, start_step=10), stop_step=12) as receiver,
    ):
        assert receiver.rank == 0
        assert receiver.next_step == 10
        for s in (10, 11):
            await sender.send(s, [encode(grid(s, 1)[0])])
        with trio.fail_after(10):
            got = [item async for item in receiver]
    assert got == [(10, grid(10, 1)[0]), (11, grid(11, 1)[0])]
