"""`EpisodeStats`: what a run's episodes did, counted (the metrics records' ``episodes/...``)."""

from __future__ import annotations

import attrs

from ._config import STOP_REASONS, StopReason

__all__ = ["EpisodeStats"]


@attrs.define(slots=True, eq=False)
class EpisodeStats:
    """Counts since the run started, updated on the event loop as episodes end.

    ``stops`` holds one count per stop reason (every ended episode adds exactly one);
    ``aborted`` counts episodes given up by a soft stop (regenerated, no stop reason);
    ``turns`` policy turns, ``tool_calls`` tool calls run, ``turn_retries`` turns sent again
    after an engine failure, ``mismatches`` episodes whose chat template rewrote earlier turns.
    """

    stops: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(STOP_REASONS, 0))
    turns: int = 0
    tool_calls: int = 0
    turn_retries: int = 0
    mismatches: int = 0
    aborted: int = 0

    @property
    def episodes(self) -> int:
        """Episodes ended (each with one stop reason)."""
        return sum(self.stops.values())

    def ended(self, reason: StopReason) -> None:
        self.stops[reason] += 1

    def record(self) -> dict[str, int]:
        """The counts as metrics-record fields: ``episodes/stop/<reason>``, ``episodes/turns``,
        ``episodes/tool_calls``, ``episodes/turn_retries``, ``episodes/template_mismatch``,
        ``episodes/aborted`` and ``episodes/ended``."""
        out = {f"episodes/stop/{reason}": self.stops[reason] for reason in STOP_REASONS}
        out["episodes/ended"] = self.episodes
        out["episodes/turns"] = self.turns
        out["episodes/tool_calls"] = self.tool_calls
        out["episodes/turn_retries"] = self.turn_retries
        out["episodes/template_mismatch"] = self.mismatches
        out["episodes/aborted"] = self.aborted
        return out
