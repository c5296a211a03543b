"""The harness catches real bugs, and reports them with a shrunk schedule.

Each test runs a property against a deliberately broken component and asserts that the
property fails with the right invariant, after shrinking to a short schedule.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable

import pytest
import trio
from hypothesis import Phase, settings
from hypothesis.database import InMemoryExampleDatabase

from trio_rl.rollout import (
    CreditScheduler,
    CreditView,
    GenerateFn,
    GroupFailedError,
    GroupOutcome,
    SampleBackfill,
    SubmissionPolicy,
    engine_generate,
)
from trio_rl.samples import Group, Sample, SampleStatus
from trio_rl.testing import (
    Invariant,
    InvariantViolationError,
    RolloutSubject,
    credit_loop_property,
    sync_driver_property,
)

# Enough examples to find each bug reliably (derandomized: the same examples every run).
HUNT = settings(
    max_examples=500,
    database=None,
    report_multiple_bugs=False,
    derandomize=True,
    # no "explain" phase: it re-runs examples under a tracer, which is slow
    phases=[Phase.generate, Phase.shrink],
)


class LeakyRunner:
    """Returns a sample's credit only when the sample was not cancelled (the bug)."""

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        failures: list[tuple[int | None, Exception]] = []

        async def one(sample: Sample, scope: trio.CancelScope) -> None:
            try:
                await self.generate(sample)
            except Exception as exc:
                failures.append((sample.index, exc))
                scope.cancel()
            # BUG: a cancelled sample skips this line, so its credit never comes back
            if on_sample_done is not None:
                on_sample_done(sample)

        async with trio.open_nursery() as nursery:
            for sample in group.samples:
                if sample.status is SampleStatus.PENDING:
                    nursery.start_soon(one, sample, nursery.cancel_scope)
        if failures:
            raise GroupFailedError(group, failures)
        return group


class DoubleReturnRunner(LeakyRunner):
    """Returns a failed sample's credit twice (the bug): once on failure, once after."""

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        failures: list[tuple[int | None, Exception]] = []

        async def one(sample: Sample, scope: trio.CancelScope) -> None:
            try:
                await self.generate(sample)
            except Exception as exc:
                failures.append((sample.index, exc))
                if on_sample_done is not None:
                    on_sample_done(sample)  # BUG: the finally below returns it again
                scope.cancel()
            finally:
                if on_sample_done is not None:
                    on_sample_done(sample)

        async with trio.open_nursery() as nursery:
            for sample in group.samples:
                if sample.status is SampleStatus.PENDING:
                    nursery.start_soon(one, sample, nursery.cancel_scope)
        if failures:
            raise GroupFailedError(group, failures)
        return group


class LateArmScheduler(CreditScheduler):
    """The reference's clearable-Event design with the wake-up armed after an await (the bug).

    Completions update the ledger directly and set an event; the driver waits on a fresh
    event, but creates it only after an await, so a completion that lands in between sets the
    old event and is lost.
    """

    def __init__(self, policy: SubmissionPolicy, group_size: int) -> None:
        super().__init__(policy, group_size)
        self._event = trio.Event()
        self._finished: list[GroupOutcome] = []

    def sample_done(self, group_id: str) -> None:
        self.ledger.sample_done(group_id)
        if self.policy.counts_samples:
            self._event.set()

    def group_done(self, outcome: GroupOutcome) -> None:
        self.ledger.close(outcome.group_id)
        self._finished.append(outcome)
        self._event.set()

    def nudge(self, reason: str = "") -> None:
        self._event.set()

    async def wait_for_progress(self) -> list[GroupOutcome]:
        if not self._finished:
            await trio.lowlevel.checkpoint()  # BUG: an await between deciding and arming
            self._event = trio.Event()
            await self._event.wait()
        finished, self._finished = self._finished, []
        return finished


class OneReportPerWakeScheduler(CreditScheduler):
    """The channel design without the drain (the bug): each wake-up applies the one report
    ``receive()`` returned and leaves the rest of the backlog queued, so the driver decides
    on a ledger that misses reports made before the decision."""

    async def wait_for_progress(self) -> list[GroupOutcome]:
        report = await self._receive.receive()  # BUG: no receive_nowait() until WouldBlock
        if isinstance(report, str):
            self.ledger.sample_done(report)
        elif isinstance(report, GroupOutcome):
            self.ledger.close(report.group_id)
            return [report]
        return []


def _hunt(prop: Callable[[], None]) -> InvariantViolationError:
    with pytest.raises(InvariantViolationError) as info:
        prop()
    return info.value


def _shrunk(error: InvariantViolationError, most_steps: int) -> None:
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "Falsifying example" in notes or "Failing test case" in notes, notes
    assert len(error.steps) <= most_steps, str(error)


def test_catches_credit_not_returned_on_cancellation() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(runner=LeakyRunner), settings_=HUNT))
    assert error.invariant is Invariant.ONE_CREDIT_PER_SAMPLE
    assert "returned 0 credits" in error.detail
    _shrunk(error, most_steps=6)


def test_catches_credit_not_returned_in_the_sync_driver() -> None:
    error = _hunt(sync_driver_property(RolloutSubject(runner=LeakyRunner), settings_=HUNT))
    assert error.invariant is Invariant.ONE_CREDIT_PER_SAMPLE
    _shrunk(error, most_steps=8)


