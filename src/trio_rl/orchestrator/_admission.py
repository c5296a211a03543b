"""`StalenessAdmission`: admission at dispatch from the sink's own books."""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from ..samples import Group, PolicyVersion
from ..sink import (
    TrainSink,
)

logger = logging.getLogger("trio_rl.orchestrator")


@attrs.define(slots=True, eq=False)
class StalenessAdmission:
    """Admission at dispatch from the sink's own books (a :class:`~trio_rl.rollout.Admission`).

    Batch ``S`` trains on policy ``S - 1``, and the sink drops a sample of version ``v`` from
    batch ``S`` when ``v < S - 1 - max_off_policy_steps``: work started now, at version ``v``,
    is trainable in batches up to ``v + 1 + max_off_policy_steps``. Batches are cut oldest
    version first, so every sample already queued or still to come from an open group goes
    before it: with ``ahead`` such samples (each open group counted as its full size, an upper
    bound) a new group of ``G`` lands at the latest in batch ``step + (ahead + G - 1) //
    batch_size``. It is admitted if that batch is within the staleness limit and not after
    ``horizon`` (the run's last step: work for later steps would be left over). The trainer's
    pace enters through the version: when it lags, admission waits for it instead of
    generating work that would be dropped.

    Liveness: when the work ahead cannot fill the batch being collected (``ahead <
    batch_size``), a group that straddles the limit is still admitted unless a shipped batch is
    waiting to be trained (then the version will advance and admit it whole).

    A running group expires once the sink would judge every one of its members stale for the
    batch being collected (`TrainSink.member_is_stale`, the rule the sink scores by; certain:
    steps only advance); the driver then cancels it. A resumed group's regenerated members are
    judged by the version their attempt started at, as the sink judges them, so a resumed
    group whose new members can train keeps running under its id.

    In ``lockstep`` mode a group starts only when no other is open and the version is
    ``lands - 1 - async_level`` for the batch ``lands`` its first sample goes to (or later):
    rollouts then depend on the seed only, not on timing.
    """

    sink: TrainSink
    #: The last step the run will ship (None: unbounded).
    horizon: int | None = None
    lockstep: bool = False
    async_level: int = 1
    #: Samples of open groups not to count as work ahead (None: none): those whose reward
    #: call runs slow (``RecordReward.slow_calls``). A reward that hangs on a record would
    #: otherwise hold back new work for as long as its timeout, for samples that may never
    #: arrive; if they do arrive, the sink judges their staleness as usual.
    uncounted: Callable[[], int] | None = None

    def ahead(self) -> int:
        """Samples that go before new work: queued, in a cut, or still to come from open groups
        (less those ``uncounted`` says may never come)."""
        held = self.sink.queue.held
        coming = sum(g.group_size for g in self.sink.book.groups.values())
        if self.uncounted is not None:
            coming = max(0, coming - self.uncounted())
        return held + coming

    def admits(self, version: PolicyVersion, samples: int) -> bool:
        config = self.sink.config
        size = config.batch_size
        m = config.max_off_policy_steps
        step = self.sink.step
        if self.lockstep and size is not None:
            if self.sink.book.groups or (self.horizon is not None and step > self.horizon):
                return False
            first = step + self.sink.queue.held // size
            return version >= max(0, first - 1 - self.async_level)
        if size is None or (m is None and self.horizon is None):
            return True
        ahead = self.ahead()
        lands = step + (ahead + samples - 1) // size
        fresh = m is None or lands <= version + 1 + m
        if fresh and (self.horizon is None or lands <= self.horizon):
            return True
        if ahead >= size or (self.horizon is not None and step > self.horizon):
            return False  # the batch being collected fills from work ahead (or the run is done)
        # the batch being collected needs this work: wait only if the version will advance
        return fresh or version >= step - 1

    def expired(self, group: Group) -> bool:
        # The sink's own judgment of each member (`TrainSink.member_is_stale`): a resumed
        # group's regenerated members are judged by the version their attempt started at,
        # exactly as the sink will judge them.
        start = group.policy_version_at_start
        return all(self.sink.member_is_stale(s, start) for s in group.samples)
