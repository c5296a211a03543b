"""The stateful credit-protocol machine passes the library and catches the planted bugs.

The bugs are the credit-loop ones of test_testing_catches_bugs.py; each is caught with the
same invariant, and Hypothesis shrinks the rule sequence to a short one.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from test_testing_catches_bugs import (
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
    InvariantViolation,
    RolloutSubject,
    credit_protocol_machine,
    credit_protocol_test,
)

HUNT = settings(
    max_examples=500,
    database=None,
    report_multiple_bugs=False,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    stateful_step_count=16,
)

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
    with pytest.raises(InvariantViolation) as info:
        credit_protocol_test(subject, settings_=HUNT)()
    error = info.value
    assert error.invariant is invariant, str(error)
    assert detail in error.detail, str(error)
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "state = CreditProtocol()" in notes, notes  # Hypothesis printed the shrunk rules
    assert len(error.steps) <= most_steps, str(error)
