"""Credits, policies and the scheduler: the reference scheduler scenarios and invariants."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from trio_rl.rollout import (
    CreditError,
    CreditLedger,
    CreditScheduler,
    CreditView,
    GroupGranularity,
    GroupOutcome,
    GroupStatus,
    SampleBackfill,
    SubmissionPolicy,
)
from trio_rl.samples import Group, Prompt, Sample

G = 4


def group(gid: str, size: int = G) -> Group:
    samples = [Sample(index=i, group_index=0, prompt_tokens=(1,)) for i in range(size)]
    return Group(group_id=gid, prompt=Prompt(key=gid, tokens=(1,)), samples=samples)


def test_policies_satisfy_protocol() -> None:
    assert isinstance(GroupGranularity(), SubmissionPolicy)
    assert isinstance(SampleBackfill(), SubmissionPolicy)
    assert not GroupGranularity().counts_samples
    assert SampleBackfill().counts_samples


def test_group_granularity_counts_groups() -> None:
    policy = GroupGranularity()
    assert policy.admits(CreditView(in_flight=4, pending_groups=1, group_size=4, budget=2))
    assert not policy.admits(CreditView(in_flight=0, pending_groups=2, group_size=4, budget=2))


def test_backfill_counts_samples() -> None:
    policy = SampleBackfill()
    assert not policy.admits(CreditView(in_flight=8, pending_groups=2, group_size=4, budget=2))
    assert not policy.admits(CreditView(in_flight=5, pending_groups=2, group_size=4, budget=2))
    assert policy.admits(CreditView(in_flight=4, pending_groups=2, group_size=4, budget=2))


@given(
    g=st.integers(1, 8),
    b=st.integers(0, 4),
    pending=st.lists(st.integers(0, 8), max_size=6),
)
def test_backfill_admits_whenever_group_granularity_would(
    g: int, b: int, pending: list[int]
) -> None:
    # under exact accounting c = sum of unfinished samples of pending groups, each <= G
    unfinished = [min(u, g) for u in pending]
    view = CreditView(
        in_flight=sum(unfinished), pending_groups=len(unfinished), group_size=g, budget=b
    )
    if GroupGranularity().admits(view):
        assert SampleBackfill().admits(view)
    assert SampleBackfill().admits(view) == (view.in_flight + g <= b * g)


def test_ledger_conserves_credits_per_group() -> None:
    ledger = CreditLedger()
    ledger.open("a", 4)
    ledger.open("b", 4)
    ledger.sample_done("a")
    ledger.sample_done("a")
    assert ledger.in_flight == 6
    assert ledger.pending() == {"a": 2, "b": 4}
    ledger.check()
    # a group that ends with unreturned credits (samples never started) returns them itself
    assert ledger.close("a") == 2
    assert ledger.in_flight == 4
    assert ledger.close("b") == 4
    assert ledger.in_flight == 0
    assert ledger.pending_groups == 0
    ledger.check()


def test_ledger_rejects_double_returns_and_unknown_groups() -> None:
    ledger = CreditLedger()
    ledger.open("a", 1)
    ledger.sample_done("a")
    with pytest.raises(CreditError, match="more credits than it took"):
        ledger.sample_done("a")
    with pytest.raises(CreditError, match="not pending"):
        ledger.sample_done("zzz")
    with pytest.raises(CreditError, match="already pending"):
        ledger.open("a", 1)
    ledger.in_flight += 1  # simulate corruption
    with pytest.raises(CreditError, match="out of balance"):
        ledger.check()


async def test_backfill_needs_a_full_group_of_returned_credits() -> None:
    """Reference: credits 8; 3 returns still refuse; the 4th admits."""
    scheduler = CreditScheduler(SampleBackfill(), group_size=G)
    scheduler.submitted("a", G)
    scheduler.submitted("b", G)
    assert not scheduler.admits(budget=2)
    for _ in range(3):
        scheduler.sample_done("a")
    assert await scheduler.wait_for_progress() == []
    assert scheduler.ledger.in_flight == 5
    assert not scheduler.admits(budget=2)
    scheduler.sample_done("b")
    assert await scheduler.wait_for_progress() == []
    assert scheduler.admits(budget=2)
    scheduler.ledger.check()
    scheduler.close()


async def test_wait_returns_on_group_completion_with_all_queued_events_applied() -> None:
    scheduler = CreditScheduler(GroupGranularity(), group_size=2)
    scheduler.submitted("a", 2)
    g = group("a", 2)
    scheduler.sample_done("a")
    scheduler.group_done(GroupOutcome(g, GroupStatus.COMPLETED))
    done = await scheduler.wait_for_progress()
    assert [o.group_id for o in done] == ["a"]
    assert scheduler.ledger.in_flight == 0
    assert scheduler.ledger.pending_groups == 0
    assert scheduler.statistics().wakeups == 1
    scheduler.close()


async def test_group_granularity_ignores_sample_completions() -> None:
    scheduler = CreditScheduler(GroupGranularity(), group_size=2)
    scheduler.submitted("a", 2)
    woke: list[bool] = []  # a list: a flag a nested task sets, which mypy may not narrow

    async def waiter() -> None:
        await scheduler.wait_for_progress()
        woke.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        scheduler.sample_done("a")
        scheduler.sample_done("a")
        await trio.testing.wait_all_tasks_blocked()
        assert not woke
        assert scheduler.ledger.in_flight == 0  # applied, but not progress
        scheduler.group_done(GroupOutcome(group("a", 2), GroupStatus.COMPLETED))
    assert woke
    scheduler.close()


async def test_sample_completion_wakes_backfill_waiter() -> None:
    scheduler = CreditScheduler(SampleBackfill(), group_size=2)
    scheduler.submitted("a", 2)
    results: list[list[GroupOutcome]] = []

    async def waiter() -> None:
        results.append(await scheduler.wait_for_progress())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert results == []
        scheduler.sample_done("a")
    assert results == [[]]
    assert scheduler.ledger.in_flight == 1
    scheduler.close()


async def test_events_before_the_wait_are_not_lost() -> None:
    """The wake-up cannot be lost: a completion sent before the wait starts counts."""
    scheduler = CreditScheduler(SampleBackfill(), group_size=2)
    scheduler.submitted("a", 2)
    assert not scheduler.admits(budget=1)
    scheduler.sample_done("a")
    with trio.fail_after(1):
        assert await scheduler.wait_for_progress() == []
    scheduler.close()


async def test_cancelled_wait_keeps_applied_outcomes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler = CreditScheduler(GroupGranularity(), group_size=1)
    scheduler.submitted("a", 1)
    scheduler.submitted("b", 1)
    with trio.move_on_after(0.01):
        # nothing queued: this blocks and is cancelled
        await scheduler.wait_for_progress()
    scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))
    done = await scheduler.wait_for_progress()
    assert [o.group_id for o in done] == ["a"]
    scheduler.close()


async def test_a_backlog_of_reports_is_one_wake_up_applied_whole() -> None:
    """Reports queue on the channel until the driver runs; its one wake-up applies them all
    (one ``receive()``, then ``receive_nowait()`` until the channel is empty)."""
    scheduler = CreditScheduler(SampleBackfill(), group_size=G)
    scheduler.submitted("a", G)
    results: list[list[GroupOutcome]] = []

    async def waiter() -> None:
        results.append(await scheduler.wait_for_progress())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(G - 1):
            scheduler.sample_done("a")
        # the first report went straight to the waiting driver, the rest are queued
        assert scheduler.queued == G - 2
        assert scheduler.statistics().queued == G - 2
        assert scheduler.ledger.in_flight == G  # nothing applied before the driver runs
    assert results == [[]]
    assert scheduler.queued == 0
    assert scheduler.ledger.in_flight == 1
    assert scheduler.statistics().wakeups == 1
    assert scheduler.statistics().sample_events == G - 1
    scheduler.close()


@pytest.mark.parametrize(
    "report_first", [False, True], ids=["cancel-then-report", "report-then-cancel"]
)
async def test_a_report_sent_while_the_wait_is_cancelled_is_delivered_by_the_next_wait(
    report_first: bool,
) -> None:
    """The driver's wait is cancelled and, in the same step, a group reports its end: whichever
    comes first, the outcome is returned once, by the cancelled wait or by the next one."""
    scheduler = CreditScheduler(GroupGranularity(), group_size=1)
    scheduler.submitted("a", 1)
    scheduler.submitted("b", 1)
    got: list[list[GroupOutcome]] = []
    cancelled: list[bool] = []

    async def driver(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            got.append(await scheduler.wait_for_progress())
            await trio.lowlevel.checkpoint()
        cancelled.append(scope.cancelled_caught)

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(driver)
        await trio.testing.wait_all_tasks_blocked()
        if report_first:
            scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))
            scope.cancel()
        else:
            scope.cancel()
            scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))
    assert cancelled == [True]
    if report_first:
        # handed to the waiting driver before the cancellation: the wait returned it
        assert [[o.group_id for o in batch] for batch in got] == [["a"]]
        assert scheduler.poll() == []
    else:
        # the wait was cancelled before the report: it stays queued for the next wait
        assert got == []
        assert scheduler.queued == 1
        with trio.fail_after(1):
            assert [o.group_id for o in await scheduler.wait_for_progress()] == ["a"]
    assert scheduler.ledger.pending() == {"b": 1}
    scheduler.group_done(GroupOutcome(group("b", 1), GroupStatus.COMPLETED))
    with trio.fail_after(1):
        assert [o.group_id for o in await scheduler.wait_for_progress()] == ["b"]
    scheduler.ledger.check()
    scheduler.close()


async def test_a_refused_admission_clears_only_sample_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Samples a refused decision already read do not wake the next wait; a finished group
    or a nudge applied with them still does."""
    scheduler = CreditScheduler(SampleBackfill(), group_size=2)
    scheduler.submitted("a", 2)
    scheduler.submitted("b", 2)
    scheduler.sample_done("a")
    scheduler.settle()  # applied outside a wait: the progress is kept for the driver
    assert scheduler.ledger.in_flight == 3
    assert not scheduler.admits(budget=2)  # read it, refused: the sample progress is spent
    with trio.move_on_after(0.05) as scope:
        await scheduler.wait_for_progress()
    assert scope.cancelled_caught
    scheduler.sample_done("b")
    scheduler.nudge("resume")
    scheduler.settle()
    assert not scheduler.admits(budget=1)
    with trio.fail_after(1):
        assert await scheduler.wait_for_progress() == []  # the nudge survived the refusal
    scheduler.close()


