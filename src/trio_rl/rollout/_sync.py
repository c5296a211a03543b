"""The sync batch driver (reference ``generate_rollout_async``): exactly T accepted groups."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping

import attrs
import trio

from .._validation import check_int, check_optional_int, check_optional_positive_finite
from ..engines import AbortsAll, AbortSignal
from ..samples import Group, OpenGroup, PolicyVersion, Prompt, SampleStatus
from ._credits import (
    CreditScheduler,
    GroupGranularity,
    GroupOutcome,
    GroupStatus,
    SubmissionPolicy,
)
from ._errors import FailureBudgetExceededError, RolloutError, SourceExhaustedError
from ._factory import GroupFactory
from ._group import GroupRunner, pending_samples, reopen_aborted, run_reporting
from ._sources import DataSource

__all__ = [
    "DynamicFilter",
    "RolloutBatch",
    "SyncBatchStatistics",
    "SyncRolloutDriver",
    "recycled_prompt",
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

    ``submitted`` groups were started (continued partial groups included); ``accepted`` passed
    the filter and are in the batch (``carried_in`` of them finished during an earlier call);
    ``filtered`` counts drops by reason; ``failed`` groups raised (and were replaced);
    ``surplus`` finished and passed the filter after the batch was full (kept for the next call
    with ``partial_rollouts``, else discarded); ``partial`` were stopped by the abort with their
    partial generations kept for the next call; ``cancelled`` were still running when the batch
    was full and were cancelled (no abort, or it timed out); ``recycled`` prompts of cancelled
    groups went back to the source.
    """

    submitted: int = 0
    accepted: int = 0
    filtered: Mapping[str, int] = attrs.field(factory=dict)
    failed: int = 0
    surplus: int = 0
    cancelled: int = 0
    recycled: int = 0
    partial: int = 0
    carried_in: int = 0


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


def recycled_prompt(group: Group) -> Prompt:
    """``group``'s prompt, carrying its samples' routing keys for the group made from it again.

    The keys ride in ``prompt.metadata["routing_keys"]`` (plain strings, so they survive the
    source's saved state); :meth:`GroupFactory.make` gives them back to the new samples by
    position, so a recycled group returns to the engines that cache its prefixes.
    """
    keys = [s.routing_key for s in group.samples]
    if all(k is None for k in keys):
        return group.prompt
    return attrs.evolve(group.prompt, metadata={**group.prompt.metadata, "routing_keys": keys})


def _give_back(
    finished: deque[Group],
    partial: deque[Group],
    carried: list[Group],
    continued: list[Group],
    accepted: list[Group],
) -> None:
    """A call that ends abnormally gives back what it took from the kept groups: the finished
    ones it carried in, and the partial ones it continued (unless they made the batch)."""
    finished.extendleft(reversed(carried))
    taken = {id(g) for g in accepted}
    for group in reversed(continued):
        if id(group) in taken:
            continue
        for sample in group.samples:  # untouched by the cancelled call: keep as it was
            if sample.status is SampleStatus.PENDING:
                sample.status = SampleStatus.ABORTED
        partial.appendleft(group)


async def _stop_leftovers(
    driver: SyncRolloutDriver,
    scheduler: CreditScheduler,
    abort: AbortSignal,
    settled: list[GroupOutcome],
) -> None:
    """The batch is full: stop the groups still out, before they are cancelled.

    With ``engine_abort``, every running request is aborted at the engines first, as miles
    posts ``abort_all`` to every engine worker (an SGLang server ends them all with finish
    reason ``abort``; a vLLM server aborts each as its client leaves, which stopping the
    leftovers does). With ``partial_rollouts``, the soft stop: the abort signal is set,
    engines return their partial output, and the groups settle within ``abort_timeout``.
    """
    if driver.engine_abort is not None and scheduler.ledger.pending_groups:
        await driver.engine_abort.abort_all()
    if driver.partial_rollouts:
        abort.set()
        with trio.move_on_after(driver.abort_timeout):
            while scheduler.ledger.pending_groups:
                settled.extend(await scheduler.wait_for_progress())


