"""What becomes of a group the fully-async worker has run: the triage and its tally.

:class:`GroupTriage` decides, on the event loop, the fate of every finished group (kept for the
consumer, retried, skipped, dropped or recycled) and reports each discard to the book of work
in flight and the ``on_discard`` hook; :class:`AsyncTally` counts it all for
:meth:`~trio_rl.rollout.AsyncRolloutDriver.statistics`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import attrs

from .._validation import check_choice, non_negative_int, optional_positive_int
from ..samples import Group, GroupBook, PolicyVersion
from ._credits import GroupOutcome, GroupStatus
from ._errors import FailureBudgetExceededError, GroupFailedError, RolloutError
from ._sync import DynamicFilter

__all__ = [
    "AsyncDriverStatistics",
    "AsyncTally",
    "DiscardHook",
    "DiscardReason",
    "FailurePolicy",
    "GroupTriage",
    "UnusedPolicy",
]

logger = logging.getLogger("trio_rl.rollout")

#: What to do with a stale or aborted group: drop it, or give its prompt back to the source.
UnusedPolicy = Literal["drop", "recycle"]

#: Why a finished group was not handed to the consumer (see ``on_discard``).
DiscardReason = Literal["failed", "aborted", "filtered", "stale"]
#: Told, on the event loop, of every group the driver discards. Must not block or raise.
DiscardHook = Callable[[Group, DiscardReason], None]


@attrs.frozen
class FailurePolicy:
    """What the worker does when a group fails.

    ``"skip"``: log and count it, start a new prompt instead. ``"retry"``: reset its samples
    (keeping indices, seeds and routing keys) and run the same group again, up to
    ``max_retries`` times, then skip it. ``"fail"``: stop the driver; the consumer's next
    :meth:`~AsyncRolloutDriver.next_batch` raises :class:`DriverFailedError`.

    ``max_consecutive_failures`` bounds a run that only fails (an engine refusing every
    request): when that many group attempts in a row fail (retries count; any group that
    finishes resets the count), the driver stops and the consumer's next call raises
    :class:`DriverFailedError` whose cause is :class:`FailureBudgetExceededError`, itself
    caused by the last :class:`GroupFailedError`. ``None`` removes the bound.
    """

    action: Literal["skip", "retry", "fail"] = attrs.field(
        default="skip",
        metadata={
            "help": "what a failed group does: skip (count it, start a new prompt), retry (run "
            "it again, then skip it once its retries are spent) or fail (stop the run)"
        },
    )
    max_retries: int = attrs.field(
        default=1,
        validator=non_negative_int,
        metadata={"help": "retries of a failed group (action retry) before it is skipped"},
    )
    max_consecutive_failures: int | None = attrs.field(
        default=100,
        validator=optional_positive_int,
        metadata={
            "help": "group attempts in a row that may fail before the run stops (unset: no bound)"
        },
    )

    @action.validator
    def _check_action(self, attribute: attrs.Attribute[str], value: str) -> None:
        check_choice("FailurePolicy", attribute.name, value, ("skip", "retry", "fail"))


@attrs.frozen
class AsyncDriverStatistics:
    """Counters of a fully-async driver since it opened (a snapshot).

    ``submitted`` counts group starts (retries included); ``buffered`` is the buffer's
    current size; ``consumed`` groups were handed to the consumer. ``max_staleness`` and
    ``mean_staleness`` are over consumed groups. ``cancelled_stale`` groups
    (``cancelled_stale_samples`` samples) were cancelled while running because their work
    could no longer be trained in time; ``held_back`` counts admission decisions the driver's
    :class:`~trio_rl.rollout.Admission` refused.
    """

    policy_version: PolicyVersion
    paused: bool
    submitted: int
    completed: int
    in_flight_groups: int
    in_flight_samples: int
    buffered: int
    consumed: int
    failed: int
    retried: int
    aborted_dropped: int
    aborted_recycled: int
    stale_dropped: int
    stale_recycled: int
    filtered: Mapping[str, int]
    max_staleness: int
    mean_staleness: float
    cancelled_stale: int = 0
    cancelled_stale_samples: int = 0
    held_back: int = 0


@attrs.define(slots=True, eq=False)
class AsyncTally:
    """The driver's running counts (see :class:`AsyncDriverStatistics` for their meaning)."""

    submitted: int = 0
    completed: int = 0
    consumed: int = 0
    failed: int = 0
    retried: int = 0
    aborted_dropped: int = 0
    aborted_recycled: int = 0
    stale_dropped: int = 0
    stale_recycled: int = 0
    filtered: Counter[str] = attrs.field(factory=Counter)
    max_staleness: int = 0
    staleness_total: int = 0
    cancelled_stale: int = 0
    cancelled_stale_samples: int = 0
    held_back: int = 0

    def consumed_batch(self, batch: Sequence[Group], version: PolicyVersion) -> None:
        self.consumed += len(batch)
        for group in batch:
            staleness = group.staleness(version)
            self.staleness_total += staleness
            self.max_staleness = max(self.max_staleness, staleness)

    def statistics(
        self,
        *,
        policy_version: PolicyVersion,
        paused: bool,
        in_flight_groups: int,
        in_flight_samples: int,
        buffered: int,
    ) -> AsyncDriverStatistics:
        return AsyncDriverStatistics(
            policy_version=policy_version,
            paused=paused,
            submitted=self.submitted,
            completed=self.completed,
            in_flight_groups=in_flight_groups,
            in_flight_samples=in_flight_samples,
            buffered=buffered,
            consumed=self.consumed,
            failed=self.failed,
            retried=self.retried,
            aborted_dropped=self.aborted_dropped,
            aborted_recycled=self.aborted_recycled,
            stale_dropped=self.stale_dropped,
            stale_recycled=self.stale_recycled,
            filtered=dict(self.filtered),
            max_staleness=self.max_staleness,
            mean_staleness=self.staleness_total / self.consumed if self.consumed else 0.0,
            cancelled_stale=self.cancelled_stale,
            cancelled_stale_samples=self.cancelled_stale_samples,
            held_back=self.held_back,
        )


