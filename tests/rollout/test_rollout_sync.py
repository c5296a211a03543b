"""The sync batch driver: exactly T groups, backfill, filters, failures, exhaustion."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from rollout_helpers import Puppet, prompts, source

from trio_rl.rollout import (
    GroupFactory,
    GroupRunner,
    InMemorySource,
    RolloutBatch,
    RolloutError,
    SampleBackfill,
    SourceExhaustedError,
    SubmissionPolicy,
    SyncRolloutDriver,
    reject_aborted,
)
from trio_rl.samples import Group, OpenGroup, Sample, SampleStatus

G = 4


def make_driver(
    puppet: Puppet,
    src: InMemorySource | None = None,
    *,
    policy: SubmissionPolicy | None = None,
    **kwargs: object,
) -> SyncRolloutDriver:
    # miles' own scheduler tests run with over_sampling_batch_size=1; so do these
    kwargs.setdefault("groups_per_admission", 1)
    return SyncRolloutDriver(
        src if src is not None else source(100),
        GroupFactory(group_size=G),
        GroupRunner(puppet),
        policy=policy,
        **kwargs,  # type: ignore[arg-type]
    )


class Run:
    """Runs ``driver.generate`` in the background so the test can steer the puppet."""

    def __init__(self, driver: SyncRolloutDriver, batch_size: int, **kwargs: object) -> None:
        self.driver = driver
        self.batch_size = batch_size
        self.kwargs = kwargs
        self.result: RolloutBatch | None = None

    async def __call__(self) -> None:
        self.result = await self.driver.generate(self.batch_size, **self.kwargs)  # type: ignore[arg-type]


def group_samples(g: int) -> list[int]:
    return list(range(g * G, (g + 1) * G))


async def test_group_granularity_is_the_default() -> None:
    puppet = Puppet()
    driver = make_driver(puppet)
    run = Run(driver, 2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1]
        # group granularity: samples finishing do not open room while groups are pending
        puppet.finish(*group_samples(0)[:3], *group_samples(1)[:1])
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1]
        puppet.finish(*group_samples(1), *group_samples(0))
    assert run.result is not None
    assert [g.group_index for g in run.result.groups] == [0, 1]
    assert run.result.statistics.submitted == 2
    assert run.result.complete


async def test_backfill_submits_replacement_once_a_group_worth_of_samples_finished() -> None:
    """Reference: 3 + 1 finished samples of two pending groups start group 3."""
    puppet = Puppet()
    driver = make_driver(puppet, policy=SampleBackfill())
    run = Run(driver, 2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1]
        assert driver.scheduler is not None
        assert driver.scheduler.ledger.in_flight == 8
        puppet.finish(*group_samples(0)[:3])
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1]  # 5 + 4 > 8: nothing submitted
        assert driver.scheduler.ledger.in_flight == 5
        puppet.finish(group_samples(1)[0])
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1, 2]  # 4 + 4 <= 8
        assert sorted(driver.scheduler.ledger.pending().values()) == [1, 3, 4]
        driver.scheduler.ledger.check()
        puppet.finish(*range(12))
    assert run.result is not None
    assert len(run.result.groups) == 2
    assert run.result.statistics.surplus == 1
    firsts = [g.first_index for g in run.result.groups]
    assert firsts == sorted(firsts)


async def test_three_completions_alone_submit_nothing() -> None:
    puppet = Puppet()
    driver = make_driver(puppet, policy=SampleBackfill())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Run(driver, 2))
        await trio.testing.wait_all_tasks_blocked()
        puppet.finish(0, 1, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert puppet.started_groups() == [0, 1]
        nursery.cancel_scope.cancel()


async def test_failed_group_is_counted_and_replaced(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(1)
    driver = make_driver(puppet)
    async with trio.open_nursery() as nursery:
        run = Run(driver, 2)
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        puppet.fail(1, RuntimeError("engine exploded"))
    assert run.result is not None
    assert [g.group_index for g in run.result.groups] == [1, 2]
    assert run.result.statistics.failed == 1
    assert "engine exploded" in caplog.text


async def test_max_failures_stops_an_always_failing_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def fail(sample: Sample) -> None:
        await trio.sleep(1)
        raise OSError("down")

    src = source(1000)
    driver = SyncRolloutDriver(src, GroupFactory(group_size=2), GroupRunner(fail), max_failures=3)
    with pytest.raises(RolloutError, match="4 groups failed") as info:
        await driver.generate(2)
    assert isinstance(info.value.__cause__.__cause__, OSError)  # type: ignore[union-attr]
    assert src.taken < 10


async def test_dynamic_filter_counts_drops_by_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    for i in group_samples(0):
        puppet.finish(i, status=SampleStatus.ABORTED)

    def odd(group: Group) -> str | None:
        return reject_aborted(group) or ("odd" if group.group_index % 2 else None)

    driver = make_driver(puppet, dynamic_filter=odd)
    batch = await driver.generate(3)
    assert [g.group_index for g in batch.groups] == [2, 4, 6]
    assert batch.statistics.filtered == {"aborted": 1, "odd": 3}
    assert batch.statistics.accepted == 3


async def test_exhausted_source_raises_or_returns_partial(
    autojump_clock: trio.testing.MockClock,
) -> None:
    driver = make_driver(Puppet(auto_delay=1), source(3))
    with pytest.raises(SourceExhaustedError, match="3 of 5 groups"):
        await driver.generate(5)
    driver = make_driver(Puppet(auto_delay=1), source(3))
    batch = await driver.generate(5, allow_partial=True)
    assert not batch.complete
    assert [g.group_index for g in batch.groups] == [0, 1, 2]
    # nothing left at all: an error even with allow_partial, never an empty hang
    with pytest.raises(SourceExhaustedError):
        await driver.generate(1, allow_partial=True)


async def test_leftovers_are_cancelled_and_recycled_with_partial_rollouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The puppet ignores the abort: after ``abort_timeout`` the straggler is cancelled and
    its prompt recycled (test_rollout_partial.py covers generate functions that stop)."""
    puppet = Puppet(auto_delay=1)
    puppet.hold(*group_samples(1))  # group 1 straggles
    src = source(10)
    driver = make_driver(puppet, src, groups_per_admission=3, partial_rollouts=True)
    batch = await driver.generate(2)
    assert [g.group_index for g in batch.groups] == [0, 2]
    assert batch.statistics.cancelled == 1
    assert batch.statistics.recycled == 1
    assert sorted(puppet.cancelled) == group_samples(1)
    assert src.take().key == "p1"  # the straggler's prompt is served first


