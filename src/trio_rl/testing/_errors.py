"""The harness's exceptions: :class:`InvariantViolationError` and the :class:`Invariant` it
names, defined here rather than in :mod:`trio_rl.errors`, which imports nothing of ours."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from ..errors import ScriptedEngineError as ScriptedEngineError
from ..errors import TrioRLError

__all__ = [
    "Invariant",
    "InvariantViolationError",
    "ScriptedEngineError",
]


class Invariant(enum.Enum):
    """The invariants the harness checks (docs/testing.md, "What is checked").

    A violation names its member (``error.invariant is Invariant.NO_LOST_WAKEUP``); the member
    prints as its name and :attr:`description` states it.
    """

    ONE_CREDIT_PER_SAMPLE = 1
    OUTCOME_AFTER_SAMPLES_SETTLE = 2
    CREDITS_MATCH_PENDING_SAMPLES = 3
    ADMISSION_FOLLOWS_RULE = 4
    NO_LOST_WAKEUP = 5
    NO_DEADLOCK = 6
    SYNC_BATCH_SHAPE = 7
    ASYNC_BOUNDED_PAUSED_CLOSED = 8
    EPISODE_ENDS_ONCE = 9

    @property
    def description(self) -> str:
        """What the invariant states."""
        return _DESCRIPTIONS[self]

    def __str__(self) -> str:
        return self.name


_DESCRIPTIONS: dict[Invariant, str] = {
    Invariant.ONE_CREDIT_PER_SAMPLE: "every sample task returns exactly one credit",
    Invariant.OUTCOME_AFTER_SAMPLES_SETTLE: (
        "a group's outcome is visible only after all its samples settled and returned credit"
    ),
    Invariant.CREDITS_MATCH_PENDING_SAMPLES: (
        "credits in flight equal the unfinished samples of pending groups"
    ),
    Invariant.ADMISSION_FOLLOWS_RULE: "admission follows the policy's rule",
    Invariant.NO_LOST_WAKEUP: (
        "no lost wake-up: the driver never sleeps while it may admit and prompts remain"
    ),
    Invariant.NO_DEADLOCK: "no deadlock: the run ends within its virtual time bound",
    Invariant.SYNC_BATCH_SHAPE: "sync driver: exactly T groups of G samples, sorted by first index",
    Invariant.ASYNC_BOUNDED_PAUSED_CLOSED: (
        "fully-async: bounded buffer, no submission while paused, nothing left running on close"
    ),
    Invariant.EPISODE_ENDS_ONCE: (
        "every episode that ended has one stop reason, and no tool call outlives its episode"
    ),
}


class InvariantViolationError(TrioRLError, AssertionError):
    """A credit invariant checked by :mod:`trio_rl.testing` did not hold.

    ``invariant`` is its :class:`~trio_rl.testing.Invariant` member, ``description`` what it
    states, ``steps`` the schedule (one line per harness step) that led here; after Hypothesis
    shrinks a failure, ``steps`` is the shrunk schedule.
    """

    def __init__(
        self,
        invariant: Invariant,
        detail: str,
        steps: Sequence[str] = (),
        *,
        description: str = "?",
    ) -> None:
        self.invariant = invariant
        self.detail = detail
        self.description = description
        self.steps = list(steps)
        schedule = "\n".join(f"  {i:3d}. {s}" for i, s in enumerate(self.steps, 1))
        super().__init__(
            f"invariant {invariant} ({description}) violated: {detail}\n"
            f"schedule ({len(self.steps)} steps):\n{schedule}"
        )