async def test_closing_applies_the_backlog_and_refuses_later_reports() -> None:
    scheduler = CreditScheduler(GroupGranularity(), group_size=1)
    scheduler.submitted("a", 1)
    scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))
    scheduler.close()
    assert scheduler.ledger.pending_groups == 0
    assert [o.group_id for o in scheduler.poll()] == ["a"]
    with pytest.raises(trio.ClosedResourceError):
        scheduler.sample_done("a")
    with pytest.raises(trio.ClosedResourceError):
        scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))
    with pytest.raises(trio.ClosedResourceError):
        scheduler.nudge()
    with pytest.raises(trio.ClosedResourceError):
        await scheduler.wait_for_progress()  # nothing left: a wait would never end


async def test_a_refused_report_raises_on_the_driver_side() -> None:
    """A reporter calls from a ``finally`` and must not raise there: a report the ledger
    refuses surfaces as CreditError from the driver's wait (or poll) that applies it."""
    scheduler = CreditScheduler(SampleBackfill(), group_size=G)
    scheduler.submitted("a", 1)
    scheduler.sample_done("a")
    scheduler.sample_done("a")  # one credit too many: recorded, not raised here
    with trio.fail_after(1), pytest.raises(CreditError, match="more credits than it took"):
        await scheduler.wait_for_progress()
    scheduler.group_done(GroupOutcome(group("zzz", 1), GroupStatus.COMPLETED))
    with pytest.raises(CreditError, match="not pending"):
        scheduler.poll()
    scheduler.close()
    with pytest.raises(trio.ClosedResourceError):
        scheduler.sample_done("a")


async def test_settling_while_the_driver_waits_keeps_the_channel_order() -> None:
    """A report sent while the driver waits goes to it directly; the ones behind it queue. A
    settle (the wind-down's) then must not apply the queued group end before the sample the
    driver holds: it leaves the backlog to the driver."""
    scheduler = CreditScheduler(GroupGranularity(), group_size=1)
    scheduler.submitted("a", 1)
    got: list[list[GroupOutcome]] = []

    async def driver() -> None:
        got.append(await scheduler.wait_for_progress())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver)
        await trio.testing.wait_all_tasks_blocked()
        scheduler.sample_done("a")  # handed to the waiting driver
        scheduler.group_done(GroupOutcome(group("a", 1), GroupStatus.COMPLETED))  # queued
        scheduler.settle()
        assert scheduler.ledger.pending() == {"a": 1}
    assert [[o.group_id for o in batch] for batch in got] == [["a"]]
    assert scheduler.ledger.pending_groups == 0
    scheduler.ledger.check()
    scheduler.close()