async def test_leftovers_are_not_recycled_without_partial_rollouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(*group_samples(1))
    src = source(10)
    driver = make_driver(puppet, src, groups_per_admission=3)
    batch = await driver.generate(2)
    assert batch.statistics.cancelled == 1
    assert batch.statistics.recycled == 0
    assert src.take().key == "p3"


async def test_resumed_groups_run_before_new_prompts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    driver = make_driver(puppet, source(10))
    driver.factory.load_state({"next_sample_index": 1000, "next_group_index": 50})
    arrived = [
        Sample(index=900 + i, group_index=7, prompt_tokens=(1,), status=SampleStatus.COMPLETED)
        for i in range(G)
    ]
    full = OpenGroup(group_id="full", prompt=prompts(1, "r")[0], group_size=G, arrived=arrived)
    half = OpenGroup(group_id="half", prompt=prompts(1, "h")[0], group_size=G, arrived=arrived[:0])
    driver.resume([full, half])
    batch = await driver.generate(2)
    assert {g.group_id for g in batch.groups} == {"full", "half"}
    # the full group dispatched nothing; the empty one generated all G
    assert sorted(puppet.started_indices()) == list(range(1000, 1000 + G))
    assert [g.group_index for g in batch.groups] == [7, 50]


async def test_nothing_carries_over_between_calls(autojump_clock: trio.testing.MockClock) -> None:
    puppet = Puppet(auto_delay=1)
    driver = make_driver(puppet, policy=SampleBackfill())
    first = await driver.generate(3)
    second = await driver.generate(3)
    assert len(first.groups) == len(second.groups) == 3
    assert min(g.first_index for g in second.groups) > max(g.first_index for g in first.groups)
    assert driver.scheduler is None


async def test_cancelling_the_driver_leaves_nothing_running() -> None:
    puppet = Puppet()
    driver = make_driver(puppet, policy=SampleBackfill())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Run(driver, 3))
        await trio.testing.wait_all_tasks_blocked()
        assert len(puppet.started) == 12
        nursery.cancel_scope.cancel()
    assert sorted(puppet.cancelled) == list(range(12))
    assert driver.scheduler is None
    root = trio.lowlevel.current_root_task()
    assert root is not None
    assert len(root.child_nurseries[0].child_tasks) == 1


async def test_a_failing_filter_propagates_unwrapped_and_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(*group_samples(1), *group_samples(2))

    def picky(group: Group) -> str | None:
        if group.group_index == 2:
            raise ValueError("filter bug")
        return None

    src = source(10)
    driver = make_driver(puppet, src, groups_per_admission=3, dynamic_filter=picky)

    async def run() -> None:
        with pytest.raises(ValueError, match="filter bug"):
            await driver.generate(3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.sleep(5)  # group 0 is accepted by now
        puppet.finish(*group_samples(2))
    assert sorted(puppet.cancelled) == group_samples(1)
    assert src.take().key == "p0"  # the accepted group's prompt went back to the source
    assert src.take().key == "p3"


async def test_one_call_at_a_time() -> None:
    puppet = Puppet()
    driver = make_driver(puppet)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Run(driver, 1))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RolloutError, match="already running"):
            await driver.generate(1)
        nursery.cancel_scope.cancel()


async def test_over_sampling_defaults_to_t_groups_per_admission() -> None:
    """Reference: O defaults to T. With T = 2, a filter drop reopens room for one group, and
    the admission fetches O = 2 (O = 1 would fetch one)."""

    def drop_group_0(group: Group) -> str | None:
        return "zero" if group.group_index == 0 else None

    for per_admission, started in ((None, [0, 1, 2, 3]), (1, [0, 1, 2])):
        puppet = Puppet()
        driver = make_driver(
            puppet, groups_per_admission=per_admission, dynamic_filter=drop_group_0
        )
        assert driver.groups_per_admission == per_admission
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Run(driver, 2))
            await trio.testing.wait_all_tasks_blocked()
            assert puppet.started_groups() == [0, 1]
            puppet.finish(*group_samples(0))
            await trio.testing.wait_all_tasks_blocked()
            assert puppet.started_groups() == started
            nursery.cancel_scope.cancel()


async def test_over_sampling_below_t_still_fills_the_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Unlike the reference (which asserts O >= T) a smaller O is allowed: the budget keeps
    admitting until T groups are pending, so O only sets the chunk size."""
    puppet = Puppet(auto_delay=1)
    driver = make_driver(puppet, groups_per_admission=1)
    batch = await driver.generate(5)
    assert len(batch.groups) == 5
    assert batch.statistics.submitted == 5  # no overshoot at all with O = 1
