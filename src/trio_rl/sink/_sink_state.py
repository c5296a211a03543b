"""The sink's state as a checkpoint holds it: the snapshot values, their invariants, and what a
restore drops from them. The sink takes and restores snapshots itself (``_sink``); this module
knows no sink.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable

import attrs

from ..samples import OpenGroup, PolicyVersion, Sample
from ._errors import TrainSinkError
from ._queue import SinkCounters, SinkTally, SinkWindow
from ._scoring import StalenessRule, member_is_stale
from ._types import TrainingSample

__all__ = [
    "RestoreDrops",
    "RestoreReport",
    "SinkDelta",
    "SinkState",
    "check_restorable",
    "copy_open_group",
    "copy_sample",
    "payload_files_of_state",
    "state_problem",
]

logger = logging.getLogger("trio_rl.sink")


@attrs.frozen
class SinkState:
    """An owned snapshot of the sink (see :meth:`TrainSink.state_dict`)."""

    step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    queued: tuple[TrainingSample, ...]
    open_groups: tuple[OpenGroup, ...]


@attrs.frozen
class RestoreReport:
    """What :meth:`TrainSink.load_state_dict` restored and dropped.

    ``resumed`` go back to the rollout layer (same id, prompt, arrived members) to be scheduled
    before any new prompt; ``completed_groups`` were already full and were scored at restore, so
    nothing is dispatched for them.
    """

    resumed: list[OpenGroup]
    completed_groups: list[str]
    queued: int
    dropped_queued_missing: int
    dropped_queued_stale: int
    dropped_members_missing: int
    dropped_members_stale: int


def copy_sample(s: Sample) -> Sample:
    """An owned copy of a finished sample: its lists, metadata and payload segments are new
    objects (for a checkpoint snapshot taken on the loop and written in a worker)."""
    return attrs.evolve(
        s,
        completion_tokens=list(s.completion_tokens),
        logprobs=list(s.logprobs),
        loss_mask=list(s.loss_mask),
        policy_versions=list(s.policy_versions),
        metadata=dict(s.metadata),
        payload=[copy.copy(seg) for seg in s.payload],
    )


def sample_files(s: Sample) -> set[str]:
    return {seg.file for seg in s.payload}


@attrs.frozen
class SinkDelta:
    """What changed in the sink since the previous incremental snapshot (O(changes)).

    The small part (step, arrival counter, counters, window) is whole; of the queue only the
    samples ``put`` under an arrival since then and the arrivals ``removed``; of the open groups
    the records that changed (``groups``, owned copies; a new one goes after the others) and the
    ids ``closed``. Applied in that order: removals first, then puts; closes, then groups.
    """

    step: int
    next_arrival: int
    counters: SinkCounters
    window: SinkWindow
    put: tuple[TrainingSample, ...]
    removed: tuple[int, ...]
    groups: tuple[OpenGroup, ...]
    closed: tuple[str, ...]


def copy_open_group(g: OpenGroup) -> OpenGroup:
    """An owned copy of an open group's saved record (its arrived members copied)."""
    return OpenGroup(
        g.group_id,
        g.prompt,
        g.group_size,
        [copy_sample(m) for m in g.arrived],
        g.policy_version_at_start,
    )


def check_restorable(state: SinkState) -> None:
    """Raise :class:`TrainSinkError` naming the first broken invariant of ``state`` (see
    :func:`state_problem`): what every restore checks before it changes anything."""
    problem = state_problem(state)
    if problem is not None:
        raise TrainSinkError(f"restore: {problem[0]}: {problem[1]}")


@attrs.define(slots=True, eq=False)
class RestoreDrops:
    """What a restore drops: queued samples and open-group members that name a payload file in
    ``missing``, or that went stale (``is_stale``) since the checkpoint was taken."""

    missing: set[str]
    is_stale: Callable[[PolicyVersion], bool]
    rule: StalenessRule
    queued_missing: int = 0
    queued_stale: int = 0
    members_missing: int = 0
    members_stale: int = 0

    def drops_queued(self, ts: TrainingSample) -> bool:
        """Whether queued ``ts`` is dropped (then counted)."""
        if self.missing and any(seg.file in self.missing for seg in ts.payload or ()):
            self.queued_missing += 1
        elif self.is_stale(ts.policy_version):
            self.queued_stale += 1
        else:
            return False
        return True

    def drops_member(self, m: Sample, start: PolicyVersion) -> bool:
        """Whether member ``m`` of a group started at ``start`` is dropped (then counted)."""
        if self.missing and sample_files(m) & self.missing:
            self.members_missing += 1
        elif member_is_stale(m, start, self.rule, self.is_stale):
            self.members_stale += 1
        else:
            return False
        return True

    def settle(self, tally: SinkTally) -> None:
        """Count the dropped samples as settled (missing files: filtered; stale: stale) and
        log them."""
        tally.settle("filtered", self.queued_missing + self.members_missing)
        tally.settle("stale", self.queued_stale + self.members_stale)
        if self.queued_missing or self.queued_stale or self.members_missing or self.members_stale:
            logger.warning(
                "restore: dropped %d queued samples with missing payload files, %d stale queued "
                "samples, %d open-group members with missing payload files and %d stale members "
                "(dropped members are regenerated)",
                self.queued_missing,
                self.queued_stale,
                self.members_missing,
                self.members_stale,
            )


