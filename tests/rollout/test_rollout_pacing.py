"""The async worker's start pacing, its buffer wake-ups and the reference policies' fast path."""

from __future__ import annotations

import attrs
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from rollout_helpers import source

from trio_rl.rollout import (
    CreditLedger,
    CreditScheduler,
    CreditView,
    GroupFactory,
    GroupGranularity,
    GroupRunner,
    SampleBackfill,
    open_async_rollout,
)
from trio_rl.rollout._buffer import Wakeup
from trio_rl.rollout._credits import _FAST_POLICIES
from trio_rl.samples import Group, Prompt, Sample, SampleStatus

G = 2


async def test_a_refill_is_decided_whole_then_started_a_group_at_a_time() -> None:
    """Every admission of a refill is taken before the first sample starts, and the first
    group's samples finish before the last group's samples start (the worker yields after
    each group start instead of building the whole budget's tasks first)."""
    events: list[tuple[str, int, int]] = []
    submitted_at_first_start: list[int] = []
    driver_box: list[object] = []

    async def generate(sample: Sample) -> None:
        if not submitted_at_first_start:
            submitted_at_first_start.append(driver_box[0].statistics().submitted)  # type: ignore[attr-defined]
        events.append(("start", sample.group_index, sample.index))
        await trio.lowlevel.checkpoint()
        sample.status = SampleStatus.COMPLETED
        events.append(("finish", sample.group_index, sample.index))

    async with open_async_rollout(
        source(4), GroupFactory(group_size=G), GroupRunner(generate), batch_size=4
    ) as driver:
        driver_box.append(driver)
        batch = await driver.next_batch()
    assert [g.group_index for g in batch] == [0, 1, 2, 3]
    assert submitted_at_first_start == [4]
    first_finish_of_0 = events.index(next(e for e in events if e[:2] == ("finish", 0)))
    first_start_of_3 = events.index(next(e for e in events if e[:2] == ("start", 3)))
    assert first_finish_of_0 < first_start_of_3, events


async def test_wakeup_wakes_current_waiters_and_latches_nothing() -> None:
    wakeup = Wakeup()
    woken: list[int] = []
    wakeup.set()  # nobody waits: lost

    async def waiter(i: int) -> None:
        await wakeup.wait()
        woken.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, 1)
        nursery.start_soon(waiter, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []  # the earlier set was not latched
        wakeup.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == [1, 2]
        nursery.start_soon(waiter, 3)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # a waiter is cancellable
    assert sorted(woken) == [1, 2]


@given(
    credits=st.lists(st.integers(min_value=0, max_value=9), max_size=12),
    group_size=st.integers(min_value=1, max_value=9),
    budget=st.integers(min_value=0, max_value=14),
)
def test_the_fast_path_decides_as_the_reference_policies(
    credits: list[int], group_size: int, budget: int
) -> None:
    ledger = CreditLedger()
    for i, c in enumerate(credits):
        ledger.open(f"g{i}", c)
    view = ledger.view(group_size, budget)
    for policy in (SampleBackfill(), GroupGranularity()):
        fast = _FAST_POLICIES[type(policy)]
        assert fast(policy, ledger, group_size, budget) == policy.admits(view)


@attrs.frozen
class _NeverAdmits(SampleBackfill):
    def admits(self, view: CreditView) -> bool:
        return False


def test_a_subclass_of_a_reference_policy_is_asked_itself() -> None:
    scheduler = CreditScheduler(_NeverAdmits(), G)
    assert not scheduler.admits(budget=10)
    assert CreditScheduler(SampleBackfill(), G).admits(budget=10)


def test_group_staleness_reads_no_list_into_being() -> None:
    samples = [Sample(index=i, group_index=0, prompt_tokens=(1,)) for i in range(3)]
    group = Group(group_id="g", prompt=Prompt(key="p", tokens=(1,)), samples=samples)
    assert [group.oldest_version, samples[0].oldest_version] == [None, None]
    assert group.staleness(5) == 0
    assert all(s._policy_versions is None for s in samples)
    samples[1].policy_versions.extend([4, 3])
    samples[2].policy_versions.append(2)
    assert group.oldest_version == 2
    assert group.staleness(5) == 3
    assert samples[1].oldest_version == 3
    assert samples[0]._policy_versions is None
