"""One capacity limiter per pipeline: the publisher passes its limiter down to the sender,
the trainer's receiver passes its limiter down to its transport, and the record shows it."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from builders import make_sink, one_per_sample_packer
from trio_rl.publish import open_publisher
from trio_rl.sink import TrainingSample
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender, MemorySender
from trio_rl.wire import MicroBatch


async def test_a_limiter_of_one_serializes_the_publishers_jobs_and_the_senders_writes(
    tmp_path: Path,
) -> None:
    limiter = trio.CapacityLimiter(1)
    packing, release_pack = threading.Event(), threading.Event()
    base = one_per_sample_packer(1)

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        packing.set()
        assert release_pack.wait(10), "the test never released the packer"
        return base(samples)

    sent = trio.Event()
    with trio.fail_after(20):
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(make_sink(2, groups=2), sender, pack=pack, limiter=limiter) as pub,
        ):
            assert sender.limiter is limiter is pub.limiter
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pub.publish)
                await trio.to_thread.run_sync(packing.wait)  # the packer holds the one token

                async def send_other() -> None:
                    await sender.send(99, [b"other"])
                    sent.set()

                nursery.start_soon(send_other)
                await trio.sleep(0.2)
                # The sender's write waits for the token the packer holds.
                assert not sent.is_set()
                assert limiter.statistics().tasks_waiting == 1
                release_pack.set()
            assert sent.is_set()


async def test_the_record_shows_the_limiter_size_and_the_busy_threads(tmp_path: Path) -> None:
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            make_sink(2, groups=1),
            sender,
            pack=one_per_sample_packer(1),
            limiter=trio.CapacityLimiter(3),
        ) as pub,
    ):
        record = await pub.publish()
    assert record is not None
    assert record.threads.limit == 3
    assert 1 <= record.threads.busy_max <= 3
    flat = record.as_dict()
    assert flat["threads/limit"] == 3.0
    assert flat["threads/busy_max"] == float(record.threads.busy_max)


async def test_without_a_limiter_the_publisher_adopts_the_senders(tmp_path: Path) -> None:
    own = trio.CapacityLimiter(2)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False, limiter=own) as sender,
        open_publisher(make_sink(2), sender, pack=one_per_sample_packer(1)) as pub,
    ):
        assert pub.limiter is own


async def test_a_sender_with_another_limiter_is_refused(tmp_path: Path) -> None:
    sender = FileSender(tmp_path, world_size=1, limiter=trio.CapacityLimiter(1))
    with pytest.raises(ValueError, match="one limiter"):
        async with open_publisher(
            make_sink(2), sender, pack=one_per_sample_packer(1), limiter=trio.CapacityLimiter(4)
        ):
            pass  # pragma: no cover


async def test_a_transport_without_threads_takes_any_limiter() -> None:
    async with (
        MemorySender(1) as sender,
        open_publisher(
            make_sink(2), sender, pack=one_per_sample_packer(1), limiter=trio.CapacityLimiter(2)
        ) as pub,
    ):
        assert pub.limiter.total_tokens == 2
        assert sender.limiter is None


def test_the_batch_receiver_passes_its_limiter_down_to_the_file_receiver(tmp_path: Path) -> None:
    limiter = trio.CapacityLimiter(2)
    receiver = BatchReceiver.files(tmp_path, 0, limiter=limiter)
    assert receiver.transport.limiter is limiter
    # without one, the transport's own limiter serves the decoding too
    own = trio.CapacityLimiter(1)
    receiver = BatchReceiver(FileReceiver(tmp_path, 0, limiter=own))
    assert receiver.transport.limiter is own
    with pytest.raises(ValueError, match="one limiter"):
        BatchReceiver(FileReceiver(tmp_path, 0, limiter=own), limiter=limiter)


async def test_the_orchestrators_limiter_reaches_the_file_sender(tmp_path: Path) -> None:
    # End to end as the CLI opens a run: a FileSender built without a limiter, the run's
    # limiter (sized by configuration) given to open_orchestrator.
    from trio_rl.engines import SimulatedEngine
    from trio_rl.orchestrator import open_orchestrator
    from trio_rl.rollout import InMemorySource
    from trio_rl.samples import Prompt

    limiter = trio.CapacityLimiter(3)
    engine = SimulatedEngine(slots=4, seed=1, seconds_per_token=1e-7)
    source = InMemorySource([Prompt(key=f"p{i}", tokens=(i, 1)) for i in range(4)])
    with trio.fail_after(20):
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_orchestrator(engine, source, sender, limiter=limiter) as orch,
        ):
            assert orch.limiter is limiter
            assert orch.publisher.limiter is limiter
            assert sender.limiter is limiter
