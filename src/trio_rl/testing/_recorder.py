"""Recording wrappers around a policy, a group runner and a generate function.

The harness never trusts the component under test to describe itself: it wraps each one and
keeps its own record of what really happened (which sample tasks started generating, which
returned a credit and how many times, when each group ended), then compares the driver's
credit ledger with that record at every decision point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from ..rollout import (
    CreditLedger,
    CreditView,
    GenerateFn,
    GroupGranularity,
    SampleBackfill,
    SubmissionPolicy,
)
from ..samples import Group, Sample, SampleStatus
from ._errors import Invariant, InvariantViolationError
from ._report import Trace

__all__ = [
    "CreditRecorder",
    "TrackingLedger",
    "GroupRecord",
    "RecordingPolicy",
    "RecordingRunner",
    "RunnerLike",
    "SampleRecord",
]


class RunnerLike(Protocol):
    """Anything that runs a group the way :class:`~trio_rl.rollout.GroupRunner` does."""

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group: ...


@attrs.define(slots=True)
class TrackingLedger(CreditLedger):
    """A :class:`~trio_rl.rollout.CreditLedger` that also counts how often each group opened.

    Needed where a group can be submitted again under the same id (a retry): the harness must
    tell "submitted again, not started yet" from "ended but never drained".
    """

    opens: dict[str, int] = attrs.field(factory=dict)

    def open(self, group_id: str, credits: int) -> None:
        super().open(group_id, credits)
        self.opens[group_id] = self.opens.get(group_id, 0) + 1


@attrs.define(slots=True, eq=False)
class SampleRecord:
    """What one sample did: generating or not, and the credits it returned."""

    index: int
    generating: bool = False
    generated: bool = False
    credits: int = 0
    #: Virtual times: generate started, generate ended, (last) credit returned.
    started_at: float | None = None
    ended_at: float | None = None
    credit_at: float | None = None


@attrs.define(slots=True, eq=False)
class GroupRecord:
    """What one group did, from its runner's start to its end."""

    group_id: str
    #: Credits the group took (its samples still PENDING when its runner started).
    taken: int
    samples: dict[int, SampleRecord]
    started_at: float
    runs: int = 1
    ended_at: float | None = None
    ended: bool = False
    outcome: str | None = None
    #: The group object the runner was given (a driver may submit it again, continued).
    group: Group | None = None
    #: Its PENDING samples when it ended.
    pending_at_end: int = 0

    @property
    def returned(self) -> int:
        return sum(s.credits for s in self.samples.values())

    @property
    def unfinished(self) -> int:
        """Credits the group still holds: taken minus those its samples returned."""
        return self.taken - self.returned


