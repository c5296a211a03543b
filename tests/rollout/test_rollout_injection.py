"""Public injection points for observers of the rollout layer (the testing harness uses them).

A ledger passed to the scheduler or the async driver is the one they keep their books in, and
the async driver's ``failure`` says why its worker stopped, without reaching into privates.
"""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing
from rollout_helpers import Puppet, source

from trio_rl.rollout import (
    CreditError,
    CreditLedger,
    CreditScheduler,
    DriverFailedError,
    FailurePolicy,
    GroupFactory,
    GroupFailedError,
    GroupRunner,
    SampleBackfill,
    open_async_rollout,
)

G = 2


@attrs.define(slots=True)
class CountingLedger(CreditLedger):
    """Counts every group the driver opens, retries included."""

    opens: list[str] = attrs.field(factory=list)

    def open(self, group_id: str, credits: int) -> None:
        super().open(group_id, credits)
        self.opens.append(group_id)


def test_scheduler_keeps_its_accounts_in_the_given_ledger() -> None:
    ledger = CountingLedger()
    scheduler = CreditScheduler(SampleBackfill(), G, ledger=ledger)
    assert scheduler.ledger is ledger
    scheduler.submitted("a", 2)
    assert ledger.opens == ["a"]
    assert ledger.in_flight == 2


def test_scheduler_refuses_a_used_ledger() -> None:
    used = CreditLedger()
    used.open("a", 1)
    with pytest.raises(CreditError, match=r"must be empty.*pending_groups=1"):
        CreditScheduler(SampleBackfill(), G, ledger=used)


async def test_async_driver_counts_every_submission_in_the_given_ledger(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = CountingLedger()
    puppet = Puppet(auto_delay=1)
    puppet.fail(0, RuntimeError("once"))  # group 0 fails once and is retried under its id
    async with open_async_rollout(
        source(10),
        GroupFactory(G),
        GroupRunner(puppet),
        batch_size=2,
        max_groups_in_flight=1,
        on_failure=FailurePolicy("retry", max_retries=1),
        ledger=ledger,
    ) as driver:
        assert driver.scheduler.ledger is ledger
        await driver.next_batch()
        first = ledger.opens[0]
        assert ledger.opens.count(first) == 2, ledger.opens  # the retry reopened group 0
        assert ledger.opened == len(ledger.opens) * G
        ledger.check()


async def test_async_driver_failure_is_none_until_the_worker_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(2, 3)
    async with open_async_rollout(
        source(10),
        GroupFactory(G),
        GroupRunner(puppet),
        batch_size=1,
        max_groups_in_flight=2,
        buffer_capacity=100,
        on_failure=FailurePolicy("fail"),
    ) as driver:
        await trio.sleep(5)
        before = driver.failure  # a local: the failure below changes the property
        assert before is None
        puppet.fail(2, RuntimeError("generation exploded"))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(driver.failure, GroupFailedError)
        with pytest.raises(DriverFailedError) as info:
            await driver.next_batch()
        assert info.value.__cause__ is driver.failure


async def test_async_driver_failure_stays_none_after_a_clean_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet()  # every sample held: the close cancels them
    async with open_async_rollout(
        source(10), GroupFactory(G), GroupRunner(puppet), batch_size=1
    ) as driver:
        await trio.sleep(1)
    assert driver.failure is None
