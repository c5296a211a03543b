"""The fully-async driver: bounded work, backpressure, staleness, pause, failures, close."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from rollout_helpers import Puppet, prompts, source

from operations_waits import documented
from trio_rl.rollout import (
    CreditScheduler,
    DriverFailedError,
    FailurePolicy,
    GroupFactory,
    GroupFailedError,
    GroupGranularity,
    GroupRunner,
    GroupStatus,
    InMemorySource,
    RolloutError,
    SampleBackfill,
    SourceExhaustedError,
    open_async_rollout,
    run_reporting,
)
from trio_rl.rollout._buffer import run_booked
from trio_rl.samples import RESUMED_AT, Group, OpenGroup, Sample, SampleStatus

G = 2


def parts(puppet: Puppet, src: InMemorySource | None = None, group_size: int = G):  # type: ignore[no-untyped-def]
    return (
        src if src is not None else source(1000),
        GroupFactory(group_size=group_size),
        GroupRunner(puppet),
    )


def samples_of(g: int, size: int = G) -> list[int]:
    return list(range(g * size, (g + 1) * size))


async def test_worker_defaults_to_sample_backfill() -> None:
    """Reference: B = 1, G = 2; two sample completions start a replacement group.

    The group reward blocks (as miles' own test holds a group open), so the group is not done
    when its samples are: under group granularity no replacement would start until it is.
    """
    puppet = Puppet()
    src = source(100)
    reward_gate = trio.Event()

    async def blocking_group_reward(group: Group) -> list[float]:
        await reward_gate.wait()
        return [1.0] * group.size

    factory, runner = (
        GroupFactory(group_size=G),
        GroupRunner(puppet, group_reward=blocking_group_reward),
    )
    async with open_async_rollout(src, factory, runner, batch_size=1) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        puppet.finish(0)
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        puppet.finish(1)
        await trio.testing.wait_all_tasks_blocked()
        # both samples of group 0 are done but its group reward still runs: backfill only
        assert src.taken == 2
        assert driver.statistics().in_flight_groups == 2
        reward_gate.set()
        with trio.fail_after(5):
            batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [0]
        assert [s.reward for s in batch[0].samples] == [1.0, 1.0]


async def test_group_granularity_holds_the_replacement_while_the_group_reward_runs() -> None:
    """The pair of the test above: the same blocked group reward under GroupGranularity.

    Both samples of group 0 finish, but the group is not done until its reward returns: no
    replacement group is submitted meanwhile (backfill would have submitted one).
    """
    puppet = Puppet()
    src = source(100)
    reward_gate = trio.Event()

    async def blocking_group_reward(group: Group) -> list[float]:
        await reward_gate.wait()
        return [1.0] * group.size

    factory, runner = (
        GroupFactory(group_size=G),
        GroupRunner(puppet, group_reward=blocking_group_reward),
    )
    async with open_async_rollout(
        src, factory, runner, batch_size=1, policy=GroupGranularity()
    ) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        puppet.finish(0, 1)
        await trio.testing.wait_all_tasks_blocked()
        # both samples are done, the group reward still runs: the group holds its credit
        assert sorted(puppet.finished) == [0, 1]
        assert src.taken == 1
        assert driver.statistics().in_flight_groups == 1
        reward_gate.set()
        with trio.fail_after(5):
            batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [0]
        assert [s.reward for s in batch[0].samples] == [1.0, 1.0]
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 2  # the group is done: now its replacement starts


async def test_group_granularity_opts_out_of_backfill() -> None:
    puppet = Puppet()
    src = source(100)
    async with open_async_rollout(
        *parts(puppet, src), batch_size=1, policy=GroupGranularity(), buffer_capacity=1
    ) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        puppet.finish(0)
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        puppet.finish(1)
        assert [g.group_index for g in await driver.next_batch()] == [0]
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 2


async def test_worker_bounds_in_flight_groups() -> None:
    puppet = Puppet()
    src = source(100)
    async with open_async_rollout(*parts(puppet, src), batch_size=2) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 2
        assert driver.statistics().in_flight_groups == 2
        assert driver.statistics().in_flight_samples == 4
        puppet.finish(*samples_of(0), *samples_of(1))
        batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [0, 1]


async def test_sample_cap_rounds_down_to_whole_groups() -> None:
    """Reference: batch 4, max 3 samples, G = 2 -> one group in flight."""
    puppet = Puppet()
    src = source(100)
    async with open_async_rollout(
        *parts(puppet, src), batch_size=4, max_samples_in_flight=3
    ) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 1
        for g in range(4):
            await trio.testing.wait_all_tasks_blocked()
            assert driver.statistics().in_flight_groups == 1
            puppet.finish(*samples_of(g))
        batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="below the group size"):
        async with open_async_rollout(*parts(puppet), batch_size=1, max_samples_in_flight=1):
            pass


async def test_batches_are_sorted_and_backpressure_pauses_production(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    src = source(1000)
    async with open_async_rollout(*parts(puppet, src), batch_size=3, buffer_capacity=4) as driver:
        first = await driver.next_batch()
        assert len(first) == 3
        assert [g.first_index for g in first] == sorted(g.first_index for g in first)
        await trio.sleep(100)  # nobody consumes: the buffer fills and production stops
        stats = driver.statistics()
        assert stats.buffered == 4
        taken = src.taken
        await trio.sleep(100)
        assert src.taken == taken
        assert driver.statistics().buffered == 4
        second = await driver.next_batch()
        assert len(second) == 3
        await trio.sleep(10)
        assert driver.statistics().buffered == 4  # refilled from finished work first
        for _ in range(3):
            await driver.next_batch()
        assert src.taken > taken  # then production resumed
        assert driver.statistics().buffered <= 4


async def test_pause_stops_submissions_while_in_flight_groups_go_on() -> None:
    puppet = Puppet()
    src = source(100)
    async with open_async_rollout(*parts(puppet, src), batch_size=2) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 2
        async with driver.paused():
            assert driver.is_paused
            puppet.finish(*samples_of(0), *samples_of(1))
            await trio.testing.wait_all_tasks_blocked()
            assert src.taken == 2  # nothing new while paused
            assert driver.statistics().buffered == 2  # but running groups finished
        await trio.testing.wait_all_tasks_blocked()
        assert src.taken == 4  # submissions resume
        assert len(await driver.next_batch()) == 2


async def test_stale_groups_judged_when_taken(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet(auto_delay=1)
    src = source(100)
    async with open_async_rollout(
        *parts(puppet, src), batch_size=2, max_staleness=2, stale="recycle", buffer_capacity=2
    ) as driver:
        await trio.sleep(10)  # two groups generated at version 0 wait in the buffer
        driver.set_policy_version(5)
        puppet.version = 5
        batch = await driver.next_batch()
        # the two version-0 groups were stale when taken: recycled, regenerated
        stats = driver.statistics()
        assert stats.stale_recycled >= 2  # the buffered ones, and any finished meanwhile
        assert all(g.staleness(5) <= 2 for g in batch)
        assert stats.max_staleness == 0
        with pytest.raises(ValueError, match="cannot go back"):
            driver.set_policy_version(4)


async def test_stale_groups_dropped_by_default(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet(auto_delay=1)
    src = source(100)
    async with open_async_rollout(
        *parts(puppet, src), batch_size=1, max_staleness=0, buffer_capacity=1
    ) as driver:
        await trio.sleep(10)
        driver.set_policy_version(1)
        puppet.version = 1
        batch = await driver.next_batch()
        assert batch[0].oldest_version == 1
        stats = driver.statistics()
        assert stats.stale_dropped >= 1
        assert stats.stale_recycled == 0
        assert src.recycled == 0


@pytest.mark.parametrize("handling", ["recycle", "drop"])
async def test_aborted_groups_follow_policy(
    autojump_clock: trio.testing.MockClock, handling: str
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(*samples_of(0))
    puppet.finish(*samples_of(0), status=SampleStatus.ABORTED)
    src = source(100)
    discarded: list[tuple[int, str]] = []
    async with open_async_rollout(
        *parts(puppet, src),
        batch_size=1,
        max_groups_in_flight=1,
        aborted=handling,  # type: ignore[arg-type]
        on_discard=lambda g, why: discarded.append((g.group_index, why)),
    ) as driver:
        groups = [(await driver.next_batch())[0] for _ in range(3)]
        stats = driver.statistics()
    assert all(g.group_index != 0 and not g.has_aborted for g in groups)
    assert discarded == [(0, "aborted")], "the consumer's loss is reported, whatever the policy"
    keys = [g.prompt.key for g in groups]
    if handling == "recycle":
        assert stats.aborted_recycled == 1
        assert "p0" in keys  # regenerated from the recycled prompt (served before fresh ones)
    else:
        assert stats.aborted_dropped == 1
        assert "p0" not in keys
        assert src.recycled == 0


async def test_worker_error_reaches_the_consumer_even_with_buffered_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(*samples_of(1))
    async with open_async_rollout(
        *parts(puppet),
        batch_size=1,
        max_groups_in_flight=2,
        buffer_capacity=100,
        on_failure=FailurePolicy("fail"),
    ) as driver:
        await trio.sleep(5)
        assert driver.statistics().buffered >= 1
        puppet.fail(samples_of(1)[0], RuntimeError("generation exploded"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(DriverFailedError) as info:
            await driver.next_batch()
        assert isinstance(info.value.__cause__, GroupFailedError)
        assert isinstance(info.value.__cause__.__cause__, RuntimeError)
        with pytest.raises(DriverFailedError):  # and again: the driver stays failed
            await driver.next_batch()
        # the failing worker cancelled its other groups
        assert driver.statistics().in_flight_groups == 0


async def test_failed_groups_are_skipped_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.fail(0, RuntimeError("x"))
    async with open_async_rollout(*parts(puppet), batch_size=2, max_groups_in_flight=1) as driver:
        batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [1, 2]
        assert driver.statistics().failed == 1


async def test_failed_groups_are_retried_up_to_n(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.rollout")
    attempts = 0

    async def flaky(sample: Sample) -> None:
        nonlocal attempts
        await trio.sleep(1)
        if sample.index == 0:
            attempts += 1
            if attempts <= 2:
                raise OSError("transient")
        sample.status = SampleStatus.COMPLETED

    factory = GroupFactory(group_size=2, routing_keys=True)
    async with open_async_rollout(
        source(10),
        factory,
        GroupRunner(flaky),
        batch_size=3,
        max_groups_in_flight=1,
        on_failure=FailurePolicy("retry", max_retries=2),
    ) as driver:
        batch = await driver.next_batch()
        stats = driver.statistics()
    assert [g.group_index for g in batch] == [0, 1, 2]  # group 0 succeeded on its 3rd try
    assert stats.retried == 2
    # one line per retry, naming the group
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"rollout group {batch[0].group_id} failed; retry {n}" for n in (1, 2)]
    documented("a failed rollout group", lines[0])
    assert stats.failed == 0
    # the retried group kept its identity (indices, routing keys)
    assert [s.index for s in batch[0].samples] == [0, 1]
    assert all(s.routing_key for s in batch[0].samples)


async def test_retries_give_up_after_max(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.rollout")

    async def broken(sample: Sample) -> None:
        await trio.sleep(1)
        if sample.group_index == 0:
            raise OSError("permanent")
        sample.status = SampleStatus.COMPLETED

    async with open_async_rollout(
        source(10),
        GroupFactory(group_size=2),
        GroupRunner(broken),
        batch_size=1,
        max_groups_in_flight=1,
        on_failure=FailurePolicy("retry", max_retries=1),
    ) as driver:
        batch = await driver.next_batch()
        await trio.sleep(10)  # the retry may still be running when another group completes
        stats = driver.statistics()
    assert batch[0].group_index != 0
    assert stats.retried == 1
    assert stats.failed == 1
    (retry, given_up) = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert retry[0] == logging.WARNING
    assert retry[1].endswith(" failed; retry 1")
    assert given_up[0] == logging.ERROR
    assert given_up[1] == retry[1].replace("retry 1", "skipping it")
    documented("a failed rollout group", given_up[1], 1)


async def test_exhaustion_raises_or_returns_partial(autojump_clock: trio.testing.MockClock) -> None:
    async with open_async_rollout(*parts(Puppet(auto_delay=1), source(3)), batch_size=2) as driver:
        assert len(await driver.next_batch()) == 2
        with pytest.raises(SourceExhaustedError, match="1 of 2"):
            await driver.next_batch()
        assert driver.statistics().buffered == 1  # the group taken is not lost
    async with open_async_rollout(*parts(Puppet(auto_delay=1), source(3)), batch_size=2) as driver:
        assert len(await driver.next_batch()) == 2
        assert len(await driver.next_batch(allow_partial=True)) == 1
        with pytest.raises(SourceExhaustedError):
            await driver.next_batch(allow_partial=True)


async def test_resumed_groups_first_and_zero_missing_dispatches_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    factory = GroupFactory(group_size=G, next_sample_index=500, next_group_index=50)
    arrived = [
        Sample(index=10 + i, group_index=5, prompt_tokens=(1,), status=SampleStatus.COMPLETED)
        for i in range(G)
    ]
    complete = OpenGroup(group_id="done", prompt=prompts(1, "d")[0], group_size=G, arrived=arrived)
    partial = OpenGroup(
        group_id="half", prompt=prompts(1, "h")[0], group_size=G, arrived=arrived[:1]
    )
    async with open_async_rollout(
        source(10),
        factory,
        GroupRunner(puppet),
        batch_size=2,
        max_groups_in_flight=1,
        resumed=[complete, partial],
    ) as driver:
        batch = await driver.next_batch()
    assert {g.group_id for g in batch} == {"done", "half"}
    done = next(g for g in batch if g.group_id == "done")
    assert done.samples == arrived
    # "done" started nothing; the missing member of "half" ran before any new prompt
    assert puppet.started_indices()[0] == 500
    assert 10 not in puppet.started_indices()
    assert 11 not in puppet.started_indices()


async def test_closing_cancels_every_in_flight_group() -> None:
    puppet = Puppet()
    async with open_async_rollout(*parts(puppet), batch_size=3) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert len(puppet.started) == 6
    assert sorted(puppet.cancelled) == list(range(6))
    with pytest.raises(RolloutError, match="closed"):
        await driver.next_batch()


async def test_closing_lets_arrived_replies_finish_and_starts_no_new_group() -> None:
    # Replies that arrived before the block ends are not thrown away: a sample whose task is
    # runnable finishes (and its group with it); the rest is cancelled; a group admitted in
    # that last moment never calls the engine.
    puppet = Puppet()
    async with open_async_rollout(*parts(puppet), batch_size=2) as driver:
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(puppet.started_indices()) == [0, 1, 2, 3]
        puppet.finish(0, 1, 2)  # group 0's replies and one of group 1's: runnable, not run
        submitted = driver.statistics().submitted
    assert sorted(puppet.finished) == [0, 1, 2]
    assert puppet.cancelled == [3]
    assert driver.statistics().submitted == submitted  # nothing admitted while closing
    assert sorted(puppet.started_indices()) == [0, 1, 2, 3]
    assert driver.scheduler.ledger.in_flight == 0


async def _close_with_samples_one_step_from_done() -> tuple[int, list[int], list[int]]:
    """Replies arrive just before the block ends; each sample then takes one step that
    settles nothing (a checkpoint) and one that finishes it. Returns the samples in flight at
    the close, and those that finished and were cancelled."""
    gate = trio.Event()
    finished: list[int] = []
    cancelled: list[int] = []

    async def generate(sample: Sample) -> None:
        try:
            await gate.wait()
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            cancelled.append(sample.index)
            raise
        sample.status = SampleStatus.COMPLETED
        finished.append(sample.index)

    async with open_async_rollout(
        source(1000), GroupFactory(group_size=G), GroupRunner(generate), batch_size=1
    ) as driver:
        await trio.testing.wait_all_tasks_blocked()
        in_flight = driver.statistics().in_flight_samples
        gate.set()
    assert driver.scheduler.ledger.in_flight == 0
    return in_flight, finished, cancelled


async def test_closing_finishes_samples_one_step_from_done_whatever_order_trio_runs_them() -> None:
    # trio runs each batch of tasks in either order, so a closing driver that looked too few
    # times cancelled the whole lot about half the time; ten closings must all finish them.
    for _ in range(10):
        in_flight, finished, cancelled = await _close_with_samples_one_step_from_done()
        assert in_flight > 0
        assert cancelled == []
        assert len(finished) == in_flight


@pytest.mark.parametrize("task", [run_reporting, run_booked])
async def test_a_group_task_starting_while_its_driver_closes_runs_nothing(task) -> None:  # type: ignore[no-untyped-def]
    # What a group admitted in the driver's last moment does when its task first runs.
    puppet = Puppet()
    scheduler = CreditScheduler(SampleBackfill(), G)
    group = GroupFactory(group_size=G).make(prompts(1)[0])
    scheduler.submitted(group.group_id, G)
    scheduler.winding_down = True
    args = (GroupRunner(puppet), group, scheduler)
    await (task(*args) if task is run_reporting else task(*args, None))
    assert puppet.started == []
    (outcome,) = scheduler.poll()
    assert outcome.status is GroupStatus.CANCELLED
    assert scheduler.ledger.in_flight == 0
    assert scheduler.ledger.pending_groups == 0


async def test_cancelling_a_waiting_consumer_keeps_taken_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet()
    async with open_async_rollout(*parts(puppet), batch_size=2) as driver:
        await trio.testing.wait_all_tasks_blocked()
        puppet.finish(*samples_of(0))
        with trio.move_on_after(50):
            await driver.next_batch()  # takes group 0, then waits for a second one
        assert driver.statistics().buffered == 1
        assert driver.statistics().consumed == 0
        puppet.finish(*samples_of(1))
        batch = await driver.next_batch()
        assert [g.group_index for g in batch] == [0, 1]


async def test_body_error_propagates_and_closes_the_driver() -> None:
    puppet = Puppet()

    async def consumer() -> None:
        async with open_async_rollout(*parts(puppet), batch_size=2):
            await trio.testing.wait_all_tasks_blocked()
            raise KeyError("consumer bug")

    with pytest.raises(KeyError):  # unwrapped: not an ExceptionGroup
        await consumer()
    assert sorted(puppet.cancelled) == list(range(4))


async def test_credits_balance_at_every_step(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet(auto_delay=3)
    async with open_async_rollout(
        *parts(puppet, group_size=4), batch_size=4, policy=SampleBackfill()
    ) as driver:
        for _ in range(5):
            await driver.next_batch()
            driver.scheduler.ledger.check()
            assert driver.scheduler.ledger.in_flight <= 4 * 4


def _unused(group: Group) -> None:  # keep the import used for type hints
    del group


async def test_held_groups_snapshot_resumes_only_the_unfinished_samples() -> None:
    puppet = Puppet()
    async with open_async_rollout(*parts(puppet), batch_size=2) as driver:
        await trio.testing.wait_all_tasks_blocked()
        puppet.finish(0)  # one sample of group 0 done, group 1 untouched
        await trio.testing.wait_all_tasks_blocked()
        snapshot = {r.prompt.key: r for r in driver.held_groups()}
        assert driver.buffered_groups() == []
    assert set(snapshot) == {"p0", "p1"}
    assert [s.index for s in snapshot["p0"].arrived] == [0]
    assert snapshot["p0"].missing == 1
    assert snapshot["p1"].missing == 2
    # resuming the snapshot generates exactly the missing samples
    again = Puppet(auto_delay=1)
    factory = GroupFactory(group_size=G, next_sample_index=100)
    async with open_async_rollout(
        source(0), factory, GroupRunner(again), batch_size=2, resumed=snapshot.values()
    ) as driver:
        batch = await driver.next_batch()
    assert {g.prompt.key for g in batch} == {"p0", "p1"}
    assert sorted(again.started_indices()) == [100, 101, 102]


async def test_held_groups_hold_every_taken_prompt_even_while_waiting_for_buffer_space(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``held_groups()`` misses no prompt taken from the source: a finished group the worker
    holds while the buffer is full is still listed."""
    from rollout_helpers import Puppet, source

    from trio_rl.rollout import GroupFactory, GroupRunner, open_async_rollout

    src = source(50)
    async with open_async_rollout(
        src,
        GroupFactory(2),
        GroupRunner(Puppet(auto_delay=1.0)),
        batch_size=1,
        max_groups_in_flight=3,
        buffer_capacity=1,
    ) as driver:
        for _ in range(4):
            await trio.sleep(5)
            taken = {f"p{i}" for i in range(src.state()["position"])}
            held = [g.prompt.key for g in driver.held_groups()]
            assert sorted(held) == sorted(taken)
            assert driver.statistics().buffered == 1  # full: the worker waits for space
        (group,) = await driver.next_batch()
        await trio.sleep(5)
        taken = {f"p{i}" for i in range(src.state()["position"])}
        assert sorted([*(g.prompt.key for g in driver.held_groups()), group.prompt.key]) == sorted(
            taken
        )


async def test_a_resumed_groups_new_members_record_the_version_they_start_at(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The worker resumes at version 7 a group that started at 1: the arrived member keeps
    its place, the regenerated ones carry 7 (what the "group_start" rule judges them by)."""
    puppet = Puppet(auto_delay=1)
    arrived = [Sample(index=10, group_index=5, prompt_tokens=(1,), status=SampleStatus.COMPLETED)]
    partial = OpenGroup(
        group_id="half",
        prompt=prompts(1, "h")[0],
        group_size=G,
        arrived=arrived,
        policy_version_at_start=1,
    )
    async with open_async_rollout(
        source(10),
        GroupFactory(group_size=G),
        GroupRunner(puppet),
        batch_size=1,
        max_groups_in_flight=1,
        resumed=[partial],
        policy_version=7,
    ) as driver:
        (group,) = await driver.next_batch()
    assert group.group_id == "half"
    assert group.policy_version_at_start == 1
    assert [s.metadata.get(RESUMED_AT) for s in group.samples] == [None] + [7] * (G - 1)
