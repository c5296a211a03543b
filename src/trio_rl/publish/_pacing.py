"""Yield points that hand the GIL to the event loop from CPU-bound worker code."""

from __future__ import annotations

from time import perf_counter, sleep

import attrs

__all__ = ["Pacer"]


@attrs.define(eq=False)
class Pacer:
    """A yield point for CPU-bound worker code: call it often (per sample, per micro-batch);
    at most every ``interval`` seconds it hands the GIL to whichever thread waits for it.

    A thread running Python code keeps the GIL until the interpreter's switch interval (5 ms by
    default) forces a hand-off, and the event loop gives the GIL up at every ``epoll`` wait, so
    a busy worker delays every wake-up of the loop by up to one switch interval. ``time.sleep(0)``
    releases the GIL, and the waiting loop thread takes it at once: the loop's lag during a
    worker's CPU phase drops from about the switch interval to about ``interval`` plus the
    longest C call in between (measured in docs/bench/publish.md). Harmless on the loop thread.
    """

    interval: float = 0.0005
    _due: float = attrs.field(factory=perf_counter, init=False)

    def __call__(self) -> None:
        now = perf_counter()
        if now >= self._due:
            sleep(0)  # releases the GIL: a thread waiting for it runs now
            self._due = perf_counter() + self.interval
