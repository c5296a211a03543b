"""Deferred memory release: exactly once per shipped batch, at most one pending, whatever is
cancelled and whenever."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from publisher_support import make_sink, one_per_sample_packer

from trio_rl.publish import (
    DeferredRelease,
    ReleaseTimeoutError,
    Shipment,
    malloc_trim,
    open_publisher,
    release_containers,
)
from trio_rl.publish._release import _MALLOC_TRIM
from trio_rl.train import TrainingSample
from trio_rl.transport import FileSender, batch_path
from trio_rl.wire import MicroBatch


def test_release_containers_empties_lists_and_dicts() -> None:
    items = [[1, 2], [3]]
    outer: list[Any] = list(items)
    mapping: dict[Any, Any] = {i: str(i) for i in range(5)}
    release_containers([outer, mapping])
    assert outer == []
    assert mapping == {}
    assert items == [[1, 2], [3]]  # elements are dropped, not cleared themselves


def test_malloc_trim_is_glibc_only() -> None:
    assert isinstance(malloc_trim(), bool)
    if sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert _MALLOC_TRIM is not None
    if not sys.platform.startswith("linux"):
        assert _MALLOC_TRIM is None
        assert malloc_trim() is False


class Releases:
    """An injected release: records each call (and its containers' sizes), can be gated."""

    def __init__(self, gated: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, containers: Sequence[Any]) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.calls.append([len(c) for c in containers])
        self.started.set()
        self.gate.wait(30)
        release_containers(containers)
        with self._lock:
            self.active -= 1


async def test_each_shipped_batch_is_released_once_and_a_monitor_keeps_its_list(
    tmp_path: Path,
) -> None:
    sink = make_sink(batch_size=2, groups=3)
    releases = Releases()
    shipments: list[Shipment] = []
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=one_per_sample_packer(1), release=releases, monitor=shipments.append
        ) as pub,
    ):
        for _ in range(3):
            assert await pub.publish() is not None
    assert len(releases.calls) == 3
    assert pub.release.scheduled == pub.release.completed == 3
    assert releases.max_active == 1
    # every container handed over was non-empty (the shipped samples, the grid, the payloads)
    assert all(sizes[0] == 2 for sizes in releases.calls)
    for shipment in shipments:
        assert len(shipment.samples) == 2  # the monitor's own list survived the release
        assert all(s.num_tokens == 6 for s in shipment.samples)


@pytest.mark.parametrize("monitor", ["none", "callback that keeps nothing"])
async def test_shipped_samples_are_freed_in_the_release_worker_not_on_the_loop(
    tmp_path: Path, monitor: str
) -> None:
    # Freeing a big step's token lists in one go stalls the loop (~80 ms at 166 MiB), so the
    # last reference to each shipped sample must drop in the release worker, where the samples
    # are popped one at a time: not in the publisher's frame on the loop.
    sink = make_sink(batch_size=4, groups=2)
    freed_on: list[str] = []
    for sample in sink.queued_samples():
        weakref.finalize(sample, lambda: freed_on.append(threading.current_thread().name))
    del sample  # the test holds no reference of its own
    seen: list[int] = []
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            sink,
            sender,
            pack=one_per_sample_packer(1),
            monitor=None if monitor == "none" else (lambda s: seen.append(len(s.samples))),
        ) as pub,
    ):
        assert await pub.publish() is not None
        await pub.release.wait()
        assert len(freed_on) == 4
    assert seen == ([] if monitor == "none" else [4])
    loop_thread = threading.current_thread().name
    assert all(name != loop_thread for name in freed_on), freed_on


async def test_the_next_ship_waits_for_the_pending_release(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, groups=2)
    releases = Releases(gated=True)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1), release=releases) as pub,
        trio.open_nursery() as nursery,
    ):
        await pub.publish()
        await trio.to_thread.run_sync(releases.started.wait)
        done = trio.Event()

        async def second() -> None:
            await pub.publish()
            done.set()

        nursery.start_soon(second)
        # the second batch ships, then waits: its release cannot start before the first ends
        while not batch_path(tmp_path, 2, 0).exists():  # noqa: ASYNC110 (a file, no event)
            await trio.sleep(0.001)
        await trio.sleep(0.02)
        assert not done.is_set()
        assert pub.release.scheduled == 1
        releases.gate.set()
        await done.wait()
    assert len(releases.calls) == 2
    assert releases.max_active == 1


@pytest.mark.parametrize("where", ["pack", "encode"])
async def test_cancelling_during_finalize_puts_the_batch_back_and_releases_nothing_extra(
    tmp_path: Path, where: str
) -> None:
    sink = make_sink(batch_size=2, groups=2)
    releases = Releases()
    entered = threading.Event()
    unblock = threading.Event()
    base = one_per_sample_packer(1)
    calls = {"pack": 0, "encode": 0}

    def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
        calls["pack"] += 1
        if where == "pack" and calls["pack"] == 2:
            entered.set()
            unblock.wait(30)
        return base(samples)

    def enc(mbs: Sequence[MicroBatch]) -> bytes:
        from trio_rl.wire import encode

        calls["encode"] += 1
        if where == "encode" and calls["encode"] == 2:
            entered.set()
            unblock.wait(30)
        return encode(mbs)

    with trio.CancelScope() as outer:
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(sink, sender, pack=pack, encode=enc, release=releases) as pub,
            trio.open_nursery() as nursery,
        ):
            await pub.publish()

            async def cancel_when_entered() -> None:
                await trio.to_thread.run_sync(entered.wait)
                outer.cancel()
                unblock.set()  # the worker is never abandoned: it finishes, then Cancelled

            nursery.start_soon(cancel_when_entered)
            await pub.publish()
            pytest.fail("the second publish should have been cancelled")
    assert outer.cancelled_caught
    assert pub.step == 2
    assert sink.queued == 2  # the second batch went back to the queue
    assert sink.held == 2
    assert not batch_path(tmp_path, 2, 0).exists()
    assert len(releases.calls) == 1  # the first batch's, and only once
    assert pub.release.completed == 1


