"""Credits and submission policies: *may another group start now?*

The pieces, from the bottom up:

- :class:`CreditLedger` is the driver's account of credits: one credit per sample that is (or will
  be) generated, per pending group the number of its samples not yet finished. It is plain
  accounting with no I/O, so a test harness can inspect it at any decision point and check
  ``ledger.in_flight == sum(ledger.pending().values())``.
- A :class:`SubmissionPolicy` is a small pure object: ``admits(view)`` decides from a
  :class:`CreditView` (credits in flight, pending groups, group size, budget) whether one more
  group may start, and ``counts_samples`` says whether a sample completion is progress that is
  worth waking the driver for. :class:`GroupGranularity` and :class:`SampleBackfill` are the two
  reference policies; write your own by implementing the protocol.
- :class:`CreditScheduler` ties a policy and a ledger to **one** trio memory channel. Sample
  tasks report a finished sample and group tasks a finished group on it with a synchronous
  ``send_nowait`` (safe in a ``finally``, even while being cancelled), so a report is never
  lost and a wake-up never missed; the driver applies reports to the ledger only when it
  drains the channel, and it drains the whole backlog before it decides again.

Credits are conserved per group: when a group's end is reported, every credit of that group
that no finished sample returned (samples that never started) comes back with it.
There is no "reset the counter when nothing is pending" repair: with ``P`` empty the count is
zero by construction, and :meth:`CreditLedger.check` reports it if it ever is not.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import trio

from .._validation import at_least, check_int
from ..samples import Group
from ._errors import CreditError, GroupFailedError

__all__ = [
    "CreditEvent",
    "CreditLedger",
    "CreditScheduler",
    "CreditView",
    "GroupDone",
    "GroupGranularity",
    "GroupOutcome",
    "GroupStatus",
    "Nudge",
    "SampleBackfill",
    "SampleDone",
    "SchedulerStatistics",
    "SubmissionPolicy",
]


# --------------------------------------------------------------------------- policies


@attrs.frozen
class CreditView:
    """What a policy sees at a decision point.

    ``in_flight`` is the number of credits held (samples submitted and not yet finished, as of
    the last drain), ``pending_groups`` the number of groups started and not yet done,
    ``group_size`` the size G of the group that would start, ``budget`` the budget B in groups.
    """

    in_flight: int = attrs.field(validator=at_least(0))
    pending_groups: int = attrs.field(validator=at_least(0))
    group_size: int = attrs.field(validator=at_least(1))
    budget: int = attrs.field(validator=at_least(0))


@runtime_checkable
class SubmissionPolicy(Protocol):
    """Decides whether one more group may start. Must be pure (no state, no I/O)."""

    @property
    def counts_samples(self) -> bool:
        """True if a single finished sample can open capacity (so it should wake the driver)."""
        ...

    def admits(self, view: CreditView) -> bool:
        """May one more group of ``view.group_size`` samples start now?"""
        ...


@attrs.frozen
class GroupGranularity:
    """Group granularity (reference ``GroupLevelSubmission``): admit iff ``|P| < B``.

    Only a finished group frees room, so sample completions do not wake the driver.
    """

    @property
    def counts_samples(self) -> bool:
        return False

    def admits(self, view: CreditView) -> bool:
        return view.pending_groups < view.budget


@attrs.frozen
class SampleBackfill:
    """Sample backfill (reference ``SampleBackfillSubmission``): a budget of ``B x G`` credits.

    Admit iff ``in_flight + G <= B x G``. Every finished sample returns one credit whatever its
    outcome, so a group held open by one straggler frees the slots of its finished siblings. With
    exact accounting it admits whenever :class:`GroupGranularity` would.
    """

    @property
    def counts_samples(self) -> bool:
        return True

    def admits(self, view: CreditView) -> bool:
        return view.in_flight + view.group_size <= view.budget * view.group_size


# --------------------------------------------------------------------------- events


class GroupStatus(enum.Enum):
    """How a group task ended."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@attrs.frozen
