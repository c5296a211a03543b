"""The sink's open-group book is the one record of work in flight: the rollout layer reports
every group it opens, each finished member as it arrives, failed attempts and discards to it
(``GroupBook``), and its snapshot (plus the source cursor) is the checkpoint, saved as it is."""

from __future__ import annotations

from sink_helpers import assert_accounted

from builders import make_group
from trio_rl.rollout import GroupFactory
from trio_rl.samples import GroupBook, OpenGroup, SampleStatus
from trio_rl.sink import SinkConfig, TrainSink
from trio_rl.sink._sink_state import state_problem


def _sink() -> TrainSink:
    return TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=None))


def test_the_book_is_a_group_book() -> None:
    book: GroupBook = _sink().book  # structurally: mypy checks the protocol here
    assert book is not None


def test_reported_members_are_held_and_the_snapshot_is_the_checkpoint() -> None:
    sink = _sink()
    sink.add_group(make_group([1.0, 0.0]))
    running = make_group([1.0, 0.0, 0.5], version=3)
    sink.book.group_opened(running)
    sink.book.members_arrived(running, running.samples[:2])
    # booked as they arrive: no snapshot-time patching of the counters
    assert sink.counters.dispatched == 2 + 2
    assert_accounted(sink)
    assert 3 in sink.live_payload_versions()

    state = sink.state_dict()
    assert state_problem(state) is None  # dispatched == settled + held, members included
    (saved,) = state.open_groups
    assert isinstance(saved, OpenGroup)
    assert saved.group_id == running.group_id
    assert [m.index for m in saved.arrived] == [s.index for s in running.samples[:2]]
    assert saved.arrived[0] is not running.samples[0]  # an owned copy

    # Restored, the book's own record goes back to the rollout layer: same id, arrived members.
    restored = _sink()
    report = restored.load_state_dict(state)
    (resumed,) = report.resumed
    assert resumed is restored.book.groups[running.group_id]
    assert resumed.missing == 1
    assert_accounted(restored)


def test_a_resumed_group_the_driver_extends_is_saved_once_with_every_member() -> None:
    sink = _sink()
    first = make_group([1.0, 0.0, 0.5])
    sink.book.group_opened(first)
    sink.book.members_arrived(first, first.samples[:1])
    restored = _sink()
    (resumed,) = restored.load_state_dict(sink.state_dict()).resumed
    group = GroupFactory(3).resume(resumed)
    restored.book.group_opened(group)  # already open: stays as it is
    for s, reward in zip(group.samples[1:], (0.25, 0.0), strict=True):
        s.completion_tokens, s.logprobs, s.loss_mask = [5, 6], [-0.1, -0.2], [True, True]
        s.status, s.reward, s.policy_versions = SampleStatus.COMPLETED, reward, [0]
    restored.book.members_arrived(group, group.samples[1:])
    state = restored.state_dict()
    assert state_problem(state) is None
    (saved,) = state.open_groups
    assert len(saved.arrived) == 3
    assert state.counters.dispatched == 3
    restored.add_group(group)  # the consumer hands it over: scored once, nothing counted twice
    assert restored.queued == 3
    assert assert_accounted(restored).dispatched == 3


def test_discards_are_booked_by_the_book() -> None:
    sink = _sink()
    failed = make_group([1.0, 0.0])
    sink.book.group_opened(failed)
    sink.book.members_arrived(failed, failed.samples[:1])
    sink.book.group_discarded(failed, "failed")
    aborted = make_group([1.0, 0.0], statuses=[SampleStatus.COMPLETED, SampleStatus.ABORTED])
    sink.book.group_opened(aborted)
    sink.book.group_discarded(aborted, "aborted")
    c = assert_accounted(sink)
    assert (c.failed, c.cancelled, c.filtered) == (2, 1, 1)
    assert sink.queued == 0
    assert sink.open_group_ids() == []


def test_every_failed_attempt_settles_once_and_counts_in_the_attempt_budget() -> None:
    sink = _sink()
    group = make_group([1.0, 0.0, 0.25])
    sink.book.group_opened(group)
    sink.book.members_arrived(group, group.samples[:2])
    sink.book.attempt_failed(group)  # two held members and one that never arrived
    assert sink.open_group_ids() == [group.group_id]
    assert sink.held == 0
    c = assert_accounted(sink)
    assert (c.dispatched, c.failed) == (3, 3)
    assert sink.window.attempts == 3
    # the retry: a whole new attempt, dispatched and settled once more
    sink.book.group_opened(group)
    sink.book.members_arrived(group, group.samples)
    sink.add_group(group)
    c = assert_accounted(sink)
    assert (c.dispatched, c.failed, sink.queued) == (6, 3, 3)
    assert sink.window.attempts == 6
