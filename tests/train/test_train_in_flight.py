"""The train sink is the one record of work in flight: the rollout layer's open groups and its
discards reach it directly, and its snapshot (plus the source cursor) is the checkpoint."""

from __future__ import annotations

from train_helpers import assert_accounted, make_group

from trio_rl.samples import ResumedGroup, SampleStatus
from trio_rl.train import SinkConfig, TrainSink
from trio_rl.train._sink_state import state_problem


def _sink() -> TrainSink:
    return TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=None))


def _in_flight(rewards: list[float], *, finished: int, version: int = 0) -> ResumedGroup:
    group = make_group(rewards, version=version)
    return ResumedGroup(
        group_id=group.group_id,
        prompt=group.prompt,
        group_size=group.size,
        arrived=group.samples[:finished],
        policy_version_at_start=version,
    )


def test_a_snapshot_holds_the_rollout_layers_groups_and_counts_their_members() -> None:
    sink = _sink()
    sink.add_group(make_group([1.0, 0.0]))
    running = _in_flight([1.0, 0.0, 0.5], finished=2, version=3)
    groups = [running]
    sink.track_in_flight(lambda: list(groups))

    state = sink.state_dict()
    assert state_problem(state) is None  # dispatched == settled + held, members included
    assert state.counters.dispatched == 2 + 2
    (saved,) = state.open_groups
    assert saved.group_id == running.group_id
    assert [m.index for m in saved.members] == [s.index for s in running.arrived]
    assert saved.members[0] is not running.arrived[0]  # an owned copy
    assert 3 in sink.live_payload_versions()
    # the live counters are untouched: the members were never handed to the sink
    assert sink.counters.dispatched == 2

    # Restored, the group goes back to the rollout layer with its id and arrived members.
    restored = _sink()
    report = restored.load_state_dict(state)
    assert [g.group_id for g in report.resumed] == [running.group_id]
    assert report.resumed[0].missing == 1
    assert_accounted(restored)

    sink.track_in_flight(None)
    assert sink.state_dict().open_groups == ()


def test_a_resumed_group_the_driver_extended_is_saved_once_with_every_member() -> None:
    sink = _sink()
    first = _in_flight([1.0, 0.0, 0.5], finished=1)
    sink.track_in_flight(lambda: [first])
    restored = _sink()
    restored.load_state_dict(sink.state_dict())  # holds the group open with one member
    more = ResumedGroup(
        group_id=first.group_id,
        prompt=first.prompt,
        group_size=3,
        arrived=[*first.arrived, *_in_flight([0.5, 0.0, 1.0], finished=2).arrived],
        policy_version_at_start=0,
    )
    restored.track_in_flight(lambda: [more])
    state = restored.state_dict()
    assert state_problem(state) is None
    (saved,) = state.open_groups
    assert len(saved.members) == 3
    assert state.counters.dispatched == 3


def test_discards_are_booked_by_the_sink() -> None:
    sink = _sink()
    failed = make_group([1.0, 0.0])
    sink.discard(failed, "failed")
    aborted = make_group([1.0, 0.0], statuses=[SampleStatus.COMPLETED, SampleStatus.ABORTED])
    sink.discard(aborted, "aborted")
    c = assert_accounted(sink)
    assert (c.failed, c.cancelled, c.filtered) == (2, 1, 1)
    assert sink.queued == 0