def _unbound(group: Group) -> None:
    raise RolloutError(f"group {group.group_id}: the triage is not bound to a driver")


@attrs.define(slots=True, eq=False, kw_only=True)
class GroupTriage:
    """The fate of each finished group, decided on the event loop.

    A failed group is retried (``retry`` queues it again, after the book has settled the
    attempt), skipped or stops the driver per ``on_failure``; an aborted one is dropped or its
    prompt recycled per ``aborted``; ``dynamic_filter`` drops by reason; a group staler than
    ``max_staleness`` when the consumer takes it is dropped or recycled per ``stale``. Every
    discard is reported to ``book`` and ``on_discard``.
    """

    on_failure: FailurePolicy
    aborted: UnusedPolicy
    stale: UnusedPolicy
    max_staleness: int | None
    dynamic_filter: DynamicFilter | None
    book: GroupBook | None = None
    on_discard: DiscardHook | None = None
    tally: AsyncTally = attrs.field(factory=AsyncTally)
    #: Gives a group's prompt back to the source (the driver binds it).
    recycle: Callable[[Group], None] = _unbound
    #: Queues a failed group (its samples reset) to run again before new prompts (the driver
    #: binds it).
    retry: Callable[[Group], None] = _unbound
    retries: dict[str, int] = attrs.field(factory=dict)
    consecutive_failures: int = 0

    def keep(self, outcome: GroupOutcome) -> bool:
        """Decide a finished group's fate; True if it goes to the buffer. Raises when the driver
        must stop (``FailurePolicy("fail")``, or the failure budget is spent)."""
        group = outcome.group
        if outcome.status is GroupStatus.FAILED:
            assert outcome.error is not None
            self._failed(group, outcome.error)
            return False
        self.consecutive_failures = 0
        self.tally.completed += 1
        if group.has_aborted:
            if self.aborted == "recycle":
                self.tally.aborted_recycled += 1
                self.recycle(group)
            else:
                self.tally.aborted_dropped += 1
            self.discard(group, "aborted")
            return False
        reason = self.dynamic_filter(group) if self.dynamic_filter else None
        if reason is not None:
            self.tally.filtered[reason] += 1
            self.discard(group, "filtered")
            return False
        return True

    def fresh_enough(self, group: Group, version: PolicyVersion) -> bool:
        """Judge a group the consumer takes; a stale one is discarded (dropped or recycled)."""
        if self.max_staleness is None or group.staleness(version) <= self.max_staleness:
            return True
        if self.stale == "recycle":
            self.tally.stale_recycled += 1
            self.recycle(group)
        else:
            self.tally.stale_dropped += 1
        self.discard(group, "stale")
        return False

    def discard(
        self, group: Group, reason: DiscardReason, error: BaseException | None = None
    ) -> None:
        if self.book is not None:
            if error is None:
                self.book.group_discarded(group, reason)
            else:
                self.book.group_discarded(group, reason, error)
        if self.on_discard is not None:
            self.on_discard(group, reason)

    def _failed(self, group: Group, error: GroupFailedError) -> None:
        action = self.on_failure.action
        if action == "fail":
            raise error
        self.consecutive_failures += 1
        budget = self.on_failure.max_consecutive_failures
        if budget is not None and self.consecutive_failures >= budget:
            raise FailureBudgetExceededError(
                f"{self.consecutive_failures} group attempts in a row failed "
                f"(FailurePolicy.max_consecutive_failures={budget}); last: {error}"
            ) from error
        tries = self.retries.get(group.group_id, 0)
        if action == "retry" and tries < self.on_failure.max_retries:
            self.retries[group.group_id] = tries + 1
            self.tally.retried += 1
            if self.book is not None:
                # the attempt settles in the book before its samples are reset
                self.book.attempt_failed(group, error)
            for sample in group.samples:
                sample.reset_for_retry()
            self.retry(group)
            logger.warning("rollout group %s failed; retry %d", group.group_id, tries + 1)
            return
        self.retries.pop(group.group_id, None)
        self.tally.failed += 1
        logger.error("rollout group %s failed; skipping it", group.group_id, exc_info=error)
        self.discard(group, "failed", error)
