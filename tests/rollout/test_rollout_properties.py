"""Property tests: credit conservation and driver invariants under adversarial outcomes.

Each example runs one driver in virtual time with per-sample outcomes (delay, ok / raise /
abort) drawn by Hypothesis, and ``st.random_module()`` lets Hypothesis explore (and shrink)
trio's task scheduling too. An instrumented policy checks the ledger at every decision point.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_helpers import prompts

from trio_rl.rollout import (
    CreditScheduler,
    CreditView,
    DriverFailedError,
    FailureBudgetExceededError,
    GroupFactory,
    GroupFailedError,
    GroupGranularity,
    GroupRunner,
    InMemorySource,
    SampleBackfill,
    SourceExhaustedError,
    SubmissionPolicy,
    SyncRolloutDriver,
    open_async_rollout,
)
from trio_rl.samples import Sample, SampleStatus

outcomes = st.lists(
    st.tuples(st.integers(1, 20), st.sampled_from(["ok", "ok", "ok", "raise", "abort"])),
    min_size=1,
    max_size=40,
)


@attrs.define
class Checked:
    """Wraps a policy; checks the ledger invariants whenever a decision is asked for."""

    inner: SubmissionPolicy
    scheduler_of: Callable[[], CreditScheduler | None] = lambda: None
    seen: CreditScheduler | None = None
    decisions: int = 0

    @property
    def counts_samples(self) -> bool:
        return self.inner.counts_samples

    def admits(self, view: CreditView) -> bool:
        self.decisions += 1
        self.seen = self.scheduler_of()
        assert self.seen is not None
        ledger = self.seen.ledger
        assert self.seen.queued == 0  # every queued event was drained before deciding
        ledger.check()  # c == sum of unfinished samples over pending groups
        assert view.in_flight == ledger.in_flight
        if view.pending_groups == 0:
            assert view.in_flight == 0
        decision = self.inner.admits(view)
        if GroupGranularity().admits(view):
            assert SampleBackfill().admits(view)
        return decision


def scripted(plan: list[tuple[int, str]], log: dict[str, int]):  # type: ignore[no-untyped-def]
    async def generate(sample: Sample) -> None:
        delay, what = plan[sample.index % len(plan)]
        log["started"] += 1
        try:
            await trio.sleep(delay)
        except trio.Cancelled:
            log["cancelled"] += 1
            raise
        log["ended"] += 1
        if what == "raise":
            raise RuntimeError(f"sample {sample.index}")
        sample.policy_versions.append(0)
        sample.status = SampleStatus.ABORTED if what == "abort" else SampleStatus.COMPLETED

    return generate


@settings(deadline=None)
@given(
    plan=outcomes,
    g=st.integers(1, 4),
    t=st.integers(1, 4),
    n_prompts=st.integers(1, 12),
    backfill=st.booleans(),
    per_admission=st.integers(1, 3),
    partial=st.booleans(),
    _rnd=st.random_module(),
)
def test_sync_driver_invariants(
    plan: list[tuple[int, str]],
    g: int,
    t: int,
    n_prompts: int,
    backfill: bool,
    per_admission: int,
    partial: bool,
    _rnd: object,  # noqa: PT019 (hypothesis argument, not a fixture)
) -> None:
    log = {"started": 0, "cancelled": 0, "ended": 0}
    policy = Checked(SampleBackfill() if backfill else GroupGranularity())
    src = InMemorySource(prompts(n_prompts))
    driver = SyncRolloutDriver(
        src,
        GroupFactory(group_size=g),
        GroupRunner(scripted(plan, log)),
        policy=policy,
        groups_per_admission=per_admission,
        partial_rollouts=partial,
    )
    policy.scheduler_of = lambda: driver.scheduler

    async def main() -> None:
        try:
            batch = await driver.generate(t, allow_partial=True)
        except SourceExhaustedError:
            return
        groups = batch.groups
        assert 1 <= len(groups) <= t
        if batch.complete:
            assert len(groups) == t
        assert [x.first_index for x in groups] == sorted(x.first_index for x in groups)
        assert all(x.size == g for x in groups)
        assert all(
            s.status.is_finished or s.status is SampleStatus.ABORTED
            for x in groups
            for s in x.samples
        )
        stats = batch.statistics
        # every group of the call is accounted for exactly once (kept ones included)
        assert (
            stats.submitted + stats.carried_in
            == stats.accepted
            + stats.failed
            + stats.surplus
            + stats.cancelled
            + stats.partial
            + sum(stats.filtered.values())
        )
        if not partial:
            assert stats.partial == 0
            assert not driver.held_groups()
        if not partial:
            assert stats.recycled == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # every started sample ended or was cancelled: nothing keeps running
    assert log["started"] == log["ended"] + log["cancelled"]
    # every sample task returned exactly one credit, through its own SampleDone
    assert policy.seen is not None
    assert policy.seen.statistics().sample_events == log["started"]
    assert policy.seen.ledger.in_flight == 0


@settings(deadline=None)
@given(
    plan=outcomes,
    g=st.integers(1, 3),
    t=st.integers(1, 3),
    budget=st.integers(1, 4),
    capacity=st.integers(1, 4),
    backfill=st.booleans(),
    steps=st.lists(st.sampled_from(["take", "pause", "version", "wait"]), max_size=8),
    _rnd=st.random_module(),
)
def test_async_driver_invariants(
    plan: list[tuple[int, str]],
    g: int,
    t: int,
    budget: int,
    capacity: int,
    backfill: bool,
    steps: list[str],
    _rnd: object,  # noqa: PT019 (hypothesis argument, not a fixture)
) -> None:
    log = {"started": 0, "cancelled": 0, "ended": 0}
    policy = Checked(SampleBackfill() if backfill else GroupGranularity())

    async def main() -> None:
        async with open_async_rollout(
            InMemorySource(prompts(6), epochs=None),
            GroupFactory(group_size=g),
            GroupRunner(scripted(plan, log)),
            batch_size=t,
            policy=policy,
            max_groups_in_flight=budget,
            buffer_capacity=capacity,
            max_staleness=2,
        ) as driver:
            policy.scheduler_of = lambda: driver.scheduler
            policy.seen = driver.scheduler  # also when no admission happens before the close
            version = 0
            for step in steps:
                with trio.move_on_after(200):
                    if step == "take":
                        try:
                            batch = await driver.next_batch()
                        except DriverFailedError as exc:
                            # only a run that keeps failing ends, via the failure budget
                            cause = exc.__cause__
                            budget_ran_out = isinstance(cause, FailureBudgetExceededError) and (
                                isinstance(cause.__cause__, GroupFailedError)
                            )
                            assert budget_ran_out, exc  # noqa: PT017
                            return
                        assert len(batch) == t
                        assert [x.first_index for x in batch] == sorted(
                            x.first_index for x in batch
                        )
                        assert all(x.staleness(version) <= 2 for x in batch)
                    elif step == "pause":
                        async with driver.paused():
                            await trio.testing.wait_all_tasks_blocked()
                            submitted = driver.statistics().submitted
                            await trio.sleep(50)
                            assert driver.statistics().submitted == submitted
                    elif step == "version":
                        version += 1
                        driver.set_policy_version(version)
                    else:
                        await trio.sleep(30)
                stats = driver.statistics()
                assert stats.buffered <= capacity
                # hard cap on credits (one group per admission); a group whose samples all
                # returned credit may still be pending until its GroupDone is applied
                assert stats.in_flight_samples <= budget * g
                if not backfill:
                    assert stats.in_flight_groups <= budget
                driver.scheduler.ledger.check()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert log["started"] == log["ended"] + log["cancelled"]
    assert policy.seen is not None
    assert policy.seen.statistics().sample_events == log["started"]
    assert policy.seen.ledger.in_flight == 0
    assert policy.seen.ledger.pending_groups == 0
