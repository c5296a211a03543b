"""The filesystem transport, on real files under tmp_path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio

from trio_rl.transport import (
    FileReceiver,
    FileSender,
    TransportTimeoutError,
    batch_path,
)


def payload(step: int, rank: int, size: int) -> bytes:
    """Distinct, checkable content: a header naming (step, rank), then a rank/step pattern."""
    head = f"step={step};rank={rank};".encode()
    body = bytes((step * 31 + rank * 7 + i) % 251 for i in range(256))
    return (head + body * (size // 256 + 1))[:size]


async def test_layout_and_content_are_exactly_the_payload_bytes(tmp_path: Path) -> None:
    async with FileSender(tmp_path, world_size=3) as sender:
        await sender.send(4, [payload(4, r, 1000 + r) for r in range(3)])
        await sender.send(5, [b"", bytearray(b"x"), memoryview(b"yz")])
    step_dir = tmp_path / "batches" / "step_4"
    assert sorted(os.listdir(step_dir)) == ["rank_0.bin", "rank_1.bin", "rank_2.bin"]
    for r in range(3):
        assert (step_dir / f"rank_{r}.bin").read_bytes() == payload(4, r, 1000 + r)
    assert [batch_path(tmp_path, 5, r).read_bytes() for r in range(3)] == [b"", b"x", b"yz"]


@pytest.mark.parametrize(("use_mmap", "delete"), [(False, False), (True, False), (True, True)])
async def test_multi_mib_round_trip_for_several_ranks_and_steps(
    tmp_path: Path, use_mmap: bool, delete: bool
) -> None:
    world, steps, size = 3, 3, 3 << 20
    async with FileSender(tmp_path, world_size=world, fsync=False) as sender:
        for step in range(steps):
            await sender.send(step, [payload(step, r, size + step) for r in range(world)])
    for rank in range(world):
        async with FileReceiver(
            tmp_path, rank, timeout=5, use_mmap=use_mmap, delete=delete
        ) as receiver:
            for step in range(steps):
                got = await receiver.receive()
                assert (got.step, got.rank) == (step, rank)
                assert isinstance(got.data, memoryview if use_mmap else bytes)
                assert got.data == payload(step, rank, size + step)
                assert got.source == str(batch_path(tmp_path, step, rank))
                assert batch_path(tmp_path, step, rank).exists()  # kept until acknowledged
                await receiver.ack(step)
                assert batch_path(tmp_path, step, rank).exists() is not delete
                assert got.data == payload(step, rank, size + step)  # a mapping outlives unlink
                del got
            assert receiver.next_step == steps


async def test_receiver_waits_for_a_file_written_later(tmp_path: Path) -> None:
    async with (
        FileSender(tmp_path, world_size=1) as sender,
        FileReceiver(tmp_path, 0, start_step=7, timeout=10) as receiver,
    ):
        got = []
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                got.append(await receiver.receive())

            nursery.start_soon(receive)
            await trio.sleep(0.2)
            assert got == []
            await sender.send(7, [b"seven"])
        assert [(g.step, g.data) for g in got] == [(7, b"seven")]


async def test_missing_file_times_out_naming_the_file(tmp_path: Path) -> None:
    async with FileReceiver(tmp_path, 2, start_step=3, timeout=0.1) as receiver:
        with pytest.raises(TransportTimeoutError) as info:
            await receiver.receive()
    assert str(batch_path(tmp_path, 3, 2)) in str(info.value)
    assert "step 3" in str(info.value)
    assert receiver.next_step == 3


async def test_delete_removes_files_and_the_emptied_step_directory(tmp_path: Path) -> None:
    async with FileSender(tmp_path, world_size=2) as sender:
        await sender.send(0, [b"a", b"b"])
    async with FileReceiver(tmp_path, 0, delete=True, timeout=5) as r0:
        assert (await r0.receive()).data == b"a"
        await r0.ack(0)
    assert not batch_path(tmp_path, 0, 0).exists()
    assert batch_path(tmp_path, 0, 1).exists()  # the other rank's file is untouched
    async with FileReceiver(tmp_path, 1, delete=True, timeout=5) as r1:
        assert (await r1.receive()).data == b"b"
        await r1.ack(0)
    assert sorted(os.listdir(tmp_path / "batches")) == [".consumed", ".staging"]


async def test_partial_files_are_never_visible(tmp_path: Path) -> None:
    """A reader polling as fast as it can only ever sees complete files (temp + rename)."""
    size, steps = 4 << 20, 12
    stop = threading.Event()
    seen: list[tuple[int, int]] = []

    def watch() -> None:
        while not stop.is_set():
            for step in range(steps):
                path = batch_path(tmp_path, step, 0)
                try:
                    with open(path, "rb") as f:
                        seen.append((step, len(f.read())))
                except FileNotFoundError:
                    pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        async with FileSender(tmp_path, world_size=1, fsync=False) as sender:
            for step in range(steps):
                await sender.send(step, [payload(step, 0, size)])
                await trio.sleep(0.001)
    finally:
        stop.set()
        watcher.join()
    assert seen, "the watcher never saw a file: the test proves nothing"
    assert {length for _, length in seen} == {size}
    leftovers = [p.name for p in (tmp_path / "batches").rglob("*") if p.suffix == ".tmp"]
    assert leftovers == []


async def test_cancelled_receives_lose_nothing(tmp_path: Path) -> None:
    steps = 40
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        FileReceiver(tmp_path, 0, delete=True, poll_interval=0.0005) as receiver,
    ):
        got: list[bytes] = []
        cancelled = 0
        async with trio.open_nursery() as nursery:

            async def send_all() -> None:
                for step in range(steps):
                    await sender.send(step, [payload(step, 0, 50_000)])
                    await trio.sleep(0.002)

            nursery.start_soon(send_all)
            with trio.fail_after(30):
                while len(got) < steps:
                    with trio.move_on_after(0.0003) as scope:
                        got.append(bytes((await receiver.receive()).data))
                    cancelled += scope.cancelled_caught
    assert got == [payload(step, 0, 50_000) for step in range(steps)]
    assert cancelled > 0


async def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    async with FileSender(tmp_path, world_size=2) as sender:
        with pytest.raises(ValueError, match="got 1 payloads for world_size 2"):
            await sender.send(0, [b"only one"])
        with pytest.raises(ValueError, match="step must be >= 0"):
            await sender.send(-1, [b"a", b"b"])
    with pytest.raises(trio.ClosedResourceError):
        await sender.send(0, [b"a", b"b"])
    with pytest.raises(ValueError, match="world_size"):
        FileSender(tmp_path, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        FileReceiver(tmp_path, -1)