class GroupOutcome:
    """The result of one group task, as delivered to the driver.

    ``error`` is set iff ``status`` is ``FAILED``. A ``CANCELLED`` group was cancelled from
    outside (the driver closing or discarding leftovers); its samples are in whatever state the
    cancellation left them.
    """

    group: Group
    status: GroupStatus
    error: GroupFailedError | None = None

    @property
    def group_id(self) -> str:
        return self.group.group_id


@attrs.frozen
class SampleDone:
    """One sample of ``group_id`` finished (any outcome): one credit comes back."""

    group_id: str


@attrs.frozen
class GroupDone:
    """A group task ended; its unreturned credits come back with it."""

    outcome: GroupOutcome


@attrs.frozen
class Nudge:
    """Something other than a completion may have changed a decision (resume, recycle, close)."""

    reason: str = ""


CreditEvent = SampleDone | GroupDone | Nudge

#: What travels on the scheduler's channel: a finished sample's group id, a finished group's
#: outcome, or a nudge.
_Report = str | GroupOutcome | Nudge


# --------------------------------------------------------------------------- ledger


@attrs.define(slots=True)
class CreditLedger:
    """Credits in flight and, per pending group, its number of unfinished samples.

    Invariant (checked by :meth:`check`): ``in_flight == sum(pending().values())``, so no
    pending group means no credit in flight. Mutated by the driver only, on the event loop:
    reporting tasks never touch it. They put their reports on the :class:`CreditScheduler`'s
    channel, and the driver applies them here when it reads the channel (``poll``,
    ``wait_for_progress``), all of them before each decision.
    """

    in_flight: int = 0
    _unfinished: dict[str, int] = attrs.field(factory=dict)
    #: Credits handed out and returned since creation (for statistics and harness checks).
    opened: int = 0
    returned: int = 0

    @property
    def pending_groups(self) -> int:
        return len(self._unfinished)

    def pending(self) -> dict[str, int]:
        """A copy of ``{group_id: unfinished samples}`` for every pending group."""
        return dict(self._unfinished)

    def unfinished(self, group_id: str) -> int:
        """Unfinished samples of a pending group; raises :class:`CreditError` if unknown."""
        try:
            return self._unfinished[group_id]
        except KeyError:
            raise CreditError(f"group {group_id} is not pending") from None

    def open(self, group_id: str, credits: int) -> None:
        """A group starts and takes ``credits`` credits (its samples to generate; may be 0)."""
        if credits < 0:
            raise CreditError(f"group {group_id}: negative credit count {credits}")
        if group_id in self._unfinished:
            raise CreditError(f"group {group_id} is already pending")
        self._unfinished[group_id] = credits
        self.in_flight += credits
        self.opened += credits

    def sample_done(self, group_id: str) -> None:
        """One sample of a pending group finished; its credit comes back."""
        # One dict lookup, no helper call: this runs once per finished sample.
        left = self._unfinished.get(group_id, 0)
        if left == 0:
            self.unfinished(group_id)  # raises CreditError if the group is not pending
            raise CreditError(f"group {group_id} returned more credits than it took")
        self._unfinished[group_id] = left - 1
        self.in_flight -= 1
        self.returned += 1

    def close(self, group_id: str) -> int:
        """The group ended: remove it and return its remaining credits; returns how many."""
        left = self.unfinished(group_id)
        del self._unfinished[group_id]
        self.in_flight -= left
        self.returned += left
        return left

    def check(self) -> None:
        """Raise :class:`CreditError` unless ``in_flight`` equals the pending groups' sum."""
        total = sum(self._unfinished.values())
        if self.in_flight != total or self.opened - self.returned != total:
            raise CreditError(
                f"credit ledger out of balance: in_flight={self.in_flight}, "
                f"sum over pending groups={total}, opened-returned={self.opened - self.returned}"
            )

    def view(self, group_size: int, budget: int) -> CreditView:
        return CreditView(
            in_flight=self.in_flight,
            pending_groups=len(self._unfinished),
            group_size=group_size,
            budget=budget,
        )