class SyncRolloutDriver:
    """Produces batches of exactly ``T`` accepted groups, one call at a time.

    Each :meth:`generate` call uses a fresh :class:`CreditScheduler` with budget
    ``B = T - accepted``. Every admission fetches ``groups_per_admission`` groups (the
    reference's over-sampling batch size O; default ``None`` is T, as in the reference).
    Unlike the reference, an O below T is allowed: the budget still admits groups until B are
    pending, so a smaller O only fetches in smaller chunks (tighter, less overshoot) and never
    under-fills a batch. Finished groups go through the ``dynamic_filter``; a failed group is
    logged, counted and replaced by a new prompt (``max_failures`` per call, default 100,
    bounds this, so an engine that always fails cannot eat the whole source: one more failure
    raises :class:`FailureBudgetExceededError`; ``None`` removes the bound).

    **Partial rollouts** (``partial_rollouts=True``, the reference's ``--partial-rollout``):
    once the batch is full the leftovers are aborted, not cancelled (an :class:`AbortSignal`
    seen as :func:`~trio_rl.rollout.current_abort`); engines return their partial output.
    Groups stopped part-way are kept (``metadata["start_rollout_id"]`` stamped) and continued
    by the next call before any new prompt; groups that finish anyway and surplus are kept
    whole and fill the next batch first (:meth:`held_groups`). Groups still running after
    ``abort_timeout`` seconds are cancelled and their prompts recycled. Without it leftovers
    are cancelled and surplus discarded, as in the reference. Details: docs/rollout.md.

    Resumed groups (:meth:`resume`) start after the kept partial groups, before new prompts.
    ``engine_abort`` (e.g. the :class:`~trio_rl.engines.EngineFleet`) aborts the leftovers at
    the engines first (see `_stop_leftovers`).
    """

    def __init__(
        self,
        source: DataSource,
        factory: GroupFactory,
        runner: GroupRunner,
        *,
        policy: SubmissionPolicy | None = None,
        groups_per_admission: int | None = None,
        dynamic_filter: DynamicFilter | None = None,
        partial_rollouts: bool = False,
        abort_timeout: float = 30.0,
        max_failures: int | None = 100,
        engine_abort: AbortsAll | None = None,
    ) -> None:
        where = "SyncRolloutDriver"
        check_optional_int(where, "groups_per_admission", groups_per_admission, minimum=1)
        check_optional_int(where, "max_failures", max_failures, minimum=0)
        check_optional_positive_finite(where, "abort_timeout", abort_timeout)
        self.source = source
        self.factory = factory
        self.runner = runner
        self.policy: SubmissionPolicy = policy if policy is not None else GroupGranularity()
        self.groups_per_admission = groups_per_admission
        self.dynamic_filter = dynamic_filter
        self.partial_rollouts = partial_rollouts
        self.abort_timeout = abort_timeout
        self.max_failures = max_failures
        self.engine_abort = engine_abort
        self._resumed: deque[OpenGroup] = deque()
        #: Finished groups kept from an earlier call (partial rollouts), oldest first.
        self._finished: deque[Group] = deque()
        #: Groups stopped part-way by an abort, continued by the next call.
        self._partial: deque[Group] = deque()
        #: How many calls have started (the reference's rollout id of the current call).
        self.rollout_id = -1
        #: The scheduler of the call in progress (None between calls); for inspection.
        self.scheduler: CreditScheduler | None = None

    def resume(self, groups: Iterable[OpenGroup]) -> None:
        """Queue resumed groups; the next :meth:`generate` starts them before new prompts."""
        self._resumed.extend(groups)

    def held_groups(self) -> list[Group]:
        """The groups kept for the next call: finished ones, then partial ones (not copies)."""
        return [*self._finished, *self._partial]

    def _next_group(self, policy_version: PolicyVersion, continued: list[Group]) -> Group | None:
        if self._partial:
            group = self._partial.popleft()
            reopen_aborted(group)
            continued.append(group)
            return group
        if self._resumed:
            return self.factory.resume(self._resumed.popleft(), policy_version)
        try:
            prompt = self.source.take()
        except SourceExhaustedError:
            return None
        return self.factory.make(prompt, policy_version)

    def _keep_partial(self, group: Group) -> None:
        for sample in group.samples:
            if sample.completion_tokens:
                sample.metadata.setdefault("start_rollout_id", self.rollout_id)
        self._partial.append(group)

    async def generate(
        self,
        batch_size: int,
        *,
        policy_version: PolicyVersion = 0,
        allow_partial: bool = False,
    ) -> RolloutBatch:
        """Return exactly ``batch_size`` accepted groups, sorted by first sample index.

        When the source runs dry before that, raise :class:`SourceExhaustedError` (after every
        started group has finished), or return the accepted groups as a partial batch
        (``complete=False``) with ``allow_partial``. Once the batch is full, groups still
        running are aborted and kept (``partial_rollouts``) or cancelled (see the class
        docstring).

        Any other error (a failing source or filter, ``max_failures`` exceeded) cancels the
        running groups, gives the prompts of the groups accepted so far back to the source, and
        propagates unwrapped. On cancellation every group started by this call is cancelled
        and settled before ``trio.Cancelled`` propagates; nothing keeps running. After either,
        the groups kept from an earlier call are kept again (a continued partial group with
        the output it had; work it gained during the call is lost).
        """
        # The call's state (the groups accepted and carried, the counters, the abort signal, a
        # fatal error) is shared by the admission loop, the soft stop and the give-back in
        # ``finally``, so those stay in one body; the sorting of what settled after a full
        # batch and the batch itself are steps of their own.
        check_int("SyncRolloutDriver.generate", "batch_size", batch_size, minimum=1)
        if self.scheduler is not None:
            raise RolloutError("generate() is already running on this driver (one call at a time)")
        per_admission = self.groups_per_admission or batch_size
        scheduler = CreditScheduler(self.policy, self.factory.group_size)
        self.scheduler = scheduler
        self.rollout_id += 1
        accepted: list[Group] = []
        while self._finished and len(accepted) < batch_size:
            accepted.append(self._finished.popleft())
        carried_in = len(accepted)
        carried = list(accepted)
        continued: list[Group] = []
        returned = False
        filtered: Counter[str] = Counter()
        submitted = failed = 0
        dry = False
        fatal: Exception | None = None
        abort = AbortSignal()
        settled: list[GroupOutcome] = []
        try:
            async with trio.open_nursery() as nursery:
                try:
                    while len(accepted) < batch_size and fatal is None:
                        budget = batch_size - len(accepted)
                        while not dry and scheduler.admits(budget):
                            for _ in range(per_admission):
                                group = self._next_group(policy_version, continued)
                                if group is None:
                                    dry = True
                                    break
                                scheduler.submitted(group.group_id, pending_samples(group))
                                submitted += 1
                                nursery.start_soon(
                                    run_reporting, self.runner, group, scheduler, abort
                                )
                        if scheduler.ledger.pending_groups == 0:
                            break  # dry and nothing left to wait for
                        for outcome in await scheduler.wait_for_progress():
                            if outcome.status is GroupStatus.FAILED:
                                failed += 1
                                fatal = _failure(outcome, failed, self.max_failures)
                                if fatal is not None:
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
                                settled.append(outcome)
                    if fatal is None:
                        await _stop_leftovers(self, scheduler, abort, settled)
                except Exception as exc:  # raised below, outside the nursery: unwrapped
                    fatal = exc
                nursery.cancel_scope.cancel()  # leftovers: cancelled and settled on exit
            settled.extend(scheduler.poll())
            scheduler.ledger.check()
            if fatal is not None:
                for group in accepted[carried_in:]:  # accepted work is not lost: prompts go back
                    self.source.recycle(recycled_prompt(group))
                raise fatal
            returned = True
            leftovers = self._sort_leftovers(settled, abort, filtered)
        finally:
            if not returned:
                _give_back(self._finished, self._partial, carried, continued, accepted)
            scheduler.close()
            self.scheduler = None
        stats = SyncBatchStatistics(
            submitted=submitted,
            accepted=len(accepted),
            filtered=dict(filtered),
            failed=failed + leftovers.failed,
            surplus=leftovers.surplus,
            cancelled=leftovers.cancelled,
            recycled=leftovers.recycled,
            partial=leftovers.partial,
            carried_in=carried_in,
        )
        return _batch(accepted, stats, batch_size, allow_partial)

    def _sort_leftovers(
        self, settled: list[GroupOutcome], abort: AbortSignal, filtered: Counter[str]
    ) -> _Leftovers:
        """Sort the groups that settled after the batch was full: a cancelled group's prompt
        goes back (``partial_rollouts``), an aborted one is kept to continue, a finished one is
        kept for the next call (``partial_rollouts``) unless the filter rejects it."""
        cancelled = recycled = partial = failed = surplus = 0
        for outcome in settled:
            group = outcome.group
            if outcome.status is GroupStatus.CANCELLED:
                cancelled += 1
                if self.partial_rollouts:
                    self.source.recycle(recycled_prompt(group))
                    recycled += 1
            elif outcome.status is GroupStatus.FAILED:
                failed += 1
                logger.error(
                    "rollout group %s failed after the batch was full",
                    outcome.group_id,
                    exc_info=outcome.error,
                )
            elif abort.is_set() and group.has_aborted:
                self._keep_partial(group)
                partial += 1
            else:
                reason = self.dynamic_filter(group) if self.dynamic_filter else None
                if reason is not None:
                    filtered[reason] += 1
                    continue
                surplus += 1
                if self.partial_rollouts:
                    self._finished.append(group)
        return _Leftovers(cancelled, recycled, partial, failed, surplus)


