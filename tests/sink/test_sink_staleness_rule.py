"""Which version a sample is judged stale by.

Batch ``S`` drops a sample judged at ``v < (S - 1) - max_off_policy_steps``. By default
(``"group_start"``, prime-rl's rule) ``v`` is the version its group started with; with
``staleness="oldest_token"`` it is the oldest version behind any of the sample's tokens.
Here batch 4 with ``max_off_policy_steps=1`` keeps versions >= 2.
"""

from __future__ import annotations

import pytest
from sink_helpers import assert_accounted

from builders import make_group
from trio_rl.errors import TrainSinkError
from trio_rl.rollout import GroupFactory
from trio_rl.samples import RESUMED_AT, Group, SampleStatus
from trio_rl.sink import SinkConfig, TrainSink


def _sink(**kw: object) -> TrainSink:
    return TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=1, **kw), step=4)  # type: ignore[arg-type]


def _group(start: int, token_version: int) -> Group:
    group = make_group([1.0, 0.0], version=token_version)
    group.policy_version_at_start = start
    return group


@pytest.mark.parametrize(
    ("start", "token_version", "kept"),
    [(1, 3, False), (2, 3, True), (1, 2, False), (2, 2, True)],
)
def test_by_default_a_group_is_judged_by_the_version_it_started_with(
    start: int, token_version: int, kept: bool
) -> None:
    sink = _sink()
    sink.add_group(_group(start, token_version))
    c = assert_accounted(sink)
    assert (sink.queued, c.stale) == ((2, 0) if kept else (0, 2))
    if kept:  # the queue's sweep and ordering use the judged version
        assert {s.policy_version for s in sink.queued_samples()} == {start}


@pytest.mark.parametrize(
    ("start", "token_version", "kept"),
    [(1, 3, True), (1, 2, True), (0, 1, False)],
)
def test_the_per_token_rule_judges_by_the_oldest_token(
    start: int, token_version: int, kept: bool
) -> None:
    sink = _sink(staleness="oldest_token")
    sink.add_group(_group(start, token_version))
    c = assert_accounted(sink)
    assert (sink.queued, c.stale) == ((2, 0) if kept else (0, 2))


def test_restore_judges_open_members_by_the_rule() -> None:
    writer = TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=None), step=4)
    group = _group(1, 3)
    writer.book.group_opened(group)
    writer.book.members_arrived(group, group.samples)
    state = writer.state_dict()
    by_start = _sink().load_state_dict(state)
    assert by_start.dropped_members_stale == 2
    per_token = _sink(staleness="oldest_token").load_state_dict(state)
    assert per_token.dropped_members_stale == 0


def test_an_unknown_rule_is_refused_naming_the_field() -> None:
    with pytest.raises(TrainSinkError, match=r"SinkConfig\.staleness.*'newest'"):
        SinkConfig(batch_size=1, staleness="newest")  # type: ignore[arg-type]


def test_a_resumed_group_is_judged_member_by_member_by_the_version_each_was_generated_under() -> (
    None
):
    """A group opened at version 1 with one member arrived, resumed at version 3: under the
    default rule its regenerated members are judged by 3 (fresh for batch 4), the member
    generated before the restart by 1 (stale), as prime-rl judges each episode by its own
    dispatch version. Judged by the group's start, the fresh members were dropped too."""
    writer = TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=None), step=4)
    old = make_group([1.0, 0.0, 0.5], version=1)
    old.policy_version_at_start = 1
    writer.book.group_opened(old)
    writer.book.members_arrived(old, old.samples[:1])
    restored = TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=None), step=4)
    (resumed,) = restored.load_state_dict(writer.state_dict()).resumed
    group = GroupFactory(3).resume(resumed, policy_version=3)
    assert group.policy_version_at_start == 1  # the group keeps its start
    restored.book.group_opened(group)
    for s, reward in zip(group.samples[1:], (0.25, 0.0), strict=True):
        assert s.metadata[RESUMED_AT] == 3
        s.completion_tokens, s.logprobs, s.loss_mask = [5, 6], [-0.1, -0.2], [True, True]
        s.status, s.reward, s.policy_versions = SampleStatus.COMPLETED, reward, [3]
    restored.book.members_arrived(group, group.samples[1:])
    # Judged now under max_off_policy_steps=1 at batch 4: versions >= 2 are fresh.
    judged = TrainSink(SinkConfig(batch_size=100, max_off_policy_steps=1), step=4)
    report = judged.load_state_dict(restored.state_dict())
    assert report.dropped_members_stale == 1  # the member from before the restart
    (again,) = report.resumed
    assert [m.metadata.get(RESUMED_AT) for m in again.arrived] == [3, 3]  # kept by the checkpoint
    assert assert_accounted(judged).stale == 1
