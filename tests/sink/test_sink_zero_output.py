"""#3806's zero-output budget: finished groups that gave the trainer nothing add units (the
survivors, else the members returned, else the members owed; tokens in token mode); each
batch-equivalent crossed warns once; a group that queues training samples resets the count,
a group voided as stale does not."""

from __future__ import annotations

import logging

import pytest

from builders import make_group
from trio_rl.samples import Prompt, SampleStatus
from trio_rl.sink import SinkConfig, TrainSink

WARNING = "no admitted train payload after"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.sink")


def test_each_batch_equivalent_of_empty_groups_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = TrainSink(SinkConfig(batch_size=4, max_off_policy_steps=None))
    for n in range(1, 5):  # equal rewards: all pruned, nothing queued; 2 returned members each
        sink.add_group(make_group([1.0, 1.0]))
        assert sink.zero_output.units == 2 * n
    assert sink.queued == 0
    assert _warnings(caplog) == [
        "no admitted train payload after 4 finalized units (samples; 1 batch-equivalent(s) "
        "of 4): every group finished since the last admitted one gave nothing to train "
        "(stale, filtered, zero-advantage, failed or cancelled)",
        "no admitted train payload after 8 finalized units (samples; 2 batch-equivalent(s) "
        "of 4): every group finished since the last admitted one gave nothing to train "
        "(stale, filtered, zero-advantage, failed or cancelled)",
    ]
    sink.add_group(make_group([1.0, 0.0]))  # admitted: the count starts again
    assert sink.queued == 2
    assert (sink.zero_output.units, sink.zero_output.reported) == (0, 0)
    caplog.clear()
    for _ in range(2):
        sink.add_group(make_group([0.0, 0.0]))
    assert len(_warnings(caplog)) == 1
    assert "after 4 finalized units" in _warnings(caplog)[0]


def test_a_group_voided_as_stale_adds_units_and_does_not_reset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # batch 5, m = 1: work of version < 3 is stale
    sink = TrainSink(SinkConfig(batch_size=4, max_off_policy_steps=1), step=5)
    sink.add_group(make_group([1.0, 1.0], version=4))  # fresh, but zero advantage: 2 units
    sink.add_group(make_group([1.0, 0.0], version=1))  # signal, but stale: voided, 2 units
    assert sink.queued == 0
    assert sink.counters.stale == 2
    assert sink.zero_output.units == 4
    assert len(_warnings(caplog)) == 1


def test_members_owed_count_when_nothing_returned(caplog: pytest.LogCaptureFixture) -> None:
    sink = TrainSink(SinkConfig(batch_size=3, max_off_policy_steps=None))
    sink.open_group("g", Prompt("k", (1, 2)), 3)
    sink.record_failed(2, "g")
    sink.record_cancelled(1, "g")  # the group completes with no member returned
    assert sink.open_group_ids() == []
    assert sink.zero_output.units == 3
    assert len(_warnings(caplog)) == 1


def test_a_group_discarded_by_the_driver_adds_its_units(caplog: pytest.LogCaptureFixture) -> None:
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    group = make_group([1.0, 0.0, 1.0])
    sink.book.group_opened(group)
    sink.book.group_discarded(group, "filtered")
    assert sink.zero_output.units == 3
    pending = make_group([1.0, 0.0], statuses=[SampleStatus.PENDING] * 2)
    sink.book.group_opened(pending)
    sink.book.group_discarded(pending, "stale")  # cancelled before any member finished
    assert sink.zero_output.units == 5
    assert _warnings(caplog) == []


def test_token_mode_counts_tokens(caplog: pytest.LogCaptureFixture) -> None:
    # each member: 3 prompt + 4 completion tokens
    sink = TrainSink(SinkConfig(token_batch_size=20, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 1.0]))
    assert sink.zero_output.units == 14
    assert _warnings(caplog) == []
    sink.open_group("g", Prompt("k", (1, 2, 3, 4)), 2)
    sink.record_failed(2, "g")  # nothing returned: at least the prompt per member owed
    assert sink.zero_output.units == 22
    (message,) = _warnings(caplog)
    assert "after 22 finalized units (tokens; 1 batch-equivalent(s) of 20)" in message


def test_only_the_first_crossings_are_logged_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    for _ in range(10):  # 2 units each: one crossing per group
        sink.add_group(make_group([1.0, 1.0]))
    assert sink.zero_output.reported == 10
    warned = _warnings(caplog)
    assert len(warned) == 3
    assert warned[-1].endswith("; further ones are only counted")
    sink.add_group(make_group([1.0, 0.0]))  # admitted: logged again from the first
    caplog.clear()
    sink.add_group(make_group([0.0, 0.0]))
    assert len(_warnings(caplog)) == 1
