"""The filesystem transport under restarts, racing deleting readers, file errors, and the end
marker; real files, a real reader process."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from conftest import scaled
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import (
    EndOfStreamError,
    FileReceiver,
    FileSender,
    TransportError,
    TransportIOError,
    batch_path,
)
from trio_rl.transport._files import consumed_marker_path, end_marker_path


async def send_steps(directory: Path, steps: range, world: int = 1) -> None:
    async with FileSender(directory, world_size=world, fsync=False) as sender:
        for s in steps:
            await sender.send(s, [f"{s}:{r}".encode() for r in range(world)])


async def receive_data(receiver: FileReceiver) -> tuple[int, bytes]:
    got = await receiver.receive()
    return got.step, bytes(got.data)


# -- where a restarted receiver starts ---------------------------------------------------


async def test_resume_starts_at_the_lowest_file_then_after_the_last_acknowledged_step(
    tmp_path: Path,
) -> None:
    await send_steps(tmp_path, range(3, 7))
    with trio.fail_after(10):
        async with FileReceiver(tmp_path, 0, start_step=None, delete=True) as rx:
            assert rx.next_step == 3  # nothing acknowledged yet: the lowest file
            assert await receive_data(rx) == (3, b"3:0")
            assert await receive_data(rx) == (4, b"4:0")  # acknowledges 3
            # 4 was returned but not acknowledged when this receiver closes
        assert consumed_marker_path(tmp_path, 0).read_text() == "3"
        assert not batch_path(tmp_path, 3, 0).exists()
        assert batch_path(tmp_path, 4, 0).exists()
        async with FileReceiver(tmp_path, 0, start_step=None, delete=True) as rx:
            assert rx.next_step == 4
            assert await receive_data(rx) == (4, b"4:0")
            await rx.ack(4)
        async with FileReceiver(tmp_path, 0, start_step=None, delete=True) as rx:
            assert await receive_data(rx) == (5, b"5:0")


async def test_resume_without_delete_uses_the_consumer_marker(tmp_path: Path) -> None:
    await send_steps(tmp_path, range(4))
    with trio.fail_after(10):
        async with resuming_receiver(tmp_path) as rx:
            assert await receive_data(rx) == (0, b"0:0")
            assert await receive_data(rx) == (1, b"1:0")
            await rx.ack(1)
        assert batch_path(tmp_path, 0, 0).exists()  # delete=False keeps every file
        async with resuming_receiver(tmp_path) as rx:
            assert await receive_data(rx) == (2, b"2:0")


def resuming_receiver(directory: Path) -> FileReceiver:
    return FileReceiver(directory, 0, start_step=None, delete=False)


async def test_resume_after_a_crash_between_marker_and_delete_skips_the_consumed_file(
    tmp_path: Path,
) -> None:
    await send_steps(tmp_path, range(3))
    marker = consumed_marker_path(tmp_path, 0)
    marker.parent.mkdir(parents=True)
    marker.write_text("1")  # acknowledged 1, crashed before deleting its file
    with trio.fail_after(10):
        async with FileReceiver(tmp_path, 0, start_step=None, delete=True) as rx:
            assert rx.next_step == 2
            assert not batch_path(tmp_path, 1, 0).exists()  # the leftover is removed
            assert await receive_data(rx) == (2, b"2:0")


async def test_resume_with_nothing_to_resume_from_says_so(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="nothing to resume from, pass start_step"):
        async with FileReceiver(tmp_path, 0, start_step=None):
            pass
    marker = consumed_marker_path(tmp_path, 0)
    marker.parent.mkdir(parents=True)
    marker.write_bytes(b"seven")
    with pytest.raises(TransportError, match="expected a step number") as info:
        async with FileReceiver(tmp_path, 0, start_step=None):
            pass
    assert str(marker) in str(info.value)


async def test_an_unacknowledged_step_cannot_be_skipped(tmp_path: Path) -> None:
    await send_steps(tmp_path, range(2))
    async with FileReceiver(tmp_path, 0, delete=True, timeout=5) as rx:
        with pytest.raises(ValueError, match="cannot ack step 0: not received yet"):
            await rx.ack(0)
        assert await receive_data(rx) == (0, b"0:0")
        await rx.ack(0)
        await rx.ack(0)  # again: nothing to do


# -- racing readers -------------------------------------------------------------------------

READER = textwrap.dedent(
    """
    # A reader in the style of prime-rl's: polls step_<S>/rank_<R>.bin for each rank, reads
    # and checks it, deletes it and removes the emptied step directory; a janitor thread
    # removes every empty step directory it sees. It stops at the END marker.
    import os, sys, threading
    root, world = sys.argv[1], int(sys.argv[2])
    batches = os.path.join(root, "batches")
    stop = threading.Event()
    def janitor():
        while not stop.is_set():
            try:
                names = os.listdir(batches)
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith("step_"):
                    try:
                        os.rmdir(os.path.join(batches, name))
                    except OSError:
                        pass
    threading.Thread(target=janitor, daemon=True).start()
    nxt = [0] * world
    read = 0
    while True:
        progressed = False
        for rank in range(world):
            path = os.path.join(batches, f"step_{nxt[rank]}", f"rank_{rank}.bin")
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            expected = f"{nxt[rank]}:{rank}".encode() * 50
            if data != expected:
                sys.exit(f"bad content in {path}: {data[:40]!r}")
            os.unlink(path)
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass
            nxt[rank] += 1
            read += 1
            progressed = True
        if not progressed:
            try:
                with open(os.path.join(batches, "END")) as f:
                    end = int(f.read())
            except FileNotFoundError:
                continue
            if all(n >= end for n in nxt):
                break
    stop.set()
    print(read)
    """
)


async def test_a_racing_reader_process_that_deletes_never_breaks_the_sender(
    tmp_path: Path,
) -> None:
    world, steps = 3, scaled(300)
    (tmp_path / "batches").mkdir()

    async def write() -> None:
        async with FileSender(tmp_path, world_size=world, fsync=False) as sender:
            for s in range(steps):
                await sender.send(s, [f"{s}:{r}".encode() * 50 for r in range(world)])
            await sender.end_stream(steps)

    with trio.fail_after(60):  # a cancelled run_process kills the reader
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            reader = await trio.run_process(
                [sys.executable, "-c", READER, str(tmp_path), str(world)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert reader.returncode == 0, reader.stderr.decode()
    assert int(reader.stdout) == world * steps  # every file read exactly once, in order, intact
    assert sorted(os.listdir(tmp_path / "batches")) == [".staging", "END"]
    assert os.listdir(tmp_path / "batches" / ".staging") == []


async def test_file_errors_name_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "batches" / "step_3"
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"a file where the step directory belongs")
    async with FileSender(tmp_path, world_size=1) as sender:
        await sender.send(2, [b"fine"])
        with pytest.raises(TransportIOError) as info:
            await sender.send(3, [b"nowhere to go"])
    assert info.value.path == str(batch_path(tmp_path, 3, 0))
    assert "Not a directory" in str(info.value)
    assert os.listdir(tmp_path / "batches" / ".staging") == []  # the staged file is removed

    other = tmp_path / "other"
    (other / "batches").mkdir(parents=True)
    (other / "batches" / ".staging").write_bytes(b"not a directory")
    async with FileSender(other, world_size=1) as sender:
        with pytest.raises(TransportIOError, match="staging"):
            await sender.send(0, [b"x"])

    unreadable = batch_path(tmp_path, 0, 0)
    unreadable.mkdir(parents=True)  # a directory where the file belongs
    async with FileReceiver(tmp_path, 0, timeout=5) as rx:
        with pytest.raises(TransportIOError) as info:
            await rx.receive()
    assert info.value.path == str(unreadable)


# -- the end marker -------------------------------------------------------------------------


async def test_end_marker_ends_iteration_and_later_receives_raise(tmp_path: Path) -> None:
    from trio_rl.wire import encode

    async with FileSender(tmp_path, world_size=2, fsync=False) as sender:
        for s in range(3):
            await sender.send(s, [encode([]), encode([])])
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                seen: dict[int, list[int]] = {}

                async def trainer(rank: int) -> None:
                    async with BatchReceiver.files(tmp_path, rank, delete=True) as rx:
                        seen[rank] = [step async for step, _ in rx]
                        with pytest.raises(EndOfStreamError) as info:
                            await rx.receive()
                        assert info.value.step == 4
                        assert str(end_marker_path(tmp_path)) in str(info.value)

                for rank in range(2):
                    nursery.start_soon(trainer, rank)
                await trio.sleep(0.05)  # the trainers wait for step 3
                await sender.send(3, [encode([]), encode([])])
                await sender.end_stream(4)
        assert seen == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
        assert end_marker_path(tmp_path).read_text() == "4"
        with pytest.raises(RuntimeError, match="ended at step 4"):
            await sender.send(4, [b"", b""])
    # A resumed receiver of a finished stream ends at once.
    async with FileReceiver(tmp_path, 0, start_step=None, timeout=5) as rx:
        assert rx.next_step == 4
        with pytest.raises(EndOfStreamError):
            await rx.receive()
    # A new run in the same directory removes the stale marker with its first send.
    async with FileSender(tmp_path, world_size=2, fsync=False) as sender:
        await sender.send(5, [b"", b""])
        assert not end_marker_path(tmp_path).exists()
        with pytest.raises(ValueError, match="step 5 was already sent"):
            await sender.end_stream(5)


async def test_end_marker_with_a_missing_earlier_file_is_an_error_not_a_hang(
    tmp_path: Path,
) -> None:
    async with FileSender(tmp_path, world_size=1, fsync=False) as sender:
        await sender.send(0, [b"a"])
        await sender.send(1, [b"b"])
        await sender.end_stream(2)
    batch_path(tmp_path, 1, 0).unlink()
    with trio.fail_after(10):
        async with FileReceiver(tmp_path, 0) as rx:
            assert await receive_data(rx) == (0, b"a")
            with pytest.raises(TransportError, match="removed by someone else"):
                await rx.receive()
