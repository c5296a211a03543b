"""The group runner: cancel-and-settle, credit return, rewards, resumed groups."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing
from rollout_helpers import Puppet

from builders import PROMPT, pending_group, scripted_engine
from trio_rl.engines import SamplingParams
from trio_rl.errors import InvalidArgumentError
from trio_rl.rollout import (
    CreditScheduler,
    GroupFactory,
    GroupFailedError,
    GroupGranularity,
    GroupRunner,
    GroupStatus,
    SampleBackfill,
    engine_generate,
    run_group,
    run_reporting,
)
from trio_rl.samples import Group, OpenGroup, Sample, SampleStatus


async def test_failed_sample_cancels_siblings_and_all_credits_are_back_first() -> None:
    """Reference: sample 0 raises, the rest hang; all 4 credits are back before the raise."""
    puppet = Puppet()
    group = pending_group(4)
    fired: list[int] = []

    async def driver() -> None:
        with pytest.raises(GroupFailedError) as info:
            await run_group(group, puppet, on_sample_done=lambda s: fired.append(s.index))
        # checked immediately at the raise: every sibling settled and returned its credit
        assert sorted(fired) == [0, 1, 2, 3]
        assert isinstance(info.value.__cause__, RuntimeError)
        assert str(info.value.__cause__) == "sample failed"
        assert [i for i, _ in info.value.failures] == [0]
        assert info.value.group is group
        assert "sample 0" in str(info.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver)
        await trio.testing.wait_all_tasks_blocked()
        assert len(puppet.started) == 4
        puppet.fail(0, RuntimeError("sample failed"))
    assert sorted(puppet.cancelled) == [1, 2, 3]


async def test_several_failures_are_all_carried() -> None:
    puppet = Puppet()
    group = pending_group(3)

    async def boom(sample: Sample) -> None:
        await trio.testing.wait_all_tasks_blocked()
        raise ValueError(f"bad {sample.index}")

    with pytest.raises(GroupFailedError) as info:
        await run_group(group, boom)
    # all three fail at the same checkpoint; none was a mere cancellation
    assert len(info.value.failures) >= 1
    assert all(isinstance(e, ValueError) for _, e in info.value.failures)
    assert info.value.__cause__ is info.value.failures[0][1]
    del puppet


async def test_outer_cancellation_settles_samples_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet()
    group = pending_group(3)
    fired: list[int] = []
    rewarded: list[int] = []

    def reward(g: Group) -> list[float]:
        rewarded.append(1)
        return [0.0] * g.size

    with trio.move_on_after(5) as scope:
        await run_group(
            group, puppet, on_sample_done=lambda s: fired.append(s.index), group_reward=reward
        )
    assert scope.cancelled_caught
    assert sorted(fired) == [0, 1, 2]
    assert sorted(puppet.cancelled) == [0, 1, 2]
    assert rewarded == []


async def test_outer_cancellation_with_a_failure_in_the_same_tick_still_propagates() -> None:
    """A sample that fails and siblings cancelled from outside at once: Cancelled wins (the
    caller asked to stop), every sample settles once, no GroupFailedError escapes a cancelled
    caller."""
    group = pending_group(3)
    fired: list[int] = []
    started = 0

    async def generate(sample: Sample) -> None:
        nonlocal started
        started += 1
        if sample.index == 0:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise RuntimeError("boom")
        await trio.sleep_forever()

    with trio.CancelScope() as scope:

        async def cancel_soon() -> None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_soon)
            await run_group(group, generate, on_sample_done=lambda s: fired.append(s.index))
        raise AssertionError("run_group returned although its caller was cancelled")
    assert scope.cancelled_caught
    assert started == 3
    assert sorted(fired) == [0, 1, 2]


async def test_a_group_cancelled_before_it_starts_starts_no_sample() -> None:
    """A driver shutting down cancels groups whose task has not run yet: none of their
    samples is spawned just to be cancelled (their credits come back with the group's end)."""
    group = pending_group(4)
    fired: list[int] = []
    calls = 0

    async def generate(sample: Sample) -> None:
        nonlocal calls
        calls += 1
        await trio.sleep_forever()

    with trio.CancelScope() as scope:
        scope.cancel()
        await run_group(group, generate, on_sample_done=lambda s: fired.append(s.index))
    assert scope.cancelled_caught
    assert (calls, fired) == (0, [])
    assert all(s.status is SampleStatus.PENDING for s in group.samples)


async def test_rewards_sync_and_async(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet(auto_delay=1)
    group = pending_group(3)

    async def sample_reward(sample: Sample) -> float:
        await trio.lowlevel.checkpoint()
        return float(sample.index)

    order: list[str] = []

    def group_reward(g):  # type: ignore[no-untyped-def]
        order.append("group")
        assert all(s.reward is not None for s in g.samples)
        return [s.reward * 10 for s in g.samples]

    result = await run_group(group, puppet, sample_reward=sample_reward, group_reward=group_reward)
    assert result is group
    assert [s.reward for s in group.samples] == [0.0, 10.0, 20.0]
    assert order == ["group"]
    assert all(s.status is SampleStatus.COMPLETED for s in group.samples)


async def test_group_reward_skipped_on_failure_and_wrong_length_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    calls: list[int] = []

    def one_reward_for_two(g: Group) -> list[float]:
        calls.append(1)
        return [1.0]

    def never_called(g: Group) -> list[float]:
        calls.append(2)
        return []

    with pytest.raises(GroupFailedError, match="group reward"):
        await run_group(pending_group(2), puppet, group_reward=one_reward_for_two)
    assert calls == [1]

    async def fail(sample: Sample) -> None:
        raise OSError("engine down")

    with pytest.raises(GroupFailedError) as info:
        await run_group(pending_group(2), fail, group_reward=never_called)
    assert calls == [1]
    assert isinstance(info.value.__cause__, OSError)


async def test_sample_timeout_is_a_failure(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet()
    start = trio.current_time()
    with pytest.raises(GroupFailedError) as info:
        await run_group(pending_group(2), puppet, sample_timeout=30)
    assert isinstance(info.value.__cause__, trio.TooSlowError)
    assert trio.current_time() - start == pytest.approx(30)


async def test_engine_generate_maps_finish_reasons_seeds_and_versions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted_engine({42: "stop", 43: "length", 44: "abort"}, delay=2, version=7)
    group = pending_group(3, seed=42, routing_keys=True)
    keys = [s.routing_key for s in group.samples]
    start = trio.current_time()
    await run_group(group, engine_generate(engine, SamplingParams(max_tokens=9), timeout=10))
    assert trio.current_time() - start == 2  # the engine's delay, all three at once
    assert [s.status for s in group.samples] == [
        SampleStatus.COMPLETED,
        SampleStatus.TRUNCATED,
        SampleStatus.ABORTED,
    ]
    assert sorted(r.params.seed or 0 for r in engine.requests) == [42, 43, 44]
    assert all(r.params.max_tokens == 9 for r in engine.requests)
    assert sorted(r.routing_key for r in engine.requests) == sorted(keys)  # type: ignore[type-var]
    assert len({r.request_id for r in engine.requests}) == 3
    for s in group.samples:
        assert s.policy_versions == [7]
        assert s.completion_tokens == [0, 1]  # the engine's two tokens
        assert s.logprobs == [-1.0, -1.0]
        assert s.loss_mask == [True, True]


async def test_engine_generate_deadline(autojump_clock: trio.testing.MockClock) -> None:
    engine = scripted_engine(delay=100)
    with pytest.raises(GroupFailedError) as info:
        await run_group(pending_group(1), engine_generate(engine, timeout=5))
    assert isinstance(info.value.__cause__, trio.TooSlowError)


async def test_resumed_group_generates_only_missing_members(
    autojump_clock: trio.testing.MockClock,
) -> None:
    factory = GroupFactory(group_size=4)
    done = [
        Sample(
            index=100 + i,
            group_index=9,
            prompt_tokens=PROMPT.tokens,
            reward=1.0,
            status=SampleStatus.COMPLETED,
        )
        for i in range(3)
    ]
    resumed = OpenGroup(
        group_id="g-old", prompt=PROMPT, group_size=4, arrived=done, policy_version_at_start=2
    )
    group = factory.resume(resumed)
    assert group.group_id == "g-old"
    assert group.policy_version_at_start == 2
    assert group.samples[:3] == done
    assert group.samples[3].group_index == 9
    puppet = Puppet(auto_delay=1)
    fired: list[int] = []
    await run_group(group, puppet, on_sample_done=lambda s: fired.append(s.index))
    assert puppet.started_indices() == [group.samples[3].index]
    assert fired == [group.samples[3].index]
    assert [s.reward for s in done] == [1.0, 1.0, 1.0]


async def test_resumed_group_with_nothing_missing_dispatches_nothing() -> None:
    done = [
        Sample(index=i, group_index=1, prompt_tokens=PROMPT.tokens, status=SampleStatus.COMPLETED)
        for i in range(2)
    ]
    group = GroupFactory(group_size=2).resume(
        OpenGroup(group_id="full", prompt=PROMPT, group_size=2, arrived=done)
    )
    scored: list[int] = []

    async def never(sample: Sample) -> None:
        raise AssertionError("nothing may be generated")

    def reward(g: Group) -> list[float]:
        scored.append(g.size)
        return [0.5, 0.5]

    result = await run_group(group, never, group_reward=reward)
    assert result.samples == done
    assert scored == [2]  # scored exactly once with exactly its members
    assert [s.reward for s in done] == [0.5, 0.5]


def test_resume_rejects_pending_arrived_members() -> None:
    pending = Sample(index=0, group_index=0, prompt_tokens=(1,))
    with pytest.raises(ValueError, match="arrived sample 0 is PENDING"):
        GroupFactory(group_size=2).resume(
            OpenGroup(group_id="x", prompt=PROMPT, group_size=2, arrived=[pending])
        )


@pytest.mark.parametrize("policy", [GroupGranularity(), SampleBackfill()])
async def test_run_reporting_conserves_credits_on_every_outcome(policy) -> None:  # type: ignore[no-untyped-def]
    scheduler = CreditScheduler(policy, group_size=3)
    puppet = Puppet()
    runner = GroupRunner(puppet)
    groups = [GroupFactory(group_size=3, next_sample_index=10 * k).make(PROMPT) for k in range(3)]
    async with trio.open_nursery() as nursery:
        for g in groups:
            scheduler.submitted(g.group_id, 3)
            nursery.start_soon(run_reporting, runner, g, scheduler)
        await trio.testing.wait_all_tasks_blocked()
        puppet.finish(0, 1, 2)  # group 0 completes
        puppet.fail(11, RuntimeError("x"))  # group 1 fails
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # group 2 cancelled from outside
    outcomes = {o.group_id: o for o in scheduler.poll()}
    assert outcomes[groups[0].group_id].status is GroupStatus.COMPLETED
    assert outcomes[groups[1].group_id].status is GroupStatus.FAILED
    assert outcomes[groups[2].group_id].status is GroupStatus.CANCELLED
    assert isinstance(outcomes[groups[1].group_id].error, GroupFailedError)
    assert scheduler.ledger.in_flight == 0
    assert scheduler.ledger.opened == scheduler.ledger.returned == 9
    assert scheduler.statistics().sample_events == 9  # exactly one credit per sample
    scheduler.close()


def test_bad_resume_and_failure_arguments_are_invalid_arguments_naming_them() -> None:
    pending = Sample(index=0, group_index=0, prompt_tokens=(1,))
    with pytest.raises(InvalidArgumentError, match="resumed group x: arrived sample 0 is PENDING"):
        GroupFactory(group_size=2).resume(
            OpenGroup(group_id="x", prompt=PROMPT, group_size=2, arrived=[pending])
        )
    with pytest.raises(InvalidArgumentError, match="GroupFailedError failures must hold"):
        GroupFailedError(pending_group(), [])