class CreditRecorder:
    """The harness's own record of sample tasks, credits and groups.

    ``ledger`` returns the driver's current :class:`~trio_rl.rollout.CreditLedger` (or None
    when no batch is in progress); :meth:`check_decision` compares it with the record. The first
    violation is kept in :attr:`violation` (the harness re-raises it outside the driver, since
    a check that fires inside a driver may be swallowed or wrapped by it).
    """

    def __init__(self, trace: Trace, ledger: Callable[[], CreditLedger | None]) -> None:
        self.trace = trace
        self._ledger = ledger
        self.groups: dict[str, GroupRecord] = {}
        self._by_sample: dict[int, GroupRecord] = {}
        self.decisions: list[tuple[CreditView, bool]] = []
        self.violation: InvariantViolationError | None = None

    # -- violations --------------------------------------------------------------------
    # Checks made from inside the system under test only *record* the first violation: raising
    # from a credit callback or a policy would derail the driver into some other error. The
    # harness raises the recorded violation after every step.
    def fail(self, invariant: Invariant, detail: str) -> None:
        if self.violation is None:
            self.violation = self.trace.fail(invariant, detail)

    def check(self, ok: bool, invariant: Invariant, detail: str) -> None:
        if not ok:
            self.fail(invariant, detail)

    def raise_first(self) -> None:
        if self.violation is not None:
            raise self.violation

    # -- the record --------------------------------------------------------------------
    @property
    def open_groups(self) -> list[GroupRecord]:
        return [g for g in self.groups.values() if not g.ended]

    def sample(self, sample: Sample) -> SampleRecord:
        group = self._by_sample.get(sample.index)
        if group is None or sample.index not in group.samples:
            self.fail(
                Invariant.ONE_CREDIT_PER_SAMPLE,
                f"sample {sample.index} is not a pending sample of a running group",
            )
            return SampleRecord(sample.index)
        return group.samples[sample.index]

    def group_started(self, group: Group) -> GroupRecord:
        self.check(
            group.group_id not in self.groups or self.groups[group.group_id].ended,
            Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
            f"group {group.group_id} started while already running",
        )
        pending = [s for s in group.samples if s.status is SampleStatus.PENDING]
        previous = self.groups.get(group.group_id)
        record = GroupRecord(
            group_id=group.group_id,
            taken=len(pending),
            samples={s.index: SampleRecord(s.index) for s in pending},
            started_at=trio.current_time(),
            runs=1 if previous is None else previous.runs + 1,
            group=group,
        )
        self.groups[group.group_id] = record
        for s in pending:
            self._by_sample[s.index] = record
        return record

    def credit(self, record: GroupRecord, sample: Sample) -> None:
        self.check(
            not record.ended,
            Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
            f"sample {sample.index} returned its credit after group {record.group_id} ended",
        )
        entry = record.samples.get(sample.index)
        if entry is None:
            self.fail(
                Invariant.ONE_CREDIT_PER_SAMPLE,
                f"credit returned for sample {sample.index}, which group {record.group_id} "
                "did not take a credit for",
            )
            return
        entry.credits += 1
        entry.credit_at = trio.current_time()
        self.check(
            entry.credits == 1,
            Invariant.ONE_CREDIT_PER_SAMPLE,
            f"sample {sample.index} of group {record.group_id} returned {entry.credits} credits",
        )
        self.check(
            not entry.generating,
            Invariant.ONE_CREDIT_PER_SAMPLE,
            f"sample {sample.index} returned its credit while its generate call was running",
        )

    def group_ended(self, record: GroupRecord, outcome: str) -> None:
        record.ended = True
        record.ended_at = trio.current_time()
        record.outcome = outcome
        if record.group is not None:
            record.pending_at_end = _pending(record.group)
        self.trace.log(f"group {_short(record.group_id)} ended: {outcome}")
        for entry in record.samples.values():
            self.check(
                not entry.generating,
                Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
                f"group {record.group_id} ended ({outcome}) while sample {entry.index} "
                "was still generating",
            )
            if entry.generated:
                self.check(
                    entry.credits == 1,
                    Invariant.ONE_CREDIT_PER_SAMPLE,
                    f"group {record.group_id} ended ({outcome}); sample {entry.index} "
                    f"ran but returned {entry.credits} credits",
                )

    # -- decision points ---------------------------------------------------------------
    def not_started(self, ledger: CreditLedger, group_id: str) -> bool:
        """True if the ledger's entry for ``group_id`` is a submission whose runner has not
        started yet (as opposed to a run the record knows about)."""
        record = self.groups.get(group_id)
        if record is None:
            return True
        if isinstance(ledger, TrackingLedger):
            return ledger.opens.get(group_id, 0) > record.runs
        # A plain ledger: an ended group submitted again (a kept partial group continued) has
        # more PENDING samples than it ended with, and the ledger holds exactly those.
        if not record.ended or record.group is None:
            return False
        now = _pending(record.group)
        return now > record.pending_at_end and ledger.pending().get(group_id) == now

    def truth(self) -> tuple[int, int]:
        """``(credits in flight, pending groups)`` according to the record.

        Groups the driver admitted whose runner has not started yet are taken from the ledger
        (they have done nothing yet, so the ledger's count for them is their whole take).
        """
        ledger = self._ledger()
        running = self.open_groups
        c = sum(g.unfinished for g in running)
        p = len(running)
        if ledger is not None:
            for gid, left in ledger.pending().items():
                if self.not_started(ledger, gid):
                    c += left
                    p += 1
        return c, p

    def check_decision(self, view: CreditView, admitted: bool, expected: bool | None) -> None:
        """``CREDITS_MATCH_PENDING_SAMPLES`` and ``ADMISSION_FOLLOWS_RULE`` at a decision
        point (called by :class:`RecordingPolicy`)."""
        self.decisions.append((view, admitted))
        ledger = self._ledger()
        c, p = self.truth()
        if ledger is not None:
            pending = ledger.pending()
            for g in self.groups.values():
                if g.ended and g.group_id in pending and not self.not_started(ledger, g.group_id):
                    self.fail(
                        Invariant.CREDITS_MATCH_PENDING_SAMPLES,
                        f"decision with group {g.group_id} still pending in the ledger after "
                        "it ended (queued events were not drained before deciding)",
                    )
            self.check(
                ledger.in_flight == sum(pending.values()),
                Invariant.CREDITS_MATCH_PENDING_SAMPLES,
                f"ledger in_flight={ledger.in_flight} but its pending groups hold "
                f"{sum(pending.values())}",
            )
        self.check(
            (view.in_flight, view.pending_groups) == (c, p),
            Invariant.CREDITS_MATCH_PENDING_SAMPLES,
            f"decision saw in_flight={view.in_flight}, pending={view.pending_groups}; "
            f"the unfinished samples of the {p} pending groups are {c}",
        )
        self.check(
            view.pending_groups > 0 or view.in_flight == 0,
            Invariant.CREDITS_MATCH_PENDING_SAMPLES,
            f"no group pending but {view.in_flight} credits in flight",
        )
        if expected is not None:
            self.check(
                admitted == expected,
                Invariant.ADMISSION_FOLLOWS_RULE,
                f"policy answered {admitted} for {view}; the rule says {expected}",
            )


