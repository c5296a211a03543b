"""The reference's publication warnings, each at its boundary, and the per-sample annotations:
a batch at most 10% trainable, a window more than 20% wasted, zero-length outputs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from builders import make_group, one_per_sample_packer
from trio_rl.publish import Shipment, WarningKind, open_publisher
from trio_rl.publish._metrics import attempt_stats, selection_stats, ship_warnings
from trio_rl.sink import PruneMode, SinkConfig, SinkWindow, TrainingSample, TrainSink
from trio_rl.transport import FileSender


def _sample(advantage: float, trained: int = 2) -> TrainingSample:
    n = 2 + trained
    return TrainingSample(
        token_ids=list(range(n)),
        mask=[False, False] + [True] * trained,
        logprobs=[0.0] * n,
        temperatures=[1.0] * n,
        env_name="env",
        advantages=[0.0, 0.0] + [advantage] * trained,
    )


def _kinds(selected: list[TrainingSample], window: SinkWindow | None = None) -> set[WarningKind]:
    stats = attempt_stats(window or SinkWindow(attempts=1, shipped=1))
    return {w.kind for w in ship_warnings(7, selection_stats(selected), stats)}


@pytest.mark.parametrize(
    ("trainable", "selected", "warns"),
    [(1, 10, True), (2, 20, True), (0, 4, True), (2, 18, False), (1, 9, False), (4, 4, False)],
)
def test_low_trainable_warns_at_ten_percent_or_less(
    trainable: int, selected: int, warns: bool
) -> None:
    batch = [_sample(0.5)] * trainable + [_sample(0.0)] * (selected - trainable)
    stats = selection_stats(batch)
    assert (stats.selected, stats.trainable) == (selected, trainable)
    assert (WarningKind.LOW_TRAINABLE in _kinds(batch)) is warns


@pytest.mark.parametrize(
    ("outcomes", "warns"),
    [
        ({"stale": 2, "shipped": 8}, False),  # exactly a fifth: not more than a fifth
        ({"stale": 3, "shipped": 7}, True),
        ({"failed": 1, "filtered": 1, "stale": 1, "pruned": 1, "shipped": 6}, True),
        ({"pruned": 9, "shipped": 1}, False),  # no signal is LOW_TRAINABLE's, not waste
        ({"cancelled": 6, "shipped": 4}, False),  # cancelled work is not discarded work
        ({}, False),  # no attempts at all
    ],
)
def test_high_discard_warns_above_a_fifth_of_the_windows_attempts_wasted(
    outcomes: dict[str, int], warns: bool
) -> None:
    count = outcomes.get
    window = SinkWindow(
        attempts=sum(outcomes.values()),
        stale=count("stale", 0),
        failed=count("failed", 0),
        pruned=count("pruned", 0),
        filtered=count("filtered", 0),
        cancelled=count("cancelled", 0),
        shipped=count("shipped", 0),
    )
    stats = attempt_stats(window)
    assert stats.discarded == sum(
        n for k, n in outcomes.items() if k in ("stale", "failed", "pruned", "filtered")
    )
    assert (WarningKind.HIGH_DISCARD in _kinds([_sample(1.0)], window)) is warns
    if warns:  # the message names the largest cause and what to change
        (message,) = (
            w.message for w in ship_warnings(7, None, stats) if w.kind is WarningKind.HIGH_DISCARD
        )
        assert "thrown away" in message
        assert "max_off_policy_steps" in message or "failures" in message
    assert ("train/all/discarded_fraction" in dict(stats.items("train/all"))) is bool(outcomes)


def test_zero_length_outputs_warn_when_any_selected_sample_has_no_completion() -> None:
    assert WarningKind.ZERO_LENGTH not in _kinds([_sample(1.0, trained=1)] * 3)
    batch = [_sample(1.0), _sample(0.0, trained=0), _sample(-1.0)]
    stats = selection_stats(batch)
    assert stats.zero_length == 1
    assert stats.completion_lengths.min == 0
    assert WarningKind.ZERO_LENGTH in _kinds(batch)


async def test_a_published_batch_carries_its_warnings_selection_and_annotations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 20 selected, 2 trainable (10%): pruned after selection, the batch still ships its 2.
    sink = TrainSink(
        SinkConfig(batch_size=20, prune=PruneMode.AFTER_SELECTION, max_off_policy_steps=None)
    )
    for g in range(9):
        sink.add_group(make_group([1.0, 1.0], group_id=f"flat{g}", prompt_len=2))
    sink.add_group(make_group([1.0, 0.0], group_id="live", prompt_len=2))
    shipments: list[Shipment] = []
    caplog.set_level(logging.WARNING, logger="trio_rl.publish")
    with trio.fail_after(20):
        async with (
            FileSender(tmp_path, world_size=1, fsync=False) as sender,
            open_publisher(
                sink, sender, pack=one_per_sample_packer(1), monitor=shipments.append
            ) as pub,
        ):
            record = await pub.publish()
    assert record is not None
    assert record.selection is not None
    assert (record.selection.selected, record.selection.trainable) == (20, 2)
    # 18 of the window's 20 attempts were pruned: no signal, but nothing wasted
    assert [w.kind for w in record.warnings] == [WarningKind.LOW_TRAINABLE]
    assert record.as_dict()["warnings/low_trainable"] == 1.0
    assert record.as_dict()["train/selected/trainable_fraction"] == 0.1
    assert any("2 of 20 selected samples" in r.getMessage() for r in caplog.records)
    (shipment,) = shipments
    assert [(a.step, a.group_id) for a in shipment.annotations] == [(1, "live"), (1, "live")]
    assert sorted(a.advantage for a in shipment.annotations if a.advantage is not None) == [
        -0.5,
        0.5,
    ]
    assert all(a.trained_tokens == 4 for a in shipment.annotations)


@pytest.mark.parametrize(
    ("wait", "step_time", "warns"),
    [
        (5.0, 10.0, True),  # waited as long as it worked: the trainer is the bottleneck
        (8.0, 10.0, True),
        (4.99, 10.0, False),
        (0.0, 10.0, False),
        (0.0, 0.0, False),  # a step of no time never warns
        (1.0, 0.0, False),
    ],
)
def test_policy_wait_warns_when_it_is_at_least_the_active_step_time(
    wait: float, step_time: float, warns: bool
) -> None:
    stats = attempt_stats(SinkWindow(attempts=1, shipped=1))
    warnings = ship_warnings(7, None, stats, (wait, step_time))
    assert (WarningKind.POLICY_WAIT in {w.kind for w in warnings}) is warns
    if warns:
        (w,) = warnings
        assert "step 7" in w.message
        assert "add trainer capacity" in w.message


async def test_a_published_record_warns_from_its_own_policy_wait_snapshot(
    tmp_path: Path, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # controlled timings: the clock moves only when the test jumps it
    sink = TrainSink(SinkConfig(batch_size=2, max_off_policy_steps=None))
    caplog.set_level(logging.WARNING, logger="trio_rl.publish")
    records = []
    async with (
        FileSender(tmp_path, world_size=1, fsync=False) as sender,
        open_publisher(sink, sender, pack=one_per_sample_packer(1)) as pub,
    ):
        for step, (elapsed, wait) in enumerate([(10.0, 6.0), (10.0, 4.0), (8.0, 4.0)]):
            sink.add_group(make_group([1.0, 0.0], group_id=f"g{step}", prompt_len=2))
            mock_clock.jump(elapsed)
            pub.add_policy_wait(wait)
            record = await pub.publish()
            assert record is not None
            records.append(record)
    assert [(r.policy_wait, r.step_time) for r in records] == [(6.0, 10.0), (4.0, 10.0), (4.0, 8.0)]
    kinds = [[w.kind for w in r.warnings] for r in records]
    assert kinds == [[WarningKind.POLICY_WAIT], [], [WarningKind.POLICY_WAIT]]
    assert records[0].as_dict()["warnings/policy_wait"] == 1.0
    assert records[0].as_dict()["time/step"] == 10.0
    assert records[1].as_dict()["time/wait_for_policy"] == 4.0
    logged = [r.getMessage() for r in caplog.records if "for the policy" in r.getMessage()]
    assert len(logged) == 2
    assert "waited 6 s for the policy, at least as long as its 4 s of active step time" in logged[0]