# --------------------------------------------------------------------------- scheduler


_Decide = Callable[["SubmissionPolicy", "CreditLedger", int, int], bool]


def _by_view(policy: SubmissionPolicy, ledger: CreditLedger, group_size: int, budget: int) -> bool:
    return policy.admits(ledger.view(group_size, budget))


def _backfill_admits(
    _: SubmissionPolicy, ledger: CreditLedger, group_size: int, budget: int
) -> bool:
    return ledger.in_flight + group_size <= budget * group_size


def _group_admits(_: SubmissionPolicy, ledger: CreditLedger, group_size: int, budget: int) -> bool:
    return len(ledger._unfinished) < budget


#: `CreditScheduler.admits` for the reference policies, the same rule as their ``admits``
#: without building a validated `CreditView` (4 validators) per decision. Speed over one
#: code path, measured (timeit, busy 2-core VM): 4.75 -> 0.30 us per decision, one or two
#: decisions per admitted group, so ~0.5 us per sample at G = 8.
_FAST_POLICIES: dict[type, _Decide] = {
    SampleBackfill: _backfill_admits,
    GroupGranularity: _group_admits,
}


def replace_policy(scheduler: CreditScheduler, policy: SubmissionPolicy) -> None:
    """Give ``scheduler`` another submission policy from its next decision on (a priority
    lane's wrapper, `trio_rl.rollout.PriorityLane.attach`); its fast decision path follows."""
    scheduler.policy = policy
    scheduler._decide = _FAST_POLICIES.get(type(policy), _by_view)


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of a :class:`CreditScheduler`: credits and groups in flight (as of the last
    drain), groups admitted, admission decisions taken, events applied, wake-ups, and the
    reports still queued on the channel."""

    in_flight: int
    pending_groups: int
    groups_admitted: int
    decisions: int
    sample_events: int
    group_events: int
    wakeups: int
    #: Reports on the channel not yet applied (the driver's backlog).
    queued: int = 0


class CreditScheduler:
    """A policy, a ledger and one memory channel of reports; the driver's side of admission.

    Typical driver loop::

        while running:
            while scheduler.admits(budget):
                group = ...                       # next group
                scheduler.submitted(group.group_id, credits=len(samples_to_generate))
                nursery.start_soon(task, group)   # task reports via sample_done/group_done
            for outcome in await scheduler.wait_for_progress():
                ...                               # reap finished groups

    ``sample_done``, ``group_done`` and ``nudge`` put a report on one unbounded trio memory
    channel with ``send_nowait``: synchronous, never blocking, so they are safe in a
    ``finally`` while the calling task is being cancelled, and a report is never lost. The
    driver owns the receive side and the ledger: :meth:`wait_for_progress` (one ``await
    receive()`` when nothing is pending, then ``receive_nowait()`` until ``WouldBlock``) and
    :meth:`poll` apply the whole backlog to the ledger before returning, so each decision reads
    every report made before it, and a backlog of any size is one wake-up. The channel queues
    reports in order and keeps them across a cancelled wait. The scheduler must outlive every
    task that reports to it: close it (:meth:`close`) only after the nursery running the groups
    has exited.

    ``ledger`` is the (empty) ledger to keep the accounts in, default a new :class:`CreditLedger`;
    pass one, e.g. a subclass that also records what it is told, to observe the driver's
    accounting from outside (the :mod:`trio_rl.testing` harness does).
    """

    def __init__(
        self, policy: SubmissionPolicy, group_size: int, *, ledger: CreditLedger | None = None
    ) -> None:
        check_int("CreditScheduler", "group_size", group_size, minimum=1)
        if ledger is not None and (ledger.opened or ledger.returned or ledger.pending_groups):
            raise CreditError(
                f"CreditScheduler.ledger must be empty, got opened={ledger.opened}, "
                f"returned={ledger.returned}, pending_groups={ledger.pending_groups}"
            )
        self.policy = policy
        self.group_size = group_size
        self.ledger = ledger if ledger is not None else CreditLedger()
        self._counts_samples = bool(policy.counts_samples)
        self._decide = _FAST_POLICIES.get(type(policy), _by_view)  # speed: see there
        # Reports: a sample's group id (no object built per sample), a GroupOutcome, a Nudge.
        send, receive = trio.open_memory_channel[_Report](math.inf)
        self._send, self._receive = send, receive
        # Bound once: the reporting path is one call per finished sample.
        self._send_nowait = send.send_nowait
        self._receive_nowait = receive.receive_nowait
        #: Sample progress (policy counting samples) applied but not yet seen by the driver.
        self._progress = False
        #: A nudge applied but not yet seen by the driver (finished groups wait in ``_done``).
        self._nudged = False
        self._closed = False
        #: The driver is blocked in ``receive()`` (see `settle`).
        self._receiving = False
        #: Set by a driver that is closing: a group task that has not started yet ends at once,
        #: CANCELLED, instead of starting its samples (see `run_reporting`).
        self.winding_down = False
        #: The first report the ledger refused, raised on the driver's side.
        self._error: CreditError | None = None
        self._admitted = 0
        self._decisions = 0
        self._sample_events = 0
        self._group_events = 0
        self._wakeups = 0
        self._done: list[GroupOutcome] = []

    # -- reporting side (called by group and sample tasks) -----------------------------

    def sample_done(self, group_id: str) -> None:
        """Report that one sample of ``group_id`` finished (whatever its outcome).

        Its credit comes back when the driver next drains the channel. Raises
        ``trio.ClosedResourceError`` after :meth:`close`. A report the ledger refuses (a group
        that is not pending, or more credits back than it took) does not raise here, in the
        reporting task's ``finally``: the driver's :meth:`poll` or :meth:`wait_for_progress`
        that applies it raises the :class:`CreditError`.
        """
        self._send_nowait(group_id)

    def sample_reporter(self) -> Callable[[str], None]:
        """:meth:`sample_done`, bound once per group: the channel's ``send_nowait`` itself
        (one call per finished sample) unless a subclass overrides :meth:`sample_done`."""
        if type(self).sample_done is CreditScheduler.sample_done:
            return self._send_nowait
        return self.sample_done

    def group_done(self, outcome: GroupOutcome) -> None:
        """Report that a group task ended (after all its samples reported): when applied, the
        group leaves the ledger with its unreturned credits, and the outcome is handed to the
        driver."""
        self._send_nowait(outcome)

    def nudge(self, reason: str = "") -> None:
        """Wake a driver waiting in :meth:`wait_for_progress` without any completion."""
        self._send_nowait(Nudge(reason))

    # -- driver side -------------------------------------------------------------------

    def _apply(self, report: _Report | None) -> None:
        """Apply ``report`` (if not None), then every queued report, to the ledger: one
        ``receive_nowait()`` per report until ``WouldBlock``."""
        receive = self._receive_nowait
        sample_done = self.ledger.sample_done
        samples = 0
        try:
            if report is None:
                report = receive()
            while True:
                if report.__class__ is str:
                    samples += 1
                    try:
                        sample_done(report)
                    except CreditError as exc:
                        self._refuse(exc)
                else:
                    self._apply_other(report)  # type: ignore[arg-type]
                report = receive()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            pass  # the channel is empty (or closed): the backlog is applied
        if samples:
            self._sample_events += samples
            if self._counts_samples:
                self._progress = True

    def _apply_other(self, report: GroupOutcome | Nudge) -> None:
        if not isinstance(report, GroupOutcome):
            self._nudged = True
            return
        self._group_events += 1
        try:
            self.ledger.close(report.group_id)
        except CreditError as exc:
            self._refuse(exc)
        else:
            self._done.append(report)

    def _refuse(self, error: CreditError) -> None:
        self._error = self._error or error

    def _raise_refused(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def queued(self) -> int:
        """Reports on the channel not yet applied to the ledger (0 at every decision of a
        correct driver: it drains before deciding)."""
        return self._receive.statistics().current_buffer_used

    def view(self, budget: int) -> CreditView:
        return self.ledger.view(self.group_size, budget)

    def admits(self, budget: int) -> bool:
        """Ask the policy whether one more group may start under a budget of ``budget`` groups.

        The ledger is as of the last drain (:meth:`poll`, :meth:`wait_for_progress`). A refusal
        clears the sample progress seen so far (the reference's ``has_capacity`` clears its
        event the same way): it was already in the ledger this decision read, so only later
        completions wake the next :meth:`wait_for_progress`. Finished groups and nudges still do.
        """
        self._decisions += 1
        if self._decide(self.policy, self.ledger, self.group_size, budget):
            return True
        self._progress = False
        return False

    def submitted(self, group_id: str, credits: int) -> None:
        """Record that a group was started and takes ``credits`` credits."""
        self.ledger.open(group_id, credits)
        self._admitted += 1

    def _take_done(self) -> list[GroupOutcome]:
        done, self._done = self._done, []
        return done

    def settle(self) -> None:
        """Apply every queued report to the ledger now; finished groups and progress stay for
        the driver's next :meth:`poll` or wait (a closing driver's wind-down watches the
        ledger with it). Does nothing while the driver is blocked in :meth:`wait_for_progress`:
        a report sent then is handed to it directly, and applying the ones queued behind it
        first would break the channel's order (a group's end before its samples')."""
        if not self._receiving:
            self._apply(None)

    def poll(self) -> list[GroupOutcome]:
        """Apply every queued report to the ledger without waiting; return the groups that
        finished since the last call.

        Raises the :class:`CreditError` of a report the ledger refused, if any.
        """
        self._apply(None)
        self._raise_refused()
        self._progress = self._nudged = False
        return self._take_done()

    async def wait_for_progress(self) -> list[GroupOutcome]:
        """Wait for progress, apply the whole backlog; return the groups that finished since
        the last call.

        Progress is a group ending, a :meth:`nudge`, or (when the policy counts samples) a
        sample finishing; every report made before the return is in the ledger. Reports made
        before the call count (unless a refused :meth:`admits` already saw them), so a
        completion can never be missed. The list may be empty (a sample finished, or a nudge).
        Cancel-safe: a report leaves the channel only to be applied at once, so what a
        cancelled wait left queued the next call applies. Raises the :class:`CreditError` of a
        refused report (a runner bug); ``trio.ClosedResourceError`` once closed and drained.
        """
        # No drain first: receive() returns a queued report at once, and a driver that just
        # polled blocks without paying a WouldBlock for an empty look.
        if not (self._progress or self._nudged or self._done or self._error):
            receive = self._receive.receive
            while True:
                self._receiving = True
                try:
                    report = await receive()
                finally:
                    self._receiving = False
                self._apply(report)
                if self._progress or self._nudged or self._done or self._error:
                    break
        self._raise_refused()
        self._progress = self._nudged = False
        self._wakeups += 1
        return self._take_done()

    def close(self) -> None:
        """Close the scheduler and its channel: later reports raise
        ``trio.ClosedResourceError``. Reports queued before are applied to the ledger first
        (:meth:`poll` still returns their groups)."""
        if self._closed:
            return
        self._closed = True
        self._send.close()
        self._apply(None)
        self._receive.close()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            in_flight=self.ledger.in_flight,
            pending_groups=self.ledger.pending_groups,
            groups_admitted=self._admitted,
            decisions=self._decisions,
            sample_events=self._sample_events,
            group_events=self._group_events,
            wakeups=self._wakeups,
            queued=self.queued,
        )
