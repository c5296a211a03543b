"""#3806: a discarded group is scalarized when it finishes and its samples are freed at once,
not held until another batch ships (a weakref to each dies before the next ship)."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import trio

from builders import make_group, one_per_sample_packer
from trio_rl.publish import open_publisher
from trio_rl.samples import Group, SampleStatus
from trio_rl.sink import SinkConfig, TrainSink
from trio_rl.transport import FileSender


def _watch(group: Group) -> list[weakref.ref[object]]:
    refs: list[weakref.ref[object]] = [weakref.ref(group)]
    refs += [weakref.ref(s) for s in group.samples]
    return refs


def _discard(sink: TrainSink, how: str) -> list[weakref.ref[object]]:
    """A group the sink discards, ``how``; returns weakrefs to it and its samples (the test
    keeps no other reference)."""
    if how == "zero advantage":  # scored: every member pruned
        group = make_group([1.0, 1.0, 1.0])
        refs = _watch(group)
        sink.add_group(group)
    elif how == "aborted":  # scored: filtered whole
        group = make_group(
            [1.0, 0.0, 1.0], statuses=[SampleStatus.COMPLETED] * 2 + [SampleStatus.ABORTED]
        )
        refs = _watch(group)
        sink.add_group(group)
    elif how == "stale":  # scored, voided as stale
        group = make_group([1.0, 0.0, 1.0], version=0)
        refs = _watch(group)
        sink.add_group(group)
    else:  # reported member by member by the driver, then discarded by it
        group = make_group([1.0, 0.0, 1.0])
        refs = _watch(group)
        sink.book.group_opened(group)
        sink.book.members_arrived(group, group.samples[:2])
        sink.book.group_discarded(group, how)
    return refs


@pytest.mark.parametrize("how", ["zero advantage", "aborted", "stale", "filtered", "failed"])
async def test_a_discarded_group_is_freed_before_the_next_ship(tmp_path: Path, how: str) -> None:
    # batch 4 with m = 1: version 0 is stale, version 3 fresh
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=1), step=4)
    before = sink.window.attempts
    refs = _discard(sink, how)
    # scalarized: its attempts are in the window; freed: nothing refers to it any more
    assert sink.window.attempts == before + 3
    assert sink.open_group_ids() == []
    assert sink.queued == 0
    assert [r() for r in refs] == [None] * len(refs)
    # the next ship is of other work, and still finds the discarded group's numbers
    sink.add_group(make_group([1.0, 0.0], version=3))
    with trio.fail_after(20):
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub,
        ):
            record = await pub.publish()
    assert record is not None
    assert record.all.attempts == 5
    assert record.effective.samples == 2
