"""The pause between two attempts of an HTTP request: exponential, with jitter.

Without jitter every client that saw a server fail retries it at the same instants (0.25 s,
0.5 s, ... after the failure), so a restarted server is hit by the whole fleet at once, again
and again. "Equal jitter": the pause is drawn uniformly between half and all of the
exponential delay, so retries spread out while each client still backs off.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["retry_delay"]


def retry_delay(
    attempt: int,
    base: float,
    cap: float = float("inf"),
    draw: Callable[[], float] = random.random,
) -> float:
    """Seconds to sleep before attempt number ``attempt`` (1 for the first retry): uniform in
    ``[d/2, d]`` with ``d = min(cap, base * 2 ** (attempt - 1))``. ``draw`` gives a number in
    ``[0, 1)`` (the process's ``random.random`` by default: a seeded run's samples are not
    drawn from it)."""
    delay = min(cap, base * 2.0 ** (attempt - 1))
    return delay * (0.5 + 0.5 * draw())
