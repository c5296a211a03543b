"""Filesystem publication streams rank by rank: each rank is encoded with `encode_into`
straight into its staged file, so the publisher's peak memory is about one micro-batch's
encoding buffer, while the outbox keeps the step's exact bytes (exactly-once)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest
import trio
from streaming_peak import fixed, micro_batch

from builders import make_sink
from trio_rl.publish import (
    PublishError,
    Shipment,
    SinkCheckpointer,
    open_publisher,
    pack_lazily,
    pack_samples,
)
from trio_rl.sink import CheckpointManager
from trio_rl.transport import (
    FileSender,
    MemorySender,
    StagingSender,
    TransportIOError,
    batch_path,
)
from trio_rl.wire import encode

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "outbox"])
def test_peak_memory_of_a_multi_rank_step_is_about_onemicro_batch(
    tmp_path: Path, durable: bool
) -> None:
    out = subprocess.run(
        [sys.executable, str(HERE / "streaming_peak.py"), str(tmp_path), "1" if durable else "0"],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},  # tests/: the shared builders
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    rank_bytes = min(got["rank_bytes"])
    assert rank_bytes > 2 << 20  # each rank's payload is several MiB
    # Holding every rank's payload at once (4 ranks) needs > 4 x rank_bytes; streaming needs
    # about one micro-batch's buffer (a quarter of a rank's payload here).
    assert got["peak"] < rank_bytes, f"peak {got['peak']} B for ranks of {rank_bytes} B"
    assert got["payload_bytes"] == sum(got["rank_bytes"])
    assert got["files_match"]
    assert os.listdir(tmp_path / "batches" / ".staging") == []
    if durable:
        assert not list((tmp_path / "ckpt").glob("outbox_step_*.bin"))


class _FlakyCommit(FileSender):
    """Fails the first commit after renaming rank 0 (a partial delivery)."""

    failures = 1

    async def commit(self, step: int) -> None:
        if self.failures:
            self.failures -= 1
            staged, final = self.staged_path(step, 0), batch_path(self.directory, step, 0)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, final)
            raise TransportIOError("injected: the commit died after rank 0", str(final))
        await super().commit(step)


async def test_a_failed_streamed_commit_stays_pending_with_its_outbox_and_is_committed_again(
    tmp_path: Path,
) -> None:
    grid = [[micro_batch(r, 0)] for r in range(2)]
    expected = [encode(ranks) for ranks in grid]
    sink = make_sink(2, groups=2)
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    async with (
        _FlakyCommit(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=fixed(grid), checkpointer=SinkCheckpointer(manager, sink)
        ) as pub,
    ):
        assert isinstance(sender, StagingSender)
        assert sender.can_stage
        with pytest.raises(TransportIOError, match="injected"):
            await pub.publish()
        assert pub.pending_steps == [1]
        assert sink.step == 2  # booked: the books say shipped
        # the outbox holds the step's exact bytes, read back from the staged files
        assert manager.read_outbox(1) == expected
        assert await pub.resend_pending() == [1]
    assert pub.pending_steps == []
    for rank in range(2):
        assert batch_path(tmp_path, 1, rank).read_bytes() == expected[rank]
    assert manager.read_outbox(1) is None
    assert os.listdir(tmp_path / "batches" / ".staging") == []


class _FailingStage(FileSender):
    """Staging rank 1 fails."""

    def stage(self, step: int, rank: int, write: Callable[[BinaryIO], object]) -> int:
        if rank == 1:
            raise TransportIOError("injected: no space for rank 1", str(self.staged_path(step, 1)))
        return super().stage(step, rank, write)


async def test_a_failed_stage_removes_the_staged_ranks_and_requeues_the_batch(
    tmp_path: Path,
) -> None:
    grid = [[micro_batch(r, 0)] for r in range(2)]
    sink = make_sink(2, groups=1)
    async with (
        _FailingStage(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(sink, sender, pack=fixed(grid)) as pub,
    ):
        with pytest.raises(TransportIOError, match="injected"):
            await pub.publish()
    assert (sink.step, sink.queued) == (1, 2)  # requeued, step unchanged
    assert os.listdir(tmp_path / "batches" / ".staging") == []
    assert not (tmp_path / "batches" / "step_1").exists()


async def test_a_send_timeout_on_a_streamed_step_unstages_it(tmp_path: Path) -> None:
    class Stuck(FileSender):
        async def commit(self, step: int) -> None:
            await trio.sleep_forever()

    grid = [[micro_batch(0, 0)]]
    sink = make_sink(2, groups=1)
    async with (
        Stuck(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=fixed(grid), send_timeout=0.1) as pub,
    ):
        with trio.fail_after(10), pytest.raises(PublishError, match=r"within 0\.1 s"):
            await pub.publish()
    assert (sink.step, sink.queued) == (1, 2)
    assert os.listdir(tmp_path / "batches" / ".staging") == []


async def test_a_subclass_that_overrides_send_keeps_send_as_its_delivery(tmp_path: Path) -> None:
    sent: list[int] = []

    class Hooked(FileSender):
        async def send(self, step: int, payloads: Sequence[bytes | bytearray | memoryview]) -> None:
            sent.append(step)
            await super().send(step, payloads)

    grid = [[micro_batch(0, 0)]]
    expected = encode(grid[0])
    async with (
        Hooked(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(make_sink(2, groups=1), sender, pack=fixed(grid)) as pub,
    ):
        assert not sender.can_stage
        assert await pub.publish() is not None
    assert sent == [1]
    assert batch_path(tmp_path, 1, 0).read_bytes() == expected


async def test_lazy_ranks_reach_a_non_staging_sender_as_the_eager_bytes() -> None:
    # A MemorySender cannot stage: each lazy rank is streamed into an in-memory buffer, one
    # micro-batch built at a time; the bytes are those of the eagerly packed shipped samples.
    sink = make_sink(batch_size=6, groups=3)
    shipped: list[Shipment] = []
    got = []
    with trio.fail_after(10):
        async with (
            MemorySender(2) as sender,
            open_publisher(
                sink,
                sender,
                pack=functools.partial(pack_lazily, seq_len=8, num_ranks=2),
                monitor=shipped.append,
            ) as publisher,
        ):
            record = await publisher.publish()
            assert record is not None
            for rank in range(2):
                async with sender.receiver(rank, start_step=record.step) as receiver:
                    got.append(bytes((await receiver.receive()).data))
    (shipment,) = shipped
    eager = pack_samples(shipment.samples, seq_len=8, num_ranks=2)
    assert len(shipment.samples) == 6
    assert got == [encode(rank) for rank in eager]
