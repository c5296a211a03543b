"""The stateful machines pass the library and catch the planted bugs.

The bugs are those of test_testing_catches_bugs.py (credit loop) and
test_testing_catches_async_bugs.py (fully-async driver); each is caught with the same
invariant, and Hypothesis shrinks the rule sequence to a short one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import settings
from test_testing_catches_async_bugs import ASYNC_BUGS
from test_testing_catches_bugs import (
    HUNT,
    DoubleReturnRunner,
    EagerRunner,
    LateArmScheduler,
    LeakyRunner,
    OffByOneBackfill,
    SecondFailureBookedTwiceRunner,
)

from conftest import scaled
from trio_rl.rollout import engine_generate
from trio_rl.testing import (
    Invariant,
    InvariantViolationError,
    RolloutSubject,
    async_driver_test,
    credit_protocol_machine,
    credit_protocol_test,
    sync_driver_test,
)
from trio_rl.testing._machine import _Run

# The bug hunts' settings, with schedules of up to 16 rules.
MACHINE_HUNT = settings(HUNT, stateful_step_count=16)

test_library_credit_protocol = credit_protocol_test(RolloutSubject(max_steps=scaled(16)))

# The machine's own TestCase, as a user would run it.
TestLibraryCreditProtocol = credit_protocol_machine(RolloutSubject()).TestCase
TestLibraryCreditProtocol.settings = settings(max_examples=20, stateful_step_count=10)


@pytest.mark.parametrize(
    ("subject", "invariant", "detail", "most_steps"),
    [
        (RolloutSubject(runner=LeakyRunner), Invariant.ONE_CREDIT_PER_SAMPLE, "returned 0", 8),
        (
            RolloutSubject(runner=DoubleReturnRunner),
            Invariant.ONE_CREDIT_PER_SAMPLE,
            "returned 2",
            8,
        ),
        (RolloutSubject(scheduler=LateArmScheduler), Invariant.NO_LOST_WAKEUP, "asleep", 10),
        (RolloutSubject(runner=EagerRunner), Invariant.OUTCOME_AFTER_SAMPLES_SETTLE, "", 8),
        (
            RolloutSubject(policy=OffByOneBackfill),
            Invariant.ADMISSION_FOLLOWS_RULE,
            "says False",
            8,
        ),
        (RolloutSubject(generate=engine_generate), Invariant.NO_DEADLOCK, "deadlock", 8),
        (
            RolloutSubject(runner=SecondFailureBookedTwiceRunner),
            Invariant.ONE_CREDIT_PER_SAMPLE,
            "returned 2",
            8,
        ),
    ],
    ids=[
        "leaky",
        "double-return",
        "lost-wakeup",
        "eager",
        "over-admission",
        "deadlock",
        "fail-together",
    ],
)
def test_machine_catches_planted_bug(
    subject: RolloutSubject, invariant: Invariant, detail: str, most_steps: int
) -> None:
    with pytest.raises(InvariantViolationError) as info:
        credit_protocol_test(subject, settings_=MACHINE_HUNT)()
    error = info.value
    assert error.invariant is invariant, str(error)
    assert detail in error.detail, str(error)
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "state = CreditProtocol()" in notes, notes  # Hypothesis printed the shrunk rules
    assert len(error.steps) <= most_steps, str(error)


test_library_async_driver = async_driver_test(RolloutSubject(max_steps=scaled(16)))
test_library_sync_driver = sync_driver_test(RolloutSubject(max_steps=scaled(16)))


def test_sync_machine_catches_credit_not_returned() -> None:
    with pytest.raises(InvariantViolationError) as info:
        sync_driver_test(RolloutSubject(runner=LeakyRunner), settings_=MACHINE_HUNT)()
    error = info.value
    assert error.invariant is Invariant.ONE_CREDIT_PER_SAMPLE, str(error)
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "state = SyncDriver()" in notes, notes
    assert len(error.steps) <= 10, str(error)


def _hunt_async() -> InvariantViolationError:
    with pytest.raises(InvariantViolationError) as info:
        async_driver_test(RolloutSubject(), settings_=MACHINE_HUNT)()
    error = info.value
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "state = AsyncDriver()" in notes, notes
    return error


@pytest.mark.parametrize(("plant", "detail"), ASYNC_BUGS)
def test_async_machine_catches_a_planted_bug(
    monkeypatch: pytest.MonkeyPatch, plant: Callable[[pytest.MonkeyPatch], None], detail: str
) -> None:
    plant(monkeypatch)
    error = _hunt_async()
    assert error.invariant is Invariant.ASYNC_BOUNDED_PAUSED_CLOSED, str(error)
    assert detail in error.detail
    assert len(error.steps) <= 12, str(error)


def test_a_background_task_failing_in_the_examples_run_is_raised_when_the_run_closes() -> None:
    run = _Run(trio.testing.MockClock())

    async def fail() -> None:
        raise ValueError("a background task failed")

    async def start() -> None:
        run.start_soon(fail)

    run.call(start)
    with pytest.raises(RuntimeError, match="trio run failed") as info:
        run.close()
    cause = info.value.__cause__
    # the run's nursery raised it, in a group (trio's strict exception groups)
    assert isinstance(cause, BaseExceptionGroup), cause
    assert cause.subgroup(ValueError) is not None, cause
