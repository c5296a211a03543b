"""The policy-version cell: the one place the current policy (weights) version lives.

This module sits on the ground floor next to :mod:`trio_rl.samples`, so the rollout driver, the
engines, the ship gate, the orchestrator and :mod:`trio_rl.learn`'s weight watcher can all share
one cell. Whoever opens the pipeline (the orchestrator) creates it and hands the same object to
every reader; only the trainer's report (:meth:`Orchestrator.set_policy_version`, or
:meth:`PolicyVersionCell.advance`) moves it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio_util

from .errors import PolicyVersionError
from .samples import PolicyVersion

__all__ = ["PolicyVersionCell", "PolicyVersionError", "as_cell"]


class PolicyVersionCell:
    """A policy version that only grows, observable by any number of tasks.

    Built on :class:`trio_util.AsyncValue`: :meth:`wait_at_least` parks a task until the
    version reaches a floor (the ship gate), and listeners only ever see it grow. All methods
    run on the event loop; :meth:`advance` never blocks.
    """

    __slots__ = ("_hooks", "_value")

    def __init__(self, version: PolicyVersion = 0) -> None:
        if version < 0:
            raise PolicyVersionError(f"policy version must be >= 0, got {version}")
        self._value: trio_util.AsyncValue[int] = trio_util.AsyncValue(version)
        self._hooks: list[Callable[[PolicyVersion, PolicyVersion], None]] = []

    @property
    def value(self) -> PolicyVersion:
        """The current version."""
        return int(self._value.value)

    def __repr__(self) -> str:
        return f"PolicyVersionCell({self.value})"

    def on_advance(self, hook: Callable[[PolicyVersion, PolicyVersion], None]) -> None:
        """Call ``hook(old, new)`` on the loop, in registration order, whenever the version
        grows (before any waiter wakes). A hook must not block; what it raises reaches the
        caller of :meth:`advance`, with the cell unchanged."""
        self._hooks.append(hook)

    def check(self, version: PolicyVersion) -> None:
        """Raise :class:`PolicyVersionError` if ``version`` is below the current one: the one
        "versions never go back" rule (e.g. checked before loading weights as ``version``)."""
        old = self.value
        if version < old:
            raise PolicyVersionError(
                f"policy version must not decrease: current {old}, got {version} "
                f"(it cannot go back from {old} to {version})"
            )

    def advance(self, version: PolicyVersion) -> bool:
        """Move to ``version``; True when it grew. The same version is a no-op; a smaller one
        raises :class:`PolicyVersionError` naming both, and the cell is left unchanged."""
        self.check(version)
        old = self.value
        if version == old:
            return False
        for hook in self._hooks:
            hook(old, version)
        self._value.value = version
        return True

    async def wait_at_least(self, floor: PolicyVersion) -> PolicyVersion:
        """Wait until the version is at least ``floor`` and return it; returns at once (no
        checkpoint) when it already is. On cancellation nothing changes."""
        if self.value >= floor:
            return self.value
        await self._value.wait_value(lambda v: v >= floor)
        return self.value


def as_cell(version: PolicyVersion | PolicyVersionCell) -> PolicyVersionCell:
    """The cell itself, or a new cell holding a plain starting version."""
    return version if isinstance(version, PolicyVersionCell) else PolicyVersionCell(version)