def _failure(outcome: GroupOutcome, failed: int, max_failures: int | None) -> Exception | None:
    """Log a group that failed before the batch was full (another replaces it); the error
    that ends the call once ``max_failures`` is exceeded."""
    logger.error("rollout group %s failed; replacing it", outcome.group_id, exc_info=outcome.error)
    if max_failures is None or failed <= max_failures:
        return None
    fatal = FailureBudgetExceededError(
        f"{failed} groups failed in one batch (SyncRolloutDriver.max_failures="
        f"{max_failures}); last: {outcome.error}"
    )
    fatal.__cause__ = outcome.error
    return fatal


@attrs.frozen
class _Leftovers:
    """How the groups settled after a full batch were sorted."""

    cancelled: int
    recycled: int
    partial: int
    failed: int
    surplus: int


def _batch(
    accepted: list[Group], stats: SyncBatchStatistics, batch_size: int, allow_partial: bool
) -> RolloutBatch:
    """The accepted groups in order of their first sample, or the error of a dry source."""
    accepted.sort(key=lambda g: g.first_index)
    if len(accepted) < batch_size:
        if not allow_partial or not accepted:
            raise SourceExhaustedError(
                f"data source exhausted with {len(accepted)} of {batch_size} groups "
                f"accepted ({stats.failed} failed, {sum(stats.filtered.values())} filtered)"
            )
        return RolloutBatch(tuple(accepted), stats, complete=False)
    return RolloutBatch(tuple(accepted), stats)
