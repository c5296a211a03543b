"""The publisher ships the sink's batches: what goes where, and what runs on which thread."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

from builders import make_group, make_sink, one_per_sample_packer
from trio_rl.errors import InvalidArgumentError
from trio_rl.publish import (
    BatchSource,
    PublishError,
    Shipment,
    ShipRecord,
    SinkCheckpointer,
    open_publisher,
)
from trio_rl.sink import CheckpointManager, PruneMode, TrainingSample, read_checkpoint
from trio_rl.transport import (
    FileSender,
    ZmqReceiver,
    ZmqSender,
    batch_path,
    free_port_pair,
)
from trio_rl.wire import MicroBatch, decode, encode


def _decode(path: Path) -> list[list[Any]]:
    decoded: list[list[Any]] = msgpack.unpackb(path.read_bytes())
    return decoded


async def test_ships_a_batch_to_every_rank_and_advances_the_step(tmp_path: Path) -> None:
    sink = make_sink(batch_size=4, groups=3)  # 6 queued
    shipments: list[Shipment] = []
    async with (
        FileSender(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=one_per_sample_packer(2), monitor=shipments.append
        ) as pub,
    ):
        record = await pub.publish()
        assert record is not None
        assert record.step == 1
        assert pub.step == sink.step == 2
        assert sink.queued == 2
        for rank in range(2):
            payload = _decode(batch_path(tmp_path, 1, rank))
            assert len(payload) == 2 == record.micro_batches_per_rank
            assert all(len(mb) == 20 for mb in payload)
        assert record.ranks == 2
        assert record.payload_bytes == sum(
            batch_path(tmp_path, 1, r).stat().st_size for r in range(2)
        )
        assert record.effective.samples == 4
        assert record.effective.groups == 2
        assert record.effective.tokens == 4 * 6
        assert record.effective.loss_tokens == 4 * 4
        assert record.all.outcomes["shipped"] == 4
        assert record.all.attempts == 6  # three groups of two finalized in the window
        assert record.all.reward_mean == pytest.approx(0.5)
        assert record.counters["shipped"] == 4
        assert record.counters["dispatched"] == 6
        assert shipments[0].record is record
        assert len(shipments[0].samples) == 4

        # not enough left for a batch: nothing happens
        assert await pub.publish() is None
        assert pub.step == 2
        # forcing a drain ships what there is
        drained = await pub.publish(force=True)
        assert drained is not None
        assert drained.step == 2
        assert drained.effective.samples == 2
        assert drained.all.attempts == 0  # the window was read and reset by the first batch
    assert sink.queued == 0


async def test_the_payload_is_the_wire_encoding_of_the_packed_grid(tmp_path: Path) -> None:
    sink = make_sink(batch_size=3, groups=2)
    packed: list[list[list[MicroBatch]]] = []
    base = one_per_sample_packer(3)

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        grid = base(samples)
        packed.append([list(rank) for rank in grid])  # a copy the release cannot empty
        return grid

    async with (
        FileSender(tmp_path, world_size=3, fsync=False) as sender,
        open_publisher(sink, sender, pack=pack) as pub,
    ):
        await pub.publish()
    for rank, micro_batches in enumerate(packed[0]):
        assert batch_path(tmp_path, 1, rank).read_bytes() == encode(micro_batches)


async def test_ships_over_zeromq_to_trainer_ranks() -> None:
    port = free_port_pair()
    sink = make_sink(batch_size=4, groups=4)
    packed: list[list[list[MicroBatch]]] = []
    base = one_per_sample_packer(2)

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        grid = base(samples)
        packed.append([list(rank) for rank in grid])
        return grid

    received: dict[int, list[tuple[int, list[MicroBatch]]]] = {0: [], 1: []}
    with trio.fail_after(30):
        async with (
            ZmqSender(2, port=port, ready_timeout=20) as sender,
            ZmqReceiver(0, port=port, start_step=1) as rank0,
            ZmqReceiver(1, port=port, start_step=1) as rank1,
            open_publisher(sink, sender, pack=pack) as pub,
            trio.open_nursery() as nursery,
        ):

            async def receive(rx: ZmqReceiver) -> None:
                for _ in range(2):
                    item = await rx.receive()
                    received[rx.rank].append((item.step, decode(item.data)))

            nursery.start_soon(receive, rank0)
            nursery.start_soon(receive, rank1)
            assert (await pub.publish()) is not None
            assert (await pub.publish()) is not None
    for rank in (0, 1):
        assert received[rank] == [(1, packed[0][rank]), (2, packed[1][rank])]


async def test_cpu_work_runs_in_worker_threads_on_the_shared_limiter(tmp_path: Path) -> None:
    limiter = trio.CapacityLimiter(2)
    seen: dict[str, tuple[bool, int]] = {}
    sink = make_sink(batch_size=2, groups=1)

    def probe(name: str) -> None:
        # (ran on the main thread?, tasks borrowing the limiter right now)
        borrowers = trio.from_thread.run_sync(lambda: len(limiter.statistics().borrowers))
        seen[name] = (threading.current_thread() is threading.main_thread(), borrowers)

    base = one_per_sample_packer(1)

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        probe("pack")
        return base(samples)

    def enc(micro_batches: Sequence[MicroBatch]) -> bytes:
        probe("encode")
        return encode(micro_batches)

    def release(containers: Sequence[Any]) -> None:
        probe("release")

    class Checkpoints:
        def snapshot(self, step: int) -> int:
            seen["snapshot"] = (threading.current_thread() is threading.main_thread(), -1)
            return step

        def write(self, snapshot: int) -> None:
            probe("checkpoint")

    async with (
        FileSender(tmp_path, world_size=1, fsync=False, limiter=limiter) as sender,
        open_publisher(
            sink,
            sender,
            pack=pack,
            encode=enc,
            limiter=limiter,
            release=release,
            checkpointer=Checkpoints(),
        ) as pub,
    ):
        assert pub.limiter is limiter
        await pub.publish()
    assert seen.pop("snapshot") == (True, -1)  # the snapshot is taken on the loop
    assert set(seen) == {"pack", "encode", "checkpoint", "release"}
    for on_main_thread, borrowers in seen.values():
        assert not on_main_thread
        # the job holds a token of the shared limiter (the release may overlap the checkpoint)
        assert 1 <= borrowers <= 2


async def test_pruning_after_selection_runs_in_a_worker_and_ships_only_survivors(
    tmp_path: Path,
) -> None:
    sink = make_sink(batch_size=4, prune=PruneMode.AFTER_SELECTION)
    # zero advantages: pruned after selection
    sink.add_group(make_group([1.0, 1.0], group_id="flat", prompt_len=2))
    sink.add_group(make_group([1.0, 0.0], group_id="live", prompt_len=2))
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub,
    ):
        record = await pub.publish()
    assert record is not None
    assert record.effective.samples == 2
    assert record.all.outcomes["pruned"] == 2
    assert sink.counters.pruned == 2
    assert sink.counters.shipped == 2
    assert len(_decode(batch_path(tmp_path, 1, 0))) == 2


async def test_an_all_pruned_cut_ships_nothing_and_keeps_step_and_window(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, prune=PruneMode.AFTER_SELECTION)
    sink.add_group(make_group([0.5, 0.5], group_id="flat", prompt_len=2))
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub,
    ):
        assert await pub.publish() is None
        assert pub.step == 1
        assert sink.window.attempts == 2  # carried over to the next batch
        sink.add_group(make_group([1.0, 0.0], group_id="live", prompt_len=2))
        record = await pub.publish()
    assert record is not None
    assert record.step == 1
    assert record.all.attempts == 4
    assert record.all.outcomes["pruned"] == 2
    assert not (tmp_path / "batches" / "step_2").exists()


async def test_checkpoint_snapshot_is_taken_after_the_step_advanced(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, groups=2)
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    cursor = {"position": 7}
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            sink,
            sender,
            pack=one_per_sample_packer(1),
            checkpointer=SinkCheckpointer(manager, sink, cursor=lambda: cursor),
        ) as pub,
    ):
        await pub.publish()
        cursor["position"] = 9  # later mutation does not tear the snapshot already written
        ckpt = read_checkpoint(manager.path_for(1))
        assert ckpt.step == 1
        assert ckpt.sink.step == 2
        assert len(ckpt.sink.queued) == 2
        assert ckpt.cursor == {"position": 7}
        await pub.publish()
    assert [p.name for p in manager.list_checkpoints()] == [
        manager.path_for(1).name,
        manager.path_for(2).name,
    ]


async def test_policy_wait_completed_during_the_metrics_is_reported_with_that_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_rl.publish._publisher as publisher_module
    from trio_rl.publish._metrics import batch_stats

    in_metrics = threading.Event()
    proceed = threading.Event()
    real = batch_stats

    def slow_stats(samples: Sequence[TrainingSample], *args: Any) -> Any:
        in_metrics.set()
        proceed.wait(10)
        return real(samples, *args)

    monkeypatch.setattr(publisher_module, "batch_stats", slow_stats)
    sink = make_sink(batch_size=2, groups=2)
    send, receive = trio.open_memory_channel[Shipment](0)
    records: list[ShipRecord] = []
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1), monitor=send) as pub,
        trio.open_nursery() as nursery,
    ):

        async def publish_twice() -> None:
            for _ in range(2):
                record = await pub.publish()
                assert record is not None
                records.append(record)

        pub.add_policy_wait(1.0)  # before the batch
        nursery.start_soon(publish_twice)
        await trio.to_thread.run_sync(in_metrics.wait)
        pub.add_policy_wait(2.0)  # completes while the worker computes the metrics
        proceed.set()
        # poll: the publisher is blocked delivering the first record (no event to wait on)
        while send.statistics().tasks_waiting_send == 0:  # noqa: ASYNC110
            await trio.sleep(0.001)
        pub.add_policy_wait(4.0)  # completes during the monitor I/O: belongs to the next record
        first = await receive.receive()
        second = await receive.receive()
    assert first.record.policy_wait == 3.0
    assert second.record.policy_wait == 4.0
    assert [r.policy_wait for r in records] == [3.0, 4.0]


def test_negative_policy_wait_is_rejected() -> None:
    async def main() -> None:
        async with (
            FileSender(".", world_size=1) as sender,
            open_publisher(make_sink(2), sender, pack=one_per_sample_packer(1)) as pub,
        ):
            with pytest.raises(ValueError, match="policy wait"):
                pub.add_policy_wait(-1.0)
            with pytest.raises(ValueError, match="policy wait"):
                pub.add_policy_wait(float("nan"))

    trio.run(main)


async def test_a_packer_with_the_wrong_rank_count_fails_and_the_batch_goes_back(
    tmp_path: Path,
) -> None:
    sink = make_sink(batch_size=2, groups=1)
    async with (
        FileSender(tmp_path, world_size=2, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(3)) as pub,
    ):
        with pytest.raises(PublishError, match=r"step 1: the packer returned 3 rank lists"):
            await pub.publish()
        assert pub.step == 1
        assert sink.queued == 2
        assert sink.held == 2
        assert sink.counters.shipped == 0


async def test_a_send_failure_puts_the_batch_back(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, groups=1)
    sender = FileSender(tmp_path, world_size=1, fsync=False)
    await sender.aclose()  # sends now raise ClosedResourceError
    async with open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub:
        with pytest.raises(trio.ClosedResourceError):
            await pub.publish()
        assert pub.step == 1
        assert sink.queued == 2
        assert pub.release.scheduled == 0


async def test_a_closed_publisher_refuses_to_publish(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, groups=1)
    async with FileSender(tmp_path, world_size=1, fsync=False) as sender:
        async with open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub:
            pass
        assert pub.closed
        with pytest.raises(trio.ClosedResourceError, match="closed publisher"):
            await pub.publish()
    assert sink.queued == 2


async def test_a_monitor_channel_that_does_not_receive_times_out(tmp_path: Path) -> None:
    from trio_rl.publish import MonitorTimeoutError

    sink = make_sink(batch_size=2, groups=1)
    send, receive = trio.open_memory_channel[Shipment](0)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=one_per_sample_packer(1), monitor=send, monitor_timeout=0.05
        ) as pub,
    ):
        with pytest.raises(MonitorTimeoutError, match="step 1"):
            await pub.publish()
        # the batch was shipped before the monitor: it stays shipped
        assert pub.step == 2
        assert batch_path(tmp_path, 1, 0).exists()
    receive.close()


def test_the_train_sink_is_a_batch_source() -> None:
    # static (mypy) and structural: the publisher needs nothing the sink does not expose
    source: BatchSource = make_sink(batch_size=2)
    for name in ("config", "step", "counters", "queued"):
        assert hasattr(source, name)
    for name in ("ready", "cut", "detach_batch", "settle_batch", "requeue_batch"):
        assert callable(getattr(source, name))


def test_a_bad_policy_wait_is_an_invalid_argument_naming_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            FileSender(tmp_path, world_size=1) as sender,
            open_publisher(make_sink(2), sender, pack=one_per_sample_packer(1)) as pub,
        ):
            with pytest.raises(
                InvalidArgumentError, match=r"add_policy_wait seconds .* must be >= 0, got -1.0"
            ):
                pub.add_policy_wait(-1.0)

    trio.run(main)
