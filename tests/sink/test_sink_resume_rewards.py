"""A group whose members all arrived before a checkpoint but whose group reward had not run yet
is not scored at restore with missing rewards: it goes back to the rollout layer, which
dispatches nothing and runs the reward, and the sink scores it with the rollout layer's rewards.

Found by the orchestrator's crash/resume test: such groups were scored with ``None`` rewards,
their advantages were all zero, and four prompts were pruned instead of shipped.
"""

from __future__ import annotations

import attrs

from builders import make_group
from trio_rl.rollout import GroupFactory
from trio_rl.samples import OpenGroup
from trio_rl.sink import SinkConfig, TrainSink


def test_a_full_group_without_rewards_is_resumed_not_scored() -> None:
    group = make_group([0.0, 1.0, 2.0, 3.0])
    # The checkpoint as the orchestrator writes it: members finished, group reward pending.
    writer = TrainSink(SinkConfig(batch_size=4))
    state = writer.state_dict()
    members = tuple(attrs.evolve(s, reward=None) for s in group.samples)
    state = attrs.evolve(
        state,
        open_groups=(
            OpenGroup(
                group_id=group.group_id,
                prompt=group.prompt,
                group_size=group.size,
                policy_version_at_start=0,
                arrived=members,
            ),
        ),
        counters=attrs.evolve(state.counters, dispatched=group.size),
    )

    sink = TrainSink(SinkConfig(batch_size=4))
    report = sink.load_state_dict(state)
    assert report.completed_groups == []
    assert [r.group_id for r in report.resumed] == [group.group_id]
    assert report.resumed[0].missing == 0
    assert sink.queued == 0

    # The rollout layer runs it: nothing is pending, so nothing is dispatched.
    resumed = GroupFactory(group.size).resume(report.resumed[0])
    assert all(s.status.is_finished for s in resumed.samples)
    for s, reward in zip(resumed.samples, [0.0, 1.0, 2.0, 3.0], strict=True):
        s.reward = reward  # the group reward, over the whole group
    sink.add_group(resumed)

    assert sink.counters.dispatched == group.size  # no new dispatch
    assert sink.queued == group.size  # scored with real rewards: nothing pruned
    assert sink.counters.pruned == 0
