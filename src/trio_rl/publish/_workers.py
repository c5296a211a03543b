"""The publisher's worker threads: one shared limiter, and how busy it got."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from ._metrics import ThreadStats

T = TypeVar("T")


@attrs.define(eq=False)
class Workers:
    """Runs blocking jobs in worker threads on the pipeline's one `trio.CapacityLimiter` and
    remembers the most tokens borrowed at the start of a job since the last `stats` call."""

    limiter: trio.CapacityLimiter
    _busy: int = attrs.field(default=0, init=False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread. Cancellation: as `trio.to_thread.run_sync` (never
        abandoned: a job that started finishes, and `trio.Cancelled` comes at the next
        checkpoint; one still waiting for a token raises it having done nothing)."""
        return await trio.to_thread.run_sync(self._job, fn, *args, limiter=self.limiter)

    def _job(self, fn: Callable[..., T], *args: Any) -> T:
        # Holding its token: how many threads are busy now, this one included (a racy read of
        # a length, which is all a gauge needs).
        self._busy = max(self._busy, self.limiter.borrowed_tokens)
        return fn(*args)

    def stats(self) -> ThreadStats:
        """The limiter's size and the busiest moment since the last call (read and reset)."""
        busy, self._busy = self._busy, 0
        return ThreadStats(limit=int(self.limiter.total_tokens), busy_max=busy)
