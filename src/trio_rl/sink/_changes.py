"""What changed in the sink since the last incremental checkpoint: the change log.

The queue and the open-group book note every change to what a checkpoint saves (a queued
arrival put or removed, an open group whose saved record changed, opened or closed) here, so an
incremental checkpoint's snapshot on the loop costs what changed, not the size of the queue.

The log records nothing until a consumer (an incremental `CheckpointManager`) takes a *full*
snapshot and so starts it (:meth:`ChangeLog.start`); each later snapshot drains it
(:meth:`ChangeLog.drain`). Anything that replaces the state wholesale (a restore, a discard of the
queue) stops it (:meth:`ChangeLog.invalidate`): the next snapshot is a full one again. A log
nobody drains stops itself once it grows past a bound, so it never holds memory for long.
"""

from __future__ import annotations

import attrs

from ._types import TrainingSample

__all__ = ["ChangeLog"]

#: A log with more entries than this many times the queue (plus a floor) stops itself.
_BOUND_FACTOR, _BOUND_FLOOR = 4, 1 << 16


@attrs.define(slots=True, eq=False)
class ChangeLog:
    """Changes since the last drain; ``epoch`` counts drains (0: never started)."""

    #: arrival -> the sample now saved under it, or None: removed (the last change wins).
    queued: dict[int, TrainingSample | None] = attrs.field(factory=dict)
    #: open groups whose saved record changed, in the order they were (re)opened or changed.
    groups: dict[str, None] = attrs.field(factory=dict)
    #: open groups closed (removed from the book) since the last drain.
    closed: dict[str, None] = attrs.field(factory=dict)
    active: bool = False
    epoch: int = 0
    owner: object = None
    #: The epoch of the last `start` (the state the first drained changes apply to).
    start_epoch: int = 0

    def put(self, ts: TrainingSample) -> None:
        if self.active:
            self.queued[ts.arrival] = ts

    def remove(self, arrival: int) -> None:
        if self.active:
            self.queued[arrival] = None

    def group(self, group_id: str) -> None:
        if self.active:
            self.groups[group_id] = None

    def opened(self, group_id: str) -> None:
        """A group entered the book: it goes after every group already there."""
        if self.active:
            self.groups.pop(group_id, None)
            self.groups[group_id] = None

    def close(self, group_id: str) -> None:
        if self.active:
            self.groups.pop(group_id, None)
            self.closed[group_id] = None

    def check_bound(self, queued: int) -> None:
        """Stop a log that nobody drains (called as the queue grows)."""
        if self.active and len(self.queued) + len(self.groups) + len(self.closed) > (
            _BOUND_FACTOR * queued + _BOUND_FLOOR
        ):
            self.invalidate()

    def invalidate(self) -> None:
        """The state was replaced wholesale: the next snapshot must be a full one."""
        self.active = False
        self.owner = None
        self.queued, self.groups, self.closed = {}, {}, {}

    def start(self, owner: object) -> int:
        """A full snapshot was taken now by ``owner``: record from here; returns the epoch."""
        self.active, self.owner = True, owner
        self.queued, self.groups, self.closed = {}, {}, {}
        self.epoch += 1
        self.start_epoch = self.epoch
        return self.epoch

    def drain(self) -> tuple[dict[int, TrainingSample | None], dict[str, None], dict[str, None]]:
        """Take the changes since the last drain (the epoch advances)."""
        out = self.queued, self.groups, self.closed
        self.queued, self.groups, self.closed = {}, {}, {}
        self.epoch += 1
        return out
