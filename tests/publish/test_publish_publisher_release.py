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

from builders import Releases, make_sink, one_per_sample_packer
from operations_waits import documented
from trio_rl.publish import (
    DeferredRelease,
    ReleaseTimeoutError,
    Shipment,
    malloc_trim,
    open_publisher,
    release_containers,
)
from trio_rl.publish._release import _MALLOC_TRIM
from trio_rl.transport import FileSender, batch_path


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
        with pytest.raises(ReleaseTimeoutError, match=r"still running after 0\.05 s") as info:
            await pub.publish()
        documented("a step's deferred release", str(info.value))
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
