"""The slot occupancy of an engine: None for one whose statistics carry no slot counters."""

from __future__ import annotations

from trio_rl.engines import EngineFleet
from trio_rl.engines._occupancy import SlotOccupancy


def test_a_fleet_has_no_slot_occupancy_though_it_has_statistics() -> None:
    fleet = EngineFleet(("http://127.0.0.1:1",))
    assert isinstance(fleet.statistics(), dict)
    assert SlotOccupancy(fleet).read() is None
