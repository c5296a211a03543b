"""Filesystem publication streams rank by rank: each rank is encoded with `encode_into`
straight into its staged file, so the publisher's peak memory is about one micro-batch's
encoding buffer, while the outbox keeps the step's exact bytes (exactly-once)."""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest
import trio
from publisher_support import make_sink

from trio_rl.publish import PublishError, SinkCheckpointer, open_publisher
from trio_rl.train import CheckpointManager, TrainingSample
from trio_rl.transport import FileSender, StagingSender, TransportIOError, batch_path
from trio_rl.wire import MicroBatch, encode

WORLD, PER_RANK, TOKENS = 4, 4, 20_000


def _micro_batch(rank: int, index: int) -> MicroBatch:
    base = rank * 100 + index
    return MicroBatch(
        input_ids=[base + i for i in range(TOKENS)],
        loss_mask=[i % 2 == 0 for i in range(TOKENS)],
        advantages=[float(base) / 7] * TOKENS,
        inference_logprobs=[-0.5 - i / TOKENS for i in range(TOKENS)],
        position_ids=list(range(TOKENS)),
        sequence_lengths=[TOKENS],
        temperatures=[1.0] * TOKENS,
        env_names=[f"env-{rank}"],
        seq_lens=[TOKENS],
    )


def _grid() -> list[list[MicroBatch]]:
    return [[_micro_batch(r, i) for i in range(PER_RANK)] for r in range(WORLD)]


def _fixed(
    grid: list[list[MicroBatch]],
) -> Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]:
    # The grid is built before measuring: what is measured is encoding and writing.
    return lambda samples: grid


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "outbox"])
async def test_peak_memory_of_a_multi_rank_step_is_about_one_micro_batch(
    tmp_path: Path, durable: bool
) -> None:
    grid = _grid()
    expected = [encode(ranks) for ranks in grid]  # (the release empties the grid once shipped)
    rank_bytes = min(map(len, expected))
    assert rank_bytes > 2 << 20  # each rank's payload is several MiB
    sink = make_sink(2, groups=1)
    checkpointer = (
        SinkCheckpointer(CheckpointManager(tmp_path / "ckpt", keep=2), sink) if durable else None
    )
    async with (
        FileSender(tmp_path, world_size=WORLD, fsync=False) as sender,
        open_publisher(sink, sender, pack=_fixed(grid), checkpointer=checkpointer) as pub,
    ):
        gc.collect()
        tracemalloc.start()
        try:
            record = await pub.publish()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert record is not None
    # Holding every rank's payload at once (4 ranks) needs > 4 x rank_bytes; streaming needs
    # about one micro-batch's buffer (a quarter of a rank's payload here).
    assert peak < rank_bytes, f"peak {peak} B for ranks of {rank_bytes} B"
    assert record.payload_bytes == sum(map(len, expected))
    for rank in range(WORLD):
        assert batch_path(tmp_path, 1, rank).read_bytes() == expected[rank]
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
    grid = [[_micro_batch(r, 0)] for r in range(2)]
    expected = [encode(ranks) for ranks in grid]
    sink = make_sink(2, groups=2)
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    async with (
        _FlakyCommit(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=_fixed(grid), checkpointer=SinkCheckpointer(manager, sink)
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
    grid = [[_micro_batch(r, 0)] for r in range(2)]
    sink = make_sink(2, groups=1)
    async with (
        _FailingStage(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(sink, sender, pack=_fixed(grid)) as pub,
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

    grid = [[_micro_batch(0, 0)]]
    sink = make_sink(2, groups=1)
    async with (
        Stuck(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=_fixed(grid), send_timeout=0.1) as pub,
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

    grid = [[_micro_batch(0, 0)]]
    expected = encode(grid[0])
    async with (
        Hooked(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(make_sink(2, groups=1), sender, pack=_fixed(grid)) as pub,
    ):
        assert not sender.can_stage
        assert await pub.publish() is not None
    assert sent == [1]
    assert batch_path(tmp_path, 1, 0).read_bytes() == expected