async def test_cancelling_the_owner_during_a_release_neither_orphans_nor_repeats_it(
    tmp_path: Path,
) -> None:
    sink = make_sink(batch_size=2, groups=1)
    releases = Releases(gated=True)
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as outer:

            async def cancel_then_let_release_finish() -> None:
                await trio.to_thread.run_sync(releases.started.wait)
                outer.cancel()
                await trio.sleep(0.02)  # teardown is now waiting (shielded) for the release
                assert releases.gate.is_set() is False
                releases.gate.set()

            nursery.start_soon(cancel_then_let_release_finish)
            async with (
                FileSender(tmp_path, world_size=1, fsync=False) as sender,
                open_publisher(
                    sink, sender, pack=one_per_sample_packer(1), release=releases
                ) as pub,
            ):
                await pub.publish()
                await trio.sleep_forever()
        # the publisher block exited only after the release had run to completion
        assert pub.release.completed == 1
        assert not pub.release.pending
    assert outer.cancelled_caught
    assert len(releases.calls) == 1
    assert releases.max_active == 1


async def test_a_release_past_its_deadline_fails_the_next_ship(tmp_path: Path) -> None:
    sink = make_sink(batch_size=2, groups=2)
    releases = Releases(gated=True)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(
            sink, sender, pack=one_per_sample_packer(1), release=releases, release_timeout=0.05
        ) as pub,
    ):
        await pub.publish()
        with pytest.raises(ReleaseTimeoutError, match=r"still running after 0\.05 s"):
            await pub.publish()
        # the second batch was shipped and booked before the wait; only its release is lost
        assert pub.step == 3
        assert pub.release.scheduled == 1
        releases.gate.set()
    assert len(releases.calls) == 1


async def test_a_failing_release_is_logged_and_does_not_stop_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def release(containers: Sequence[Any]) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("trim failed")

    sink = make_sink(batch_size=2, groups=2)
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1), release=release) as pub,
    ):
        await pub.publish()
        await pub.publish()
    assert calls == [0, 1]
    assert [str(e) for e in pub.release.errors] == ["trim failed"]
    assert "memory release of a shipped batch failed" in caplog.text


async def test_deferred_release_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        DeferredRelease(trio.CapacityLimiter(1), timeout=0)


@given(
    groups=st.integers(1, 6),
    batch_size=st.integers(1, 4),
    world_size=st.integers(1, 3),
    cancel_at=st.integers(0, 30),
)
def test_cancellation_at_any_worker_job_keeps_releases_and_accounting_exact(
    tmp_path_factory: pytest.TempPathFactory,
    groups: int,
    batch_size: int,
    world_size: int,
    cancel_at: int,
) -> None:
    """Cancel the publisher's owner at the ``cancel_at``-th worker job (pack, encode,
    checkpoint write, release): every shipped batch is released exactly once and checkpointed
    once, no unshipped batch is, and every sample is shipped or back in the queue."""
    tmp_path = tmp_path_factory.mktemp("cancel")
    sink = make_sink(batch_size=batch_size, groups=groups)
    total = sink.queued
    base = one_per_sample_packer(world_size)
    releases: list[int] = []
    jobs = 0
    shipped_steps: list[int] = []
    checkpoints: list[int] = []
    pending: list[int] = []

    async def main() -> None:
        token = trio.lowlevel.current_trio_token()
        scope = trio.CancelScope()

        def job() -> None:
            nonlocal jobs
            jobs += 1
            if jobs == cancel_at:
                trio.from_thread.run_sync(scope.cancel, trio_token=token)

        def pack(samples: Sequence[TrainingSample]) -> list[list[MicroBatch]]:
            job()
            return base(samples)

        def enc(mbs: Sequence[MicroBatch]) -> bytes:
            from trio_rl.wire import encode

            job()
            return encode(mbs)

        def release(containers: Sequence[Any]) -> None:
            job()
            releases.append(len(containers[0]))
            release_containers(containers)

        class Checkpoints:
            def snapshot(self, step: int) -> int:
                return step

            def write(self, step: int) -> None:
                job()
                checkpoints.append(step)

        with scope:
            async with (
                FileSender(tmp_path, world_size=world_size, fsync=False) as sender,
                open_publisher(
                    sink, sender, pack=pack, encode=enc, release=release, checkpointer=Checkpoints()
                ) as pub,
            ):
                try:
                    while True:
                        record = await pub.publish(force=True)
                        if record is None:
                            break
                        shipped_steps.append(record.step)
                finally:
                    pending.extend(pub.pending_steps)

    trio.run(main)
    shipped = sink.step - 1
    assert shipped_steps == list(range(1, len(shipped_steps) + 1))
    assert len(shipped_steps) in (shipped, shipped - 1)  # the last may be cancelled after send
    assert len(releases) == shipped  # exactly once per shipped batch
    assert checkpoints == list(range(1, shipped + 1))  # and one checkpoint per shipped step
    assert sum(releases) == sink.counters.shipped
    assert sink.counters.shipped + sink.queued == total
    assert sink.held == sink.queued  # nothing stuck in a cut
    # a step booked (and checkpointed) whose send was cancelled stays pending, to be re-sent
    assert set(pending) <= {shipped}
    for step in range(1, shipped + 1):
        assert batch_path(tmp_path, step, 0).exists() != (step in pending)
    assert not batch_path(tmp_path, shipped + 1, 0).exists()