def state_problem(state: SinkState) -> tuple[str, str] | None:
    """The first broken invariant of a snapshot as ``(field path, reason)``, or None.

    Checked: counters and window are non-negative and the window is part of the counters; every
    dispatched sample is settled or held (queued, or a member of an open group); queued arrivals
    strictly increase (they key the queue); open group ids are distinct, each group holds finished
    members with distinct indices, finite rewards and versions in order. A group holding more
    members than ``group_size`` is allowed here (it is scored once, with all of them); the
    checkpoint reader refuses one.
    """
    c, w = state.counters, state.window
    if state.step < 1:
        return "step", f"{state.step} is not a step (steps start at 1)"
    if state.next_arrival < 0:
        return "next_arrival", f"{state.next_arrival} is negative"
    for name in _COUNTER_NAMES:
        if getattr(c, name) < 0:
            return f"counters.{name}", f"{getattr(c, name)} is negative"
    for name in _WINDOW_COUNTS:
        if getattr(w, name) < 0:
            return f"window.{name}", f"{getattr(w, name)} is negative"
        if name in _COUNTER_NAMES and getattr(w, name) > getattr(c, name):
            return f"window.{name}", f"{getattr(w, name)} exceeds counters.{name}"
    if not math.isfinite(w.reward_sum):
        return "window.reward_sum", f"{w.reward_sum!r} is not finite"
    if not all(map(math.isfinite, w.rewards)):
        return "window.rewards", "a reward is not finite"
    if any(n < 0 for n in w.completion_lengths):
        return "window.completion_lengths", "a length is negative"
    if any(n < 0 for n in w.failure_types.values()):
        return "window.failure_types", "a count is negative"
    previous = -1
    for i, ts in enumerate(state.queued):
        if ts.arrival <= previous:
            return f"queued[{i}].arrival", f"{ts.arrival} after {previous} (not in arrival order)"
        previous = ts.arrival
    ids: set[str] = set()
    held = len(state.queued)
    for i, og in enumerate(state.open_groups):
        where = f"open_groups[{i}]"
        if og.group_id in ids:
            return f"{where}.group_id", f"duplicate open group {og.group_id!r}"
        ids.add(og.group_id)
        if og.group_size < 1:
            return f"{where}.group_size", f"{og.group_size} is not a group size"
        if og.policy_version_at_start < 0:
            return f"{where}.policy_version_at_start", "negative version"
        seen: set[int] = set()
        for j, m in enumerate(og.arrived):
            if m.index in seen:
                return f"{where}.members[{j}].index", f"duplicate sample index {m.index}"
            seen.add(m.index)
            if not m.status.is_finished:
                return f"{where}.members[{j}].status", f"{m.status.value} member (not finished)"
            if m.reward is not None and not math.isfinite(m.reward):
                return f"{where}.members[{j}].reward", f"{m.reward!r} is not finite"
            versions = m.policy_versions
            if any(v < 0 for v in versions) or any(b < a for a, b in itertools.pairwise(versions)):
                return f"{where}.members[{j}].policy_versions", f"{versions} out of order"
        held += len(og.arrived)
    if c.dispatched != c.settled + held:
        return (
            "counters.dispatched",
            f"{c.dispatched} dispatched, but {c.settled} settled and {held} held",
        )
    return None


_COUNTER_NAMES = tuple(f.name for f in attrs.fields(SinkCounters))
_WINDOW_COUNTS = tuple(f.name for f in attrs.fields(SinkWindow) if f.type in ("int", int))


def payload_files_of_state(state: SinkState) -> set[str]:
    """Every payload file a snapshot's queued samples and open-group members refer to."""
    files: set[str] = set()
    for ts in state.queued:
        files.update(seg.file for seg in ts.payload or ())
    for og in state.open_groups:
        for m in og.arrived:
            files |= sample_files(m)
    return files