def _pending(group: Group) -> int:
    return sum(1 for s in group.samples if s.status is SampleStatus.PENDING)


def _short(group_id: str) -> str:
    return group_id[:6]


def spec_rule(policy: SubmissionPolicy) -> Callable[[CreditView], bool] | None:
    """The admission rule (``ADMISSION_FOLLOWS_RULE``) of the library's two policies (None
    for others).

    `SampleBackfill` admits a group while ``in_flight + group_size <= budget * group_size``;
    `GroupGranularity` while ``pending_groups < budget``.
    """
    if isinstance(policy, SampleBackfill):
        return lambda v: v.in_flight + v.group_size <= v.budget * v.group_size
    if isinstance(policy, GroupGranularity):
        return lambda v: v.pending_groups < v.budget
    return None


@attrs.define(slots=True, eq=False)
class RecordingPolicy:
    """A :class:`~trio_rl.rollout.SubmissionPolicy` that checks every decision.

    ``rule`` is the admission rule the inner policy must follow (None: not checked). A
    :class:`~trio_rl.rollout.SampleBackfill` (or subclass) must also admit whenever group
    granularity would (``pending < budget``).
    """

    inner: SubmissionPolicy
    recorder: CreditRecorder
    rule: Callable[[CreditView], bool] | None = None

    @property
    def counts_samples(self) -> bool:
        return self.inner.counts_samples

    def admits(self, view: CreditView) -> bool:
        admitted = self.inner.admits(view)
        expected = None if self.rule is None else self.rule(view)
        self.recorder.check_decision(view, admitted, expected)
        if isinstance(self.inner, SampleBackfill) and view.pending_groups < view.budget:
            self.recorder.check(
                admitted,
                Invariant.ADMISSION_FOLLOWS_RULE,
                f"sample backfill refused {view} although group granularity admits",
            )
        return admitted


def recording_generate(recorder: CreditRecorder, inner: GenerateFn) -> GenerateFn:
    """Wrap a generate function so the record knows which samples are generating."""

    async def generate(sample: Sample) -> None:
        entry = recorder.sample(sample)
        recorder.check(
            not entry.generated,
            Invariant.ONE_CREDIT_PER_SAMPLE,
            f"sample {sample.index} generated twice in one group run",
        )
        entry.generating = entry.generated = True
        entry.started_at = trio.current_time()
        try:
            await inner(sample)
        finally:
            entry.generating = False
            entry.ended_at = trio.current_time()

    return generate


@attrs.define(slots=True, eq=False)
class RecordingRunner:
    """Wraps a group runner: records each group's start, every credit, and its end."""

    inner: RunnerLike
    recorder: CreditRecorder

    async def run(
        self,
        group: Group,
        on_sample_done: Callable[[Sample], None] | None = None,
        abort: trio.Event | None = None,
    ) -> Group:
        """Run ``group`` on the inner runner, recording it; ``abort`` (the soft stop of
        partial rollouts) is passed on only when given, so a runner without it still works
        under drivers that never use it. Cancellation: as the inner runner's."""
        recorder = self.recorder
        record = recorder.group_started(group)
        outcome = "cancelled"
        # a reporter that takes credits back early (`reward_started`) is recorded when it does
        credit = (
            _EarlyCredit(recorder, record, on_sample_done)
            if callable(getattr(on_sample_done, "generated", None))
            else _Credit(recorder, record, on_sample_done)
        )
        try:
            if abort is None:
                result = await self.inner.run(group, on_sample_done=credit)
            else:
                # RunnerLike does not require ``abort``; a driver passing one needs a runner
                # that takes it (GroupRunner does).
                inner_run: Any = self.inner.run
                result = await inner_run(group, on_sample_done=credit, abort=abort)
            outcome = "completed"
            return result
        except BaseException as exc:
            if not _only_cancelled(exc):
                outcome = f"failed: {type(exc).__name__}"
            raise
        finally:
            recorder.group_ended(record, outcome)


@attrs.define(slots=True, eq=False)
class _Credit:
    """A recorded group's ``on_sample_done``: the credit recorded, then the driver's own."""

    recorder: CreditRecorder
    record: GroupRecord
    inner: Callable[[Sample], None] | None
    #: Samples whose credit came back early (`generated`).
    early: set[int] = attrs.field(factory=set)

    def __call__(self, sample: Sample) -> None:
        if sample.index not in self.early:
            self.recorder.credit(self.record, sample)
        if self.inner is not None:
            self.inner(sample)


@attrs.define(slots=True, eq=False)
class _EarlyCredit(_Credit):
    """:class:`_Credit` for a reporter with ``generated``: a sample's credit recorded when its
    reward call gave it back early, and not again at its end."""

    def generated(self, sample: Sample) -> None:
        self.early.add(sample.index)
        self.recorder.credit(self.record, sample)
        getattr(self.inner, "generated")(sample)  # noqa: B009 - checked by RecordingRunner


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
