"""Waiting for a server to come up: retried with backoff, never in silence.

A server that is not there yet is the commonest first mistake with a fleet (a wrong port, a
server still loading its model). The wait says so at once, with why the last attempt failed
(``connection refused``, ``HTTP 503``), then again every ``every`` seconds with the time left,
and gives up at its deadline with the last reason; the attempts back off from ``first_poll`` to
``max_poll`` seconds so a server that takes minutes to load is not hammered.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import attrs
import httpx
import trio

from ._errors import EngineTimeoutError

__all__ = ["LOG_EVERY", "LogThrottle", "transport_reason", "wait_logged", "wait_until_up"]

logger = logging.getLogger("trio_rl.engines")

#: Seconds between two "still waiting" lines of one wait.
LOG_EVERY = 10.0


def _refused(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether a ``ConnectionRefusedError`` is among the causes of ``exc`` (httpx under trio
    wraps it in an exception group of connection attempts)."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, ConnectionRefusedError):
        return True
    if isinstance(exc, BaseExceptionGroup) and any(_refused(e, depth + 1) for e in exc.exceptions):
        return True
    return _refused(exc.__cause__ or exc.__context__, depth + 1)


def transport_reason(exc: BaseException) -> str:
    """A transport failure in a few words: ``connection refused`` for a port nothing listens
    on, else the exception's class and text."""
    if _refused(exc):
        return "connection refused"
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, httpx.TimeoutException):
        return f"{type(cause).__name__}: no answer"
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


def _left(deadline: float) -> str:
    left = deadline - trio.current_time()
    return "never" if math.isinf(left) else f"in {max(0.0, left):.0f} s"


async def wait_until_up(
    attempt: Callable[[], Awaitable[str | None]],
    what: str,
    within: float,
    *,
    first_poll: float = 0.25,
    max_poll: float = 2.0,
    every: float = LOG_EVERY,
    goal: str = "answer",
    gone: Callable[[], str | None] = lambda: None,
) -> None:
    """Call ``attempt`` (None: up; else why not, e.g. ``"connection refused"``) until it
    succeeds, backing off from ``first_poll`` to ``max_poll`` seconds between attempts.

    The first failed attempt is logged at WARNING at once (``waiting for WHAT (REASON), giving
    up in 590 s``), then one line every ``every`` seconds with the attempts so far and the time
    left. ``gone`` (None: keep waiting) ends the wait early, returning: the thing waited for
    can no longer come up (its process exited), which the caller reports. After ``within``
    seconds: :class:`EngineTimeoutError` (``WHAT did not GOAL within ...``) with the last
    reason. Cancellation: the
    wait ends (an attempt in progress is abandoned)."""
    start = trio.current_time()
    deadline = start + within
    poll = first_poll
    attempts = 0
    reason: str | None = None
    logged_at: float | None = None
    with trio.move_on_at(deadline):
        while True:
            reason = await attempt()
            attempts += 1
            if reason is None or gone() is not None:
                if reason is None and logged_at is not None:
                    logger.warning("%s is up after %.0f s", what, trio.current_time() - start)
                return
            now = trio.current_time()
            if logged_at is None or now - logged_at >= every:
                logger.warning(
                    "waiting for %s (%s, %d attempt%s), giving up %s",
                    what,
                    reason,
                    attempts,
                    "" if attempts == 1 else "s",
                    _left(deadline),
                )
                logged_at = now
            await trio.sleep(poll)
            poll = min(max_poll, poll * 2)
    raise EngineTimeoutError(
        f"{what} did not {goal} within {within}s ({attempts} attempts, the last: {reason})"
    )


@attrs.define(slots=True)
class LogThrottle:
    """At most one line per ``every`` seconds for waits that share it (many requests waiting
    for the same thing say so once, not once each)."""

    every: float = LOG_EVERY
    _last: float = attrs.field(init=False, default=-math.inf)

    def due(self) -> bool:
        now = trio.current_time()
        if now - self._last < self.every:
            return False
        self._last = now
        return True


async def wait_logged(
    wait: Callable[[], Awaitable[object]],
    what: str,
    within: float,
    *,
    throttle: LogThrottle | None = None,
) -> bool:
    """Run ``wait`` for at most ``within`` seconds, logging at WARNING every 10 s (or as
    ``throttle`` allows) that it still waits for ``what``, with the time left; True if ``wait``
    returned, False at the deadline. Cancellation: the wait ends."""
    start = trio.current_time()
    deadline = start + within
    throttle = LogThrottle() if throttle is None else throttle
    done = False

    async def tell() -> None:
        while True:
            await trio.sleep(throttle.every)
            if throttle.due():
                logger.warning(
                    "still waiting for %s after %.0f s, giving up %s",
                    what,
                    trio.current_time() - start,
                    _left(deadline),
                )

    with trio.move_on_at(deadline):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tell)
            await wait()
            done = True
            nursery.cancel_scope.cancel()
    return done
