"""How the harness reports a broken invariant, and the step log it reports with."""

from __future__ import annotations

import trio

from ._errors import Invariant, InvariantViolationError

__all__ = ["Trace", "live_tasks", "unwrap_single"]


class Trace:
    """The numbered log of what the harness did; attached to every violation."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def log(self, step: str) -> None:
        self.steps.append(f"t={trio.current_time():g} {step}")

    def check(self, ok: bool, invariant: Invariant, detail: str) -> None:
        """Raise :class:`InvariantViolationError` unless ``ok``."""
        if not ok:
            raise self.fail(invariant, detail)

    def fail(self, invariant: Invariant, detail: str) -> InvariantViolationError:
        return InvariantViolationError(
            invariant, detail, self.steps, description=invariant.description
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
