"""The fully-async property catches a driver that ignores pauses or its buffer's capacity.

The broken drivers are the real one with one behaviour switched off (pytest's monkeypatch).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import Phase, settings

from trio_rl.rollout import AsyncRolloutDriver
from trio_rl.testing import Invariant, InvariantViolation, RolloutSubject, async_driver_property

HUNT = settings(
    max_examples=500,
    database=None,
    report_multiple_bugs=False,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
)


def _hunt() -> InvariantViolation:
    prop = async_driver_property(RolloutSubject(), settings_=HUNT)
    with pytest.raises(InvariantViolation) as info:
        prop()
    return info.value


def test_catches_submission_while_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.asynccontextmanager
    async def ignore_pause(self: AsyncRolloutDriver) -> AsyncIterator[None]:
        yield  # BUG: the worker is never told

    monkeypatch.setattr(AsyncRolloutDriver, "paused", ignore_pause)
    error = _hunt()
    assert error.invariant is Invariant.ASYNC_BOUNDED_PAUSED_CLOSED
    assert "submitted while paused" in error.detail
    assert len(error.steps) <= 12, str(error)


def test_catches_buffer_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    original = AsyncRolloutDriver.__init__

    def unbounded(self: AsyncRolloutDriver, *args: Any, **kwargs: Any) -> None:
        kwargs["buffer_capacity"] = 1_000_000  # BUG: backpressure never applies
        original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncRolloutDriver, "__init__", unbounded)
    error = _hunt()
    assert error.invariant is Invariant.ASYNC_BOUNDED_PAUSED_CLOSED
    assert "buffer holds" in error.detail
    assert len(error.steps) <= 12, str(error)
