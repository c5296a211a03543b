"""How the harness reports a broken invariant, and the step log it reports with."""

from __future__ import annotations

import trio

from ._errors import InvariantViolation

__all__ = ["InvariantViolation", "Trace", "live_tasks", "unwrap_single"]

#: Short names of the credit invariants (docs/testing.md, "What is checked"), used in messages.
INVARIANTS: dict[int, str] = {
    1: "every sample task returns exactly one credit",
    2: "a group's outcome is visible only after all its samples settled and returned credit",
    3: "credits in flight equal the unfinished samples of pending groups",
    4: "admission follows the policy's rule",
    5: "no lost wake-up: the driver never sleeps while it may admit and prompts remain",
    6: "no deadlock: the run ends within its virtual time bound",
    7: "sync driver: exactly T groups of G samples, sorted by first index",
    8: "fully-async: bounded buffer, no submission while paused, nothing left running on close",
}


class Trace:
    """The numbered log of what the harness did; attached to every violation."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def log(self, step: str) -> None:
        self.steps.append(f"t={trio.current_time():g} {step}")

    def check(self, ok: bool, invariant: int, detail: str) -> None:
        """Raise :class:`InvariantViolation` unless ``ok``."""
        if not ok:
            raise self.fail(invariant, detail)

    def fail(self, invariant: int, detail: str) -> InvariantViolation:
        return InvariantViolation(
            invariant, detail, self.steps, description=INVARIANTS.get(invariant, "?")
        )


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