def test_catches_a_credit_returned_twice() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(runner=DoubleReturnRunner), settings_=HUNT))
    assert error.invariant is Invariant.ONE_CREDIT_PER_SAMPLE
    assert "returned 2 credits" in error.detail
    _shrunk(error, most_steps=6)


def test_catches_a_lost_wakeup() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(scheduler=LateArmScheduler), settings_=HUNT))
    assert error.invariant is Invariant.NO_LOST_WAKEUP
    _shrunk(error, most_steps=10)


def test_catches_a_backlog_left_on_the_channel() -> None:
    error = _hunt(
        credit_loop_property(RolloutSubject(scheduler=OneReportPerWakeScheduler), settings_=HUNT)
    )
    assert error.invariant is Invariant.CREDITS_MATCH_PENDING_SAMPLES
    assert "not drained before deciding" in error.detail
    _shrunk(error, most_steps=8)


class EagerRunner(LeakyRunner):
    """Reports the group done as soon as its first sample finishes (the bug): the other
    samples keep generating in system tasks, outside the group's lifetime."""

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        first = trio.Event()

        async def one(sample: Sample) -> None:
            try:
                await self.generate(sample)
            except Exception:
                pass
            finally:
                if on_sample_done is not None:
                    on_sample_done(sample)
                first.set()

        pending = [s for s in group.samples if s.status is SampleStatus.PENDING]
        for sample in pending:
            trio.lowlevel.spawn_system_task(one, sample)
        if pending:
            await first.wait()
        return group


class OffByOneBackfill(SampleBackfill):
    """Sample backfill that admits one group too many (the bug)."""

    def admits(self, view: CreditView) -> bool:
        return view.in_flight <= view.budget * view.group_size


def test_catches_a_group_that_ends_before_its_samples() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(runner=EagerRunner), settings_=HUNT))
    assert error.invariant is Invariant.OUTCOME_AFTER_SAMPLES_SETTLE
    _shrunk(error, most_steps=6)


def test_catches_over_admission() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(policy=OffByOneBackfill), settings_=HUNT))
    assert error.invariant is Invariant.ADMISSION_FOLLOWS_RULE
    assert "the rule says False" in error.detail
    _shrunk(error, most_steps=4)


def test_catches_a_deadlock() -> None:
    """A generate function with no deadline lets a hanging engine call block the run."""
    error = _hunt(credit_loop_property(RolloutSubject(generate=engine_generate), settings_=HUNT))
    assert error.invariant is Invariant.NO_DEADLOCK
    assert "deadlock" in error.detail
    _shrunk(error, most_steps=6)


class SecondFailureBookedTwiceRunner(LeakyRunner):
    """Books a group's second failure twice (the bug): only when two samples fail in the same
    tick, before the first failure's cancellation reaches the second."""

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        failures: list[tuple[int | None, Exception]] = []

        async def one(sample: Sample, scope: trio.CancelScope) -> None:
            try:
                await self.generate(sample)
            except Exception as exc:
                failures.append((sample.index, exc))
                if len(failures) > 1 and on_sample_done is not None:
                    on_sample_done(sample)  # BUG: the finally below books it again
                scope.cancel()
            finally:
                if on_sample_done is not None:
                    on_sample_done(sample)

        async with trio.open_nursery() as nursery:
            for sample in group.samples:
                if sample.status is SampleStatus.PENDING:
                    nursery.start_soon(one, sample, nursery.cancel_scope)
        if failures:
            raise GroupFailedError(group, failures)
        return group


def test_catches_a_second_simultaneous_failure_booked_twice() -> None:
    subject = RolloutSubject(runner=SecondFailureBookedTwiceRunner)
    error = _hunt(credit_loop_property(subject, settings_=HUNT))
    assert error.invariant is Invariant.ONE_CREDIT_PER_SAMPLE
    assert "returned 2 credits" in error.detail
    assert "fail together" in str(error)
    _shrunk(error, most_steps=6)


def test_a_violation_names_its_invariant() -> None:
    error = _hunt(credit_loop_property(RolloutSubject(runner=LeakyRunner), settings_=HUNT))
    assert str(error).startswith(
        "invariant ONE_CREDIT_PER_SAMPLE (every sample task returns exactly one credit) violated"
    )
    assert error.invariant.description == "every sample task returns exactly one credit"


def test_saved_failures_replay_for_their_own_subject_only() -> None:
    """The example database is namespaced by subject: a failing example saved for one subject
    replays for it, and is not replayed for another subject on the same property."""
    db = InMemoryExampleDatabase()
    hunt = settings(HUNT, database=db)
    replay = settings(HUNT, database=db, phases=[Phase.reuse])
    leaky = RolloutSubject(runner=LeakyRunner)
    _hunt(credit_loop_property(leaky, settings_=hunt))
    assert db.data, "the failing example was not saved"
    _hunt(credit_loop_property(leaky, settings_=replay))  # replays and fails again
    other = RolloutSubject(runner=LeakyRunner, max_steps=15)
    with pytest.raises(unittest.SkipTest, match="no test cases"):  # nothing saved for it
        credit_loop_property(other, settings_=replay)()
