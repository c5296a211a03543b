"""The fully-async property catches a driver that ignores pauses or its buffer's capacity.

The broken drivers are the real one with one behaviour switched off (pytest's monkeypatch).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from test_testing_catches_bugs import HUNT

from trio_rl.rollout import AsyncRolloutDriver
from trio_rl.testing import (
    Invariant,
    InvariantViolationError,
    RolloutSubject,
    async_driver_property,
)


def plant_ignore_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """BUG: ``paused()`` never tells the worker, which goes on submitting."""

    @contextlib.asynccontextmanager
    async def ignore_pause(self: AsyncRolloutDriver) -> AsyncIterator[None]:
        yield

    monkeypatch.setattr(AsyncRolloutDriver, "paused", ignore_pause)


def plant_unbounded_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """BUG: the buffer's capacity is never reached, so backpressure never applies."""
    original = AsyncRolloutDriver.__init__

    def unbounded(self: AsyncRolloutDriver, *args: Any, **kwargs: Any) -> None:
        kwargs["buffer_capacity"] = 1_000_000
        original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncRolloutDriver, "__init__", unbounded)


#: The planted bugs of the fully-async driver and the detail that catching each must report
#: (under ASYNC_BOUNDED_PAUSED_CLOSED, within 12 steps); test_testing_machine.py plants them too.
ASYNC_BUGS = [
    pytest.param(plant_ignore_pause, "submitted while paused", id="ignore-pause"),
    pytest.param(plant_unbounded_buffer, "buffer holds", id="unbounded-buffer"),
]


def _hunt() -> InvariantViolationError:
    prop = async_driver_property(RolloutSubject(), settings_=HUNT)
    with pytest.raises(InvariantViolationError) as info:
        prop()
    return info.value


@pytest.mark.parametrize(("plant", "detail"), ASYNC_BUGS)
def test_catches_a_planted_async_driver_bug(
    monkeypatch: pytest.MonkeyPatch, plant: Callable[[pytest.MonkeyPatch], None], detail: str
) -> None:
    plant(monkeypatch)
    error = _hunt()
    assert error.invariant is Invariant.ASYNC_BOUNDED_PAUSED_CLOSED, str(error)
    assert detail in error.detail
    assert len(error.steps) <= 12, str(error)
