"""Summary statistics of a list of numbers (count, mean, min, max, p10, p50, p90), computed
in a worker thread without holding the GIL for one long sort."""

from __future__ import annotations

import array
import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

import attrs
import numpy as np
import numpy.typing as npt

from ._pacing import Pacer

__all__ = ["Distribution"]


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``ordered`` non-empty."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


def _paced(parts: Sequence[Sequence[float]]) -> Iterator[Sequence[float]]:
    """``parts``, yielding the GIL (`Pacer`) between them: one C call such as ``math.fsum``
    over millions of values then lets the event loop in on the way."""
    pace = Pacer()
    for part in parts:
        pace()
        yield part


def _percentile_of(ordered: npt.NDArray[np.float64], q: float) -> float:
    """`_percentile` over a sorted float64 array (Python floats: the same arithmetic)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    lo, hi = float(ordered[low]), float(ordered[high])
    return float(lo + (hi - lo) * (position - low))


@attrs.frozen
class Distribution:
    """Summary of a list of numbers. All statistics are ``None`` when ``count == 0``."""

    count: int
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(map(float, values))  # map: no Python frame per value
        if not ordered:
            return cls(count=0)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            min=ordered[0],
            max=ordered[-1],
            p10=_percentile(ordered, 0.1),
            p50=_percentile(ordered, 0.5),
            p90=_percentile(ordered, 0.9),
        )

    @classmethod
    def of_parts(cls, parts: Sequence[Sequence[float]]) -> Distribution:
        """`of` over the concatenation of ``parts`` (the same figures), without one
        GIL-holding sort of every value: the values are copied part by part into an array of
        doubles, which numpy sorts in place with the GIL released (millions of per-token
        values would otherwise stall the event loop for tens of milliseconds in one C call)."""
        count = sum(map(len, parts))
        if count == 0:
            return cls(count=0)
        # The doubles are gathered in an `array.array` (plain malloc'd memory that grows 4 KiB
        # page by page), not an `np.empty(count)`: numpy asks for transparent huge pages on
        # big allocations, and the first touch of each 2 MiB page, zeroed while this thread
        # holds the GIL, took up to 5 ms on the shared VM (about a dozen such pauses per
        # 166 MiB step, the loop waiting out each); the view shares the array's memory.
        values = array.array("d")
        pace = Pacer()
        for part in parts:
            pace()
            values.extend(part)
        ordered = np.frombuffer(values, dtype=np.float64)
        ordered.sort()
        return cls(
            count=count,
            mean=math.fsum(chain.from_iterable(_paced(parts))) / count,
            min=float(ordered[0]),
            max=float(ordered[-1]),
            p10=_percentile_of(ordered, 0.1),
            p50=_percentile_of(ordered, 0.5),
            p90=_percentile_of(ordered, 0.9),
        )

    def items(self, prefix: str) -> Iterable[tuple[str, float]]:
        """Flat ``(key, value)`` pairs; an empty distribution yields no keys."""
        if self.count == 0:
            return
        yield f"{prefix}/count", float(self.count)
        for name in ("mean", "min", "max", "p10", "p50", "p90"):
            value = getattr(self, name)
            if value is not None:
                yield f"{prefix}/{name}", value
