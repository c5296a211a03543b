"""The wait every receiver shares: a deadline that fails loudly and a warning every 10 s with
the time left (a wait the user cannot see is a hang to them)."""

from __future__ import annotations

import logging
import math

import trio

from ..errors import InvalidArgumentError
from ._errors import TransportTimeoutError

logger = logging.getLogger("trio_rl.transport")

#: Seconds between log lines while a receive waits (patched by tests).
WAIT_LOG_INTERVAL = 10.0


class Wait:
    """One receive's wait for ``what``: `remaining` logs every `WAIT_LOG_INTERVAL` seconds,
    with the time left (at WARNING; at INFO for a wait without a deadline, as a trainer's wait
    for rollouts slower than its steps: normal, and not to be shouted every 10 s), and
    raises `TransportTimeoutError` once ``timeout`` seconds (``inf``: never) have passed."""

    __slots__ = ("_deadline", "_next_log", "_start", "timeout", "what")

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self._start = trio.current_time()
        self._deadline = self._start + timeout
        self._next_log = self._start + WAIT_LOG_INTERVAL

    def remaining(self) -> float:
        """Seconds left before the deadline (> 0), after logging if `WAIT_LOG_INTERVAL` seconds
        have passed since the last line."""
        now = trio.current_time()
        if now >= self._next_log:
            left = self._deadline - now
            logger.log(
                logging.INFO if math.isinf(left) else logging.WARNING,
                "%s: still waiting after %.0f s, giving up %s",
                self.what,
                now - self._start,
                "never" if math.isinf(left) else f"in {max(left, 0.0):.0f} s",
            )
            self._next_log = now + WAIT_LOG_INTERVAL
        left = self._deadline - now
        if left <= 0:
            raise TransportTimeoutError(f"{self.what} after waiting {self.timeout:g} s")
        return left

    def until_next_event(self) -> float:
        """Seconds to the next log line or the deadline, whichever is first (> 0)."""
        return min(self.remaining(), max(self._next_log - trio.current_time(), 0.0))


def timeout_seconds(timeout: float | None) -> float:
    """``None`` (wait until cancelled) as ``inf``; a negative or NaN timeout is an
    `~trio_rl.errors.InvalidArgumentError`."""
    if timeout is None:
        return math.inf
    if not timeout >= 0:
        raise InvalidArgumentError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return float(timeout)
