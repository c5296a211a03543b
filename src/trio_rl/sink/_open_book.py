"""The sink's open-group book: the one record of work in flight, and what its arrivals count."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import attrs

from ..samples import Group, OpenGroup, PolicyVersion, Prompt, Sample, SampleStatus
from ._changes import ChangeLog
from ._errors import TrainSinkError
from ._queue import Outcome, SinkTally
from ._scoring import GroupScore, validate_sample
from ._zero_output import ZeroOutputBudget

__all__ = ["OpenBook"]


@attrs.define(slots=True, eq=False)
class OpenBook:
    """The sink's open groups and what their arrivals count: the one record of work in flight.

    It is the :class:`~trio_rl.samples.GroupBook` the async driver reports to, and the sink's
    own member-by-member API reports through it. Every member that arrives is dispatched once;
    failed and aborted ones settle at once; finished ones are held until the group closes:
    scored (``finalize``, the sink's), or settled by a failed attempt or a discard.
    """

    tally: SinkTally
    #: Scores a complete group (``TrainSink._finalize``): takes it out with :meth:`close`.
    finalize: Callable[[str], None]
    groups: dict[str, OpenGroup] = attrs.field(factory=dict)
    #: What an incremental checkpoint saves that changed (shared with the queue).
    changes: ChangeLog = attrs.field(factory=ChangeLog)
    #: Told of every group discarded here (it queued nothing for training).
    zero_output: ZeroOutputBudget | None = None

    @property
    def held(self) -> int:
        return sum(len(g.arrived) for g in self.groups.values())

    def open(
        self, group_id: str, prompt: Prompt, group_size: int, start: PolicyVersion
    ) -> OpenGroup:
        if group_id in self.groups:
            raise TrainSinkError(f"group {group_id}: already open")
        if group_size < 1:
            raise TrainSinkError(f"group {group_id}: group_size must be >= 1, got {group_size}")
        g = self.groups[group_id] = OpenGroup(
            group_id, prompt, group_size, policy_version_at_start=start
        )
        self.changes.opened(group_id)
        return g

    def member(self, group_id: str, sample: Sample) -> OpenGroup:
        """One member of open group ``group_id`` arrived; returns the group."""
        g = self.groups.get(group_id)
        if g is None:
            raise TrainSinkError(f"group {group_id}: member {sample.index} for a group not open")
        self.arrive(g, [sample])
        return g

    def admit(self, group: Group) -> None:
        """A finished group arrives whole; members the book already holds for it (same sample
        index: reported by the driver, or restored) are recognised and not counted twice."""
        g = self._opened(group)
        self.changes.group(g.group_id)  # rewards of held members are set below
        rewards = {s.index: s.reward for s in group.samples if s.index in g.seen}
        for m in g.arrived:
            # the group reward ran over the whole group, restored members included
            if (reward := rewards.get(m.index)) is not None:
                m.reward = reward
        new = [s for s in group.samples if s.index not in g.seen]
        if len({s.index for s in new}) != len(new):
            raise TrainSinkError(f"group {group.group_id}: duplicate sample indices")
        for m in g.arrived:
            if m.reward is None or not math.isfinite(m.reward):
                validate_sample(m, f"group {g.group_id}")  # names the unrewarded member
        self.arrive(g, new)

    def arrive(self, g: OpenGroup, samples: list[Sample], *, rewarded: bool = True) -> None:
        """Count new members of ``g`` (any status): dispatched; failed and aborted ones settle.
        ``rewarded=False``: reported as they finish, before any group reward."""
        where = f"group {g.group_id}"
        for s in samples:
            if s.index in g.seen:
                raise TrainSinkError(f"{where}, sample {s.index}: arrived twice")
            if s.status is SampleStatus.PENDING:
                raise TrainSinkError(f"{where}, sample {s.index}: still pending")
            validate_sample(s, where, rewarded=rewarded)
        self.tally.dispatched(len(samples))
        if samples:
            self.changes.group(g.group_id)
        for s in samples:
            g.seen.add(s.index)
            if s.status is SampleStatus.FAILED:
                g.failed += 1
                self.tally.settle("failed", 1)
                self._failure_type("failed_status")
            elif s.status is SampleStatus.ABORTED:
                g.cancelled += 1
                g.aborted = True
                self.tally.settle("cancelled", 1)
            else:
                g.arrived.append(s)

    def lose(
        self, outcome: Literal["failed", "cancelled"], n: int, gid: str | None
    ) -> OpenGroup | None:
        """``n`` dispatched samples ended without a sample; returns their group if it is open."""
        if n < 0:
            raise TrainSinkError(f"record_{outcome}: n must be >= 0, got {n}")
        g = self.groups.get(gid) if gid is not None else None
        if gid is not None and g is None:
            raise TrainSinkError(f"record_{outcome}: group {gid} is not open")
        self.tally.dispatched(n)
        self.tally.settle(outcome, n)
        if g is not None:
            setattr(g, outcome, getattr(g, outcome) + n)
        return g

    def close(self, group_id: str) -> OpenGroup:
        """Take a complete group out to be scored; the attempt budget counts every member that
        arrived, stale ones included: a stale member cost an engine attempt like any other."""
        g = self.groups.pop(group_id)
        self.changes.close(group_id)
        self._attempts(len(g.arrived) + g.failed + g.cancelled, groups=1)
        # scored in sample order, not the order members finished in (which trio varies): the
        # group's training samples and metrics then never depend on timing
        g.arrived.sort(key=lambda s: s.index)
        return g

    def _attempts(self, n: int, *, groups: int = 0) -> None:
        w = self.tally.window
        self.tally.window = attrs.evolve(w, attempts=w.attempts + n, groups=w.groups + groups)

    def settle_score(self, score: GroupScore) -> None:
        self.tally.settle("filtered", score.filtered)
        self.tally.settle("stale", score.stale)
        self.tally.settle("pruned", score.pruned)
        w = self.tally.window
        # The value lists are the live window's own (see `SinkWindow`): appended in place.
        w.rewards.extend(score.rewards)
        w.completion_lengths.extend(score.lengths)
        if score.rewards or score.zero_length:
            self.tally.window = attrs.evolve(
                w,
                reward_sum=w.reward_sum + sum(score.rewards),
                reward_count=w.reward_count + len(score.rewards),
                zero_length=w.zero_length + score.zero_length,
            )

    def _failure_type(self, name: str, n: int = 1) -> None:
        types = self.tally.window.failure_types
        types[name] = types.get(name, 0) + n

    def _failures(self, error: BaseException | None) -> None:
        """Count a failed attempt's errors by type: each real failure of a `GroupFailedError`
        (a sample's or the group reward's exception), or ``error`` itself."""
        if error is None:
            return
        failures = getattr(error, "failures", None)
        if isinstance(failures, tuple) and failures:
            for _, exc in failures:
                self._failure_type(type(exc).__name__)
        else:
            self._failure_type(type(error).__name__)

    # -- GroupBook: what the async driver reports ------------------------------------------

    def _opened(self, group: Group) -> OpenGroup:
        g = self.groups.get(group.group_id)
        if g is None:
            g = self.open(
                group.group_id, group.prompt, max(1, group.size), group.policy_version_at_start
            )
        return g

    def group_opened(self, group: Group) -> None:
        """``group`` was submitted: opened here unless open already (restored, or a retry).
        Members arrive only as reported (or when the group is handed over whole)."""
        self._opened(group)

    def members_arrived(self, group: Group, samples: Sequence[Sample]) -> None:
        """Finished members of open ``group`` arrived; held (the same objects) until it closes.
        Never scores: the group reward may not have run yet (the consumer's add_group does)."""
        g = self._opened(group)
        self.arrive(g, [s for s in samples if s.index not in g.seen], rewarded=False)

    def attempt_failed(self, group: Group, error: BaseException | None = None) -> None:
        """The attempt raised: each of its samples settles failed (held members included, before
        the driver resets them for the retry), counted in the attempt budget; the group stays
        open and empty. ``error`` (the attempt's `GroupFailedError`) is counted by type."""
        g = self._opened(group)
        self._failures(error)
        self._settle(g, group, "failed")
        g.arrived, g.seen, g.failed, g.cancelled, g.aborted = [], set(), 0, 0, False
        self.changes.group(g.group_id)

    def group_discarded(
        self, group: Group, reason: str, error: BaseException | None = None
    ) -> None:
        """``group`` will not reach the consumer. ``"aborted"``: scored like any group (aborted
        members cancelled, the rest filtered); ``"failed"`` (its last attempt, ``error`` counted
        by type), ``"filtered"``, ``"stale"``: every member settles under that outcome and the
        group closes."""
        self._failures(error)
        if reason == "aborted":
            self.admit(group)
            self.finalize(group.group_id)
            return
        outcome: Outcome = (
            reason if reason in ("failed", "filtered", "stale") else "cancelled"  # type: ignore[assignment]
        )
        g = self._opened(group)
        self._settle(g, group, outcome)
        del self.groups[group.group_id]
        self.changes.close(group.group_id)
        if self.zero_output is not None:
            unseen = [s for s in group.samples if s.index not in g.seen]
            returned = g.arrived + [s for s in unseen if s.status.is_finished]
            owed = len(g.arrived) + len(unseen) + g.failed + g.cancelled
            self.zero_output.finished_empty(returned, owed, len(group.prompt.tokens))

    def _settle(self, g: OpenGroup, group: Group, outcome: Outcome) -> None:
        unseen = [s for s in group.samples if s.index not in g.seen]
        self.tally.dispatched(len(unseen))
        self.tally.settle(outcome, len(g.arrived) + len(unseen))
        self._attempts(len(g.arrived) + len(unseen) + g.failed + g.cancelled)
