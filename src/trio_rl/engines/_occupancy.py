"""The slot occupancy of an engine that counts its busy slots, over each interval between two
readings (what both commands' ``metrics.jsonl`` records show as ``slot_occupancy``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

__all__ = ["CountsSlots", "SlotOccupancy", "SlotStatistics"]


class SlotStatistics(Protocol):
    """What an engine that counts its slots reports: its slots, the seconds since it started
    counting, and the slot-seconds its requests held."""

    @property
    def slots(self) -> int: ...
    @property
    def elapsed(self) -> float: ...
    @property
    def busy_slot_seconds(self) -> float: ...


@runtime_checkable
class CountsSlots(Protocol):
    """An engine with slot counters (:class:`SimulatedEngine`, :class:`TorchEngine`)."""

    def statistics(self) -> SlotStatistics: ...


@attrs.define(eq=False)
class SlotOccupancy:
    """Busy slot-seconds over slot-seconds since the previous `read` (None for an engine
    without slot counters, such as a fleet, whose servers report their own)."""

    engine: object
    _last: tuple[float, float] = (0.0, 0.0)

    def read(self) -> float | None:
        if not isinstance(self.engine, CountsSlots):
            return None
        stats = self.engine.statistics()
        # the protocol check sees only a statistics() method: a fleet's returns a dict of counts
        if not all(hasattr(stats, a) for a in ("slots", "elapsed", "busy_slot_seconds")):
            return None
        span = stats.elapsed - self._last[0]
        busy = stats.busy_slot_seconds - self._last[1]
        self._last = (stats.elapsed, stats.busy_slot_seconds)
        if span > 0 and stats.slots > 0:
            return round(min(1.0, busy / (stats.slots * span)), 4)
        return None
