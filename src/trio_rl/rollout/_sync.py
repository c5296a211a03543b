"""The sync batch driver (reference ``generate_rollout_async``): exactly T accepted groups."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping

import attrs
import trio

from ..samples import Group, PolicyVersion, ResumedGroup
from ._credits import CreditScheduler, GroupGranularity, GroupStatus, SubmissionPolicy
from ._errors import FailureBudgetExceeded, RolloutError, SourceExhausted
from ._factory import GroupFactory
from ._group import GroupRunner, pending_samples, run_reporting
from ._sources import DataSource
from ._validate import check_int, check_optional_int

__all__ = [
    "DynamicFilter",
    "RolloutBatch",
    "SyncBatchStatistics",
    "SyncRolloutDriver",
    "reject_aborted",
]

logger = logging.getLogger("trio_rl.rollout")

#: Judges a finished group: returns a drop reason (counted under that name), or None to keep.
DynamicFilter = Callable[[Group], str | None]


def reject_aborted(group: Group) -> str | None:
    """A dynamic filter that drops every group holding an ABORTED sample (reason "aborted")."""
    return "aborted" if group.has_aborted else None


@attrs.frozen
class SyncBatchStatistics:
    """What happened while one batch was produced.

    ``submitted`` groups were started; ``accepted`` passed the filter and are in the batch;
    ``filtered`` counts drops by reason; ``failed`` groups raised (and were replaced);
    ``surplus`` finished after the batch was full (discarded); ``cancelled`` were still
    running when the batch was full; ``recycled`` prompts went back to the source.
    """

    submitted: int = 0
    accepted: int = 0
    filtered: Mapping[str, int] = attrs.field(factory=dict)
    failed: int = 0
    surplus: int = 0
    cancelled: int = 0
    recycled: int = 0


@attrs.frozen
class RolloutBatch:
    """The groups of one batch, sorted by first sample index, and how they were produced.

    ``complete`` is False only for a partial batch returned because the source ran dry.
    """

    groups: tuple[Group, ...]
    statistics: SyncBatchStatistics
    complete: bool = True

    def __len__(self) -> int:
        return len(self.groups)


class SyncRolloutDriver:
    """Produces batches of exactly ``T`` accepted groups, one call at a time.

    Each :meth:`generate` call uses a fresh :class:`CreditScheduler` (nothing carries over
    between calls) with budget ``B = T - accepted``. Every admission fetches
    ``groups_per_admission`` groups (the reference's over-sampling batch size O; 1 keeps the
    budget tight, larger values over-sample to absorb filter drops). Finished groups go through
    the ``dynamic_filter``; a failed group is logged, counted and replaced by a new prompt
    (``max_failures`` per call, default 100, bounds this, so an engine that always fails cannot
    eat the whole source: one more failure raises :class:`FailureBudgetExceeded`; ``None``
    removes the bound). Resumed groups (:meth:`resume`) are started before any new prompt.
    """

    def __init__(
        self,
        source: DataSource,
        factory: GroupFactory,
        runner: GroupRunner,
        *,
        policy: SubmissionPolicy | None = None,
        groups_per_admission: int = 1,
        dynamic_filter: DynamicFilter | None = None,
        partial_rollouts: bool = False,
        max_failures: int | None = 100,
    ) -> None:
        check_int("SyncRolloutDriver", "groups_per_admission", groups_per_admission, minimum=1)
        check_optional_int("SyncRolloutDriver", "max_failures", max_failures, minimum=0)
        self.source = source
        self.factory = factory
        self.runner = runner
        self.policy: SubmissionPolicy = policy if policy is not None else GroupGranularity()
        self.groups_per_admission = groups_per_admission
        self.dynamic_filter = dynamic_filter
        self.partial_rollouts = partial_rollouts
        self.max_failures = max_failures
        self._resumed: deque[ResumedGroup] = deque()
        #: The scheduler of the call in progress (None between calls); for inspection.
        self.scheduler: CreditScheduler | None = None

    def resume(self, groups: Iterable[ResumedGroup]) -> None:
        """Queue resumed groups; the next :meth:`generate` starts them before new prompts."""
        self._resumed.extend(groups)

    def _next_group(self, policy_version: PolicyVersion) -> Group | None:
        if self._resumed:
            return self.factory.resume(self._resumed.popleft())
        try:
            prompt = self.source.take()
        except SourceExhausted:
            return None
        return self.factory.make(prompt, policy_version)

    async def generate(
        self,
        batch_size: int,
        *,
        policy_version: PolicyVersion = 0,
        allow_partial: bool = False,
    ) -> RolloutBatch:
        """Return exactly ``batch_size`` accepted groups, sorted by first sample index.

        When the source runs dry before that, raise :class:`SourceExhausted` (after every
        started group has finished), or return the accepted groups as a partial batch
        (``complete=False``) with ``allow_partial``. Once the batch is full, groups still
        running are cancelled; with ``partial_rollouts`` their prompts go back to the source.

        Any other error (a failing source or filter, ``max_failures`` exceeded) cancels the
        running groups, gives the prompts of the groups accepted so far back to the source, and
        propagates unwrapped. On cancellation every group started by this call is cancelled
        and settled before ``trio.Cancelled`` propagates; nothing keeps running.
        """
        check_int("SyncRolloutDriver.generate", "batch_size", batch_size, minimum=1)
        if self.scheduler is not None:
            raise RolloutError("generate() is already running on this driver (one call at a time)")
        scheduler = CreditScheduler(self.policy, self.factory.group_size)
        self.scheduler = scheduler
        accepted: list[Group] = []
        filtered: Counter[str] = Counter()
        submitted = failed = surplus = 0
        dry = False
        fatal: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                try:
                    while len(accepted) < batch_size and fatal is None:
                        budget = batch_size - len(accepted)
                        while not dry and scheduler.admits(budget):
                            for _ in range(self.groups_per_admission):
                                group = self._next_group(policy_version)
                                if group is None:
                                    dry = True
                                    break
                                scheduler.submitted(group.group_id, pending_samples(group))
                                submitted += 1
                                nursery.start_soon(run_reporting, self.runner, group, scheduler)
                        if scheduler.ledger.pending_groups == 0:
                            break  # dry and nothing left to wait for
                        for outcome in await scheduler.wait_for_progress():
                            if outcome.status is GroupStatus.FAILED:
                                failed += 1
                                logger.error(
                                    "rollout group %s failed; replacing it",
                                    outcome.group_id,
                                    exc_info=outcome.error,
                                )
                                if self.max_failures is not None and failed > self.max_failures:
                                    fatal = FailureBudgetExceeded(
                                        f"{failed} groups failed in one batch "
                                        f"(SyncRolloutDriver.max_failures="
                                        f"{self.max_failures}); last: {outcome.error}"
                                    )
                                    fatal.__cause__ = outcome.error
                                    break
                                continue
                            reason = (
                                self.dynamic_filter(outcome.group) if self.dynamic_filter else None
                            )
                            if reason is not None:
                                filtered[reason] += 1
                            elif len(accepted) < batch_size:
                                accepted.append(outcome.group)
                            else:
                                surplus += 1
                except Exception as exc:  # raised below, outside the nursery: unwrapped
                    fatal = exc
                nursery.cancel_scope.cancel()  # leftovers: cancelled and settled on exit
            cancelled = recycled = 0
            for outcome in scheduler.poll():
                if outcome.status is GroupStatus.CANCELLED:
                    cancelled += 1
                    if self.partial_rollouts:
                        self.source.recycle(outcome.group.prompt)
                        recycled += 1
                else:
                    surplus += 1
            scheduler.ledger.check()
            if fatal is not None:
                for group in accepted:  # accepted work is not lost: its prompts go back
                    self.source.recycle(group.prompt)
                raise fatal
        finally:
            scheduler.close()
            self.scheduler = None
        stats = SyncBatchStatistics(
            submitted=submitted,
            accepted=len(accepted),
            filtered=dict(filtered),
            failed=failed,
            surplus=surplus,
            cancelled=cancelled,
            recycled=recycled,
        )
        accepted.sort(key=lambda g: g.first_index)
        if len(accepted) < batch_size:
            if not allow_partial or not accepted:
                raise SourceExhausted(
                    f"data source exhausted with {len(accepted)} of {batch_size} groups "
                    f"accepted ({failed} failed, {sum(filtered.values())} filtered)"
                )
            return RolloutBatch(tuple(accepted), stats, complete=False)
        return RolloutBatch(tuple(accepted), stats)
