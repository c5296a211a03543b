"""The publication's "all samples" side (prime-rl #3806): reward and completion-length
distributions over every settled sample of the window, failures by exception type, and the
zero-length warning for outputs the sink filters before selection."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from builders import make_group, one_per_sample_packer
from trio_rl.publish import ShipRecord, WarningKind, open_publisher
from trio_rl.publish._metrics import attempt_stats
from trio_rl.rollout import (
    FailurePolicy,
    GroupFactory,
    GroupFailedError,
    GroupRunner,
    InMemorySource,
    open_async_rollout,
)
from trio_rl.samples import Group, Prompt, Sample, SampleStatus
from trio_rl.sink import (
    CheckpointManager,
    SinkConfig,
    SinkWindow,
    TrainSink,
    decode_checkpoint,
    encode_checkpoint,
)
from trio_rl.transport import FileSender


async def _publish(sink: TrainSink, tmp_path: Path) -> ShipRecord:
    with trio.fail_after(20):
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub,
        ):
            record = await pub.publish()
    assert record is not None
    return record


def _empty_completion(group: Group, position: int) -> Group:
    s = group.samples[position]
    s.completion_tokens, s.logprobs, s.loss_mask = [], [], []
    return group


async def test_an_empty_completion_warns_zero_length_on_the_ship_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    # Three members, one of which generated nothing: the sink filters it before selection.
    sink.add_group(_empty_completion(make_group([1.0, 0.5, 0.0], group_id="g", prompt_len=2), 1))
    assert sink.window.zero_length == 1
    caplog.set_level(logging.WARNING, logger="trio_rl.publish")
    record = await _publish(sink, tmp_path)
    assert record.selection is not None
    assert record.selection.zero_length == 0  # never selected ...
    assert record.all.zero_length == 1  # ... but counted where the sink dropped it
    assert record.all.outcomes["filtered"] == 1
    # one of the window's three attempts filtered is over the discarded-work threshold too
    assert sorted(w.kind.value for w in record.warnings) == ["high_discard", "zero_length"]
    assert record.as_dict()["warnings/zero_length"] == 1.0
    assert record.as_dict()["train/all/zero_length"] == 1.0
    assert any("1 samples of the window had no trained" in r.getMessage() for r in caplog.records)


async def test_a_window_without_empty_outputs_does_not_warn_zero_length(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0], group_id="g", prompt_len=2))
    record = await _publish(sink, tmp_path)
    assert record.all.zero_length == 0
    assert WarningKind.ZERO_LENGTH not in {w.kind for w in record.warnings}


async def test_the_all_side_has_reward_and_length_distributions_of_every_settled_sample(
    tmp_path: Path,
) -> None:
    sink = TrainSink(SinkConfig(batch_size=4, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0], group_id="a", prompt_len=2, completion=2))
    sink.add_group(make_group([0.5, 0.25], group_id="b", prompt_len=2, completion=6))
    # pruned: still settled
    sink.add_group(make_group([1.0, 1.0], group_id="flat", prompt_len=2, completion=4))
    sink.add_group(
        _empty_completion(make_group([0.0, 1.0], group_id="e", prompt_len=2, completion=3), 0)
    )
    record = await _publish(sink, tmp_path)
    rewards, lengths = record.all.rewards, record.all.completion_lengths
    assert rewards.count == record.all.reward_count == 8
    assert (rewards.min, rewards.max) == (0.0, 1.0)
    assert rewards.p50 == pytest.approx(0.75)
    assert lengths.count == 8
    assert (lengths.min, lengths.max) == (0, 6)
    assert lengths.mean == pytest.approx((2 + 2 + 6 + 6 + 4 + 4 + 0 + 3) / 8)
    flat = record.as_dict()
    assert flat["train/all/reward/p50"] == pytest.approx(0.75)
    assert flat["train/all/reward/min"] == 0.0
    assert flat["train/all/completion_length/max"] == 6.0
    assert flat["train/all/completion_length/count"] == 8.0
    # the next window starts empty: the cut handed these lists over
    assert sink.window.rewards == []
    assert sink.window.completion_lengths == []


def test_an_empty_window_has_no_distribution_keys() -> None:
    keys = dict(attempt_stats(SinkWindow()).items("train/all"))
    assert not [k for k in keys if "/completion_length/" in k or k.endswith("/reward/p50")]
    assert keys["train/all/zero_length"] == 0.0


def _member(index: int, status: SampleStatus) -> Sample:
    return Sample(index=index, group_index=0, prompt_tokens=(1,), status=status)


def test_failed_attempts_are_counted_by_exception_type() -> None:
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    prompt = Prompt(key="p", tokens=(1,))
    group = Group(
        group_id="g", prompt=prompt, samples=[_member(i, SampleStatus.PENDING) for i in range(3)]
    )
    sink.book.group_opened(group)
    sink.book.attempt_failed(
        group, GroupFailedError(group, [(0, ValueError("x")), (1, KeyError())])
    )
    sink.book.group_discarded(group, "failed", GroupFailedError(group, [(None, OSError("reward"))]))
    other = Group(group_id="h", prompt=prompt, samples=[_member(9, SampleStatus.FAILED)])
    sink.book.group_opened(other)
    sink.book.arrive(sink.book.groups["h"], other.samples)  # a member recorded as FAILED
    assert sink.window.failure_types == {
        "ValueError": 1,
        "KeyError": 1,
        "OSError": 1,
        "failed_status": 1,
    }
    stats = attempt_stats(sink.window)
    assert dict(stats.failures) == sink.window.failure_types
    keys = dict(stats.items("train/all"))
    assert keys["train/all/error/ValueError"] == 1.0
    assert keys["train/all/error/failed_status"] == 1.0


async def test_a_retried_engine_error_reaches_the_record_by_type(tmp_path: Path) -> None:
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    attempts: list[int] = []

    async def flaky(sample: Sample) -> None:
        attempts.append(sample.index)
        await trio.sleep(0.01)
        if sample.index == 0 and attempts.count(0) == 1:
            raise ConnectionError("engine went away")
        sample.completion_tokens.extend([5, 6])
        sample.logprobs.extend([-0.5, -0.5])
        sample.loss_mask.extend([True, True])
        sample.policy_versions.append(0)
        sample.reward = float(sample.index)
        sample.status = SampleStatus.COMPLETED

    async with open_async_rollout(
        InMemorySource([Prompt(key="p0", tokens=(1, 2))]),
        GroupFactory(group_size=2),
        GroupRunner(flaky),
        batch_size=1,
        on_failure=FailurePolicy(action="retry", max_retries=1),
        book=sink.book,
    ) as driver:
        with trio.fail_after(20):
            (group,) = await driver.next_batch()
    sink.add_group(group)
    record = await _publish(sink, tmp_path)
    assert dict(record.all.failures) == {"ConnectionError": 1}
    assert record.as_dict()["train/all/error/ConnectionError"] == 1.0
    assert record.all.outcomes["failed"] == 2  # the failed attempt's two samples


def test_the_window_s_values_survive_a_checkpoint() -> None:
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    sink.add_group(
        _empty_completion(make_group([1.0, 0.5, 0.0], group_id="g", prompt_len=2, completion=3), 2)
    )
    prompt = Prompt(key="p", tokens=(1,))
    failed = Group(group_id="f", prompt=prompt, samples=[_member(50, SampleStatus.PENDING)])
    sink.book.group_opened(failed)
    sink.book.group_discarded(failed, "failed", GroupFailedError(failed, [(50, TimeoutError())]))
    window = sink.window
    snapshot = CheckpointManager("unused").snapshot(sink, cursor=None, progress={})
    # the snapshot's lists are its own
    sink.add_group(make_group([0.25, 0.75], group_id="later", prompt_len=2))
    again = decode_checkpoint(encode_checkpoint(snapshot), "w.ckpt")
    assert again.sink.window.rewards == [1.0, 0.5, 0.0]
    assert again.sink.window.completion_lengths == [3, 3, 0]
    assert again.sink.window.zero_length == 1
    assert again.sink.window.failure_types == {"TimeoutError": 1}
    restored = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    restored.load_state_dict(again.sink)
    assert restored.window == again.sink.window
    assert restored.window.rewards is not again.sink.window.rewards
    assert window.rewards == [1.0, 0.5, 0.0, 0.25, 0.75]  # the live window went on
