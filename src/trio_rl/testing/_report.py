"""How the harness reports a broken invariant, and the step log it reports with."""

from __future__ import annotations

import enum

import trio

from ._errors import InvariantViolation

__all__ = ["Invariant", "InvariantViolation", "Trace", "live_tasks", "unwrap_single"]


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
}


class Trace:
    """The numbered log of what the harness did; attached to every violation."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def log(self, step: str) -> None:
        self.steps.append(f"t={trio.current_time():g} {step}")

    def check(self, ok: bool, invariant: Invariant, detail: str) -> None:
        """Raise :class:`InvariantViolation` unless ``ok``."""
        if not ok:
            raise self.fail(invariant, detail)

    def fail(self, invariant: Invariant, detail: str) -> InvariantViolation:
        return InvariantViolation(invariant, detail, self.steps, description=invariant.description)


def live_tasks() -> set[trio.lowlevel.Task]:
    """Every task currently alive in this trio run (walked from the root task)."""
    found: set[trio.lowlevel.Task] = set()
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None or task in found:
            continue
        found.add(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return found


def unwrap_single(exc: BaseException) -> BaseException:
    """The lone leaf of nested single-exception groups, or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
