"""The fully-async driver (reference ``FullyAsyncRolloutFn``): a worker keeps engines busy.

:func:`open_async_rollout` is an ``async with`` service: it owns a nursery holding one worker
task, which owns a nursery holding one task per running group. Finished groups go into a
bounded buffer; the trainer pulls batches with :meth:`AsyncRolloutDriver.next_batch`.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Literal, Protocol

import attrs
import trio
import trio_util

from ..policy import PolicyVersionCell, as_cell
from ..samples import Group, GroupBook, PolicyVersion, ResumedGroup, Sample
from ._credits import (
    CreditLedger,
    CreditScheduler,
    GroupOutcome,
    GroupStatus,
    SampleBackfill,
    SubmissionPolicy,
)
from ._errors import (
    DriverFailed,
    FailureBudgetExceeded,
    GroupFailed,
    RolloutConfigError,
    RolloutError,
    SourceExhausted,
)
from ._factory import GroupFactory
from ._group import GroupRunner, pending_samples
from ._sources import DataSource
from ._sync import DynamicFilter
from ._validate import (
    check_choice,
    check_int,
    check_optional_int,
    non_negative_int,
    optional_positive_int,
)

__all__ = [
    "AsyncDriverStatistics",
    "DiscardHook",
    "DiscardReason",
    "AsyncRolloutDriver",
    "FailurePolicy",
    "UnusedPolicy",
    "open_async_rollout",
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
    :meth:`~AsyncRolloutDriver.next_batch` raises :class:`DriverFailed`.

    ``max_consecutive_failures`` bounds a run that only fails (an engine refusing every
    request): when that many group attempts in a row fail (retries count; any group that
    finishes resets the count), the driver stops and the consumer's next call raises
    :class:`DriverFailed` whose cause is :class:`FailureBudgetExceeded`, itself caused by the
    last :class:`GroupFailed`. ``None`` removes the bound.
    """

    action: Literal["skip", "retry", "fail"] = attrs.field(default="skip")
    max_retries: int = attrs.field(default=1, validator=non_negative_int)
    max_consecutive_failures: int | None = attrs.field(default=100, validator=optional_positive_int)

    @action.validator
    def _check_action(self, attribute: attrs.Attribute[str], value: str) -> None:
        check_choice("FailurePolicy", attribute.name, value, ("skip", "retry", "fail"))


@attrs.frozen
class AsyncDriverStatistics:
    """Counters of a fully-async driver since it opened (a snapshot).

    ``submitted`` counts group starts (retries included); ``buffered`` is the buffer's
    current size; ``consumed`` groups were handed to the consumer. ``max_staleness`` and
    ``mean_staleness`` are over consumed groups.
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


class _Wakeup(Protocol):
    """The typed face of :class:`trio_util.RepeatedEvent` (trio-util ships no annotations):
    ``set`` wakes every current waiter, nothing is latched."""

    def set(self) -> None: ...

    async def wait(self) -> None: ...


class AsyncRolloutDriver:
    """The handle :func:`open_async_rollout` yields. Create it through that function."""

    def __init__(
        self,
        source: DataSource,
        factory: GroupFactory,
        runner: GroupRunner,
        *,
        batch_size: int,
        policy: SubmissionPolicy,
        max_groups_in_flight: int,
        buffer_capacity: int,
        max_staleness: int | None,
        stale: UnusedPolicy,
        aborted: UnusedPolicy,
        on_failure: FailurePolicy,
        dynamic_filter: DynamicFilter | None,
        policy_version: PolicyVersion | PolicyVersionCell,
        on_discard: DiscardHook | None = None,
        book: GroupBook | None = None,
        ledger: CreditLedger | None = None,
    ) -> None:
        self.source = source
        self.factory = factory
        self.runner = runner
        self.batch_size = batch_size
        self.max_groups_in_flight = max_groups_in_flight
        self.buffer_capacity = buffer_capacity
        self.max_staleness = max_staleness
        self.stale = stale
        self.aborted = aborted
        self.on_failure = on_failure
        self.dynamic_filter = dynamic_filter
        self.on_discard = on_discard
        #: The one owner of work in flight, told of every group's life (see `GroupBook`).
        self.book = book
        #: The worker's scheduler; inspect ``scheduler.ledger`` for credits in flight.
        self.scheduler = CreditScheduler(policy, factory.group_size, ledger=ledger)
        #: The shared policy-version cell (the orchestrator's, when it opened the driver).
        self.version = as_cell(policy_version)
        self._queued: deque[Group] = deque()  # resumed and retried groups, before new prompts
        self._buffer: deque[Group] = deque()
        # repeatable wake-ups (nothing latched): buffer, failure, dryness or close changed
        # (consumer side); buffer space freed (worker side)
        self._changed: _Wakeup = trio_util.RepeatedEvent()  # type: ignore[no-untyped-call]
        self._space: _Wakeup = trio_util.RepeatedEvent()  # type: ignore[no-untyped-call]
        self._pauses = 0
        self._dry = False
        self._closed = False
        self._failure: BaseException | None = None
        self._retries: dict[str, int] = {}
        self._consecutive_failures = 0
        self._running: dict[str, Group] = {}
        self._submitted = self._completed = self._consumed = self._failed = self._retried = 0
        self._aborted_dropped = self._aborted_recycled = 0
        self._stale_dropped = self._stale_recycled = 0
        self._filtered: Counter[str] = Counter()
        self._max_staleness = 0
        self._staleness_total = 0

    # -- consumer side ------------------------------------------------------------------

    @property
    def policy_version(self) -> PolicyVersion:
        return self.version.value

    @property
    def failure(self) -> BaseException | None:
        """Why the worker stopped, or None while it runs (or after a clean close).

        Set once, when the worker fails (a group failure under ``FailurePolicy("fail")``, a
        failure budget exceeded, an error in the source or a hook); from then on the worker
        admits nothing and :meth:`next_batch` raises :class:`DriverFailed` chained to it.
        Cancellation of the worker (leaving the block) is not a failure.
        """
        return self._failure

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Advance the shared version cell (after a weight update); see
        :meth:`PolicyVersionCell.advance` (a smaller version raises ``PolicyVersionError``, a
        ``ValueError``). New groups open at this version and staleness is judged against it."""
        self.version.advance(version)

    @property
    def is_paused(self) -> bool:
        return self._pauses > 0

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Stop new submissions while the block runs (evaluation, weight update).

        Groups already running go on and finished groups are still buffered. Pauses nest;
        submission resumes when the last one exits (also on error or cancellation).
        """
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if not self._closed and self._pauses == 0:
                self.scheduler.nudge("resume")

    def resume(self, groups: Iterable[ResumedGroup]) -> None:
        """Queue resumed groups; the worker starts them before any new prompt."""
        self._queued.extend(self.factory.resume(g) for g in groups)
        if not self._closed:
            self.scheduler.nudge("resumed groups")

    async def next_batch(
        self, batch_size: int | None = None, *, allow_partial: bool = False
    ) -> list[Group]:
        """Take ``batch_size`` (default: the driver's) groups, sorted by first sample index.

        Staleness is judged here, as each group is taken: a group whose staleness exceeds
        ``max_staleness`` is dropped or recycled (and another is waited for). Waits while the
        buffer is empty. Raises :class:`DriverFailed` (with the worker's error as cause) if
        the worker failed, even when groups are buffered. When the source is exhausted and
        nothing is running, raises :class:`SourceExhausted`, or with ``allow_partial`` returns
        the groups taken so far (if any).

        On cancellation, groups already taken by this call go back to the front of the buffer.
        """
        size = self.batch_size if batch_size is None else batch_size
        check_int("AsyncRolloutDriver.next_batch", "batch_size", size, minimum=1)
        batch: list[Group] = []
        try:
            while len(batch) < size:
                group = await self._take()
                if group is None:
                    if allow_partial and batch:
                        break
                    raise SourceExhausted(
                        f"data source exhausted with {len(batch)} of {size} groups available"
                    )
                if self._judge_staleness(group):
                    batch.append(group)
        except BaseException:
            self._buffer.extendleft(reversed(batch))
            raise
        self._consumed += len(batch)
        for group in batch:
            staleness = group.staleness(self.version.value)
            self._staleness_total += staleness
            self._max_staleness = max(self._max_staleness, staleness)
        batch.sort(key=lambda g: g.first_index)
        return batch

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise DriverFailed(f"rollout worker failed: {self._failure!r}") from self._failure
        if self._closed:
            raise RolloutError("the rollout driver is closed")

    async def _take(self) -> Group | None:
        while True:
            self._raise_if_failed()
            if self._buffer:
                group = self._buffer.popleft()
                self._space.set()
                return group
            if self._dry:
                return None
            await self._changed.wait()

    def _judge_staleness(self, group: Group) -> bool:
        if self.max_staleness is None or group.staleness(self.version.value) <= self.max_staleness:
            return True
        if self.stale == "recycle":
            self._stale_recycled += 1
            self._recycle(group)
        else:
            self._stale_dropped += 1
        self._discard(group, "stale")
        return False

    def _discard(self, group: Group, reason: DiscardReason) -> None:
        if self.book is not None:
            self.book.group_discarded(group, reason)
        if self.on_discard is not None:
            self.on_discard(group, reason)

    def _recycle(self, group: Group) -> None:
        self.source.recycle(group.prompt)
        self._dry = False
        if not self._closed:
            self.scheduler.nudge("recycled")

    def buffered_groups(self) -> list[Group]:
        """The finished groups waiting in the buffer, oldest first (for a checkpoint)."""
        return list(self._buffer)

    def open_groups(self) -> list[ResumedGroup]:
        """Every group the driver holds, as :class:`ResumedGroup` (for a checkpoint).

        Running groups, groups queued for a retry or a resume and not yet started, and finished
        groups still in the buffer (the consumer has not taken them). Each keeps its id, prompt
        and start version; its finished samples (COMPLETED or TRUNCATED) are the arrived
        members, so resuming it regenerates only the rest (nothing, for a buffered group).
        """
        groups = [*self._running.values(), *self._queued, *self._buffer]
        return [
            ResumedGroup(
                group_id=g.group_id,
                prompt=g.prompt,
                group_size=g.size,
                arrived=[s for s in g.samples if s.status.is_finished],
                policy_version_at_start=g.policy_version_at_start,
            )
            for g in groups
        ]

    def statistics(self) -> AsyncDriverStatistics:
        ledger = self.scheduler.ledger
        return AsyncDriverStatistics(
            policy_version=self.version.value,
            paused=self.is_paused,
            submitted=self._submitted,
            completed=self._completed,
            in_flight_groups=ledger.pending_groups,
            in_flight_samples=ledger.in_flight,
            buffered=len(self._buffer),
            consumed=self._consumed,
            failed=self._failed,
            retried=self._retried,
            aborted_dropped=self._aborted_dropped,
            aborted_recycled=self._aborted_recycled,
            stale_dropped=self._stale_dropped,
            stale_recycled=self._stale_recycled,
            filtered=dict(self._filtered),
            max_staleness=self._max_staleness,
            mean_staleness=self._staleness_total / self._consumed if self._consumed else 0.0,
        )

    # -- worker side --------------------------------------------------------------------

    def _next_group(self) -> Group | None:
        if self._queued:
            return self._queued.popleft()
        try:
            prompt = self.source.take()
        except SourceExhausted:
            return None
        return self.factory.make(prompt, self.version.value)

    async def _run(self) -> None:
        """The worker; records its failure for the consumer instead of raising."""
        try:
            async with trio.open_nursery() as groups:
                await self._work(groups)
        except Exception as exc:
            self._failure = _first_real(exc)
            logger.error("rollout worker failed", exc_info=self._failure)
        finally:
            self.scheduler.poll()  # settle the ledger: every group task has ended by now
            self._changed.set()

    async def _work(self, groups: trio.Nursery) -> None:
        scheduler = self.scheduler
        outcomes: deque[GroupOutcome] = deque()
        while True:
            # Reap until nothing is queued: reaping may wait on backpressure, and events that
            # arrive meanwhile must be applied before the next decision.
            while True:
                outcomes.extend(_in_index_order(scheduler.poll()))
                if not outcomes:
                    break
                await self._reap(outcomes.popleft())
            budget = self.max_groups_in_flight
            while not self.is_paused and scheduler.admits(budget):
                group = self._next_group()
                if group is None:
                    break
                scheduler.submitted(group.group_id, pending_samples(group))
                self._running[group.group_id] = group
                self._submitted += 1
                if self.book is not None:
                    self.book.group_opened(group)
                groups.start_soon(self._run_group, group)
            dry = (
                scheduler.ledger.pending_groups == 0
                and not self._queued
                and self.source.exhausted
                and not self.is_paused
            )
            if dry != self._dry:
                self._dry = dry
                self._changed.set()
            outcomes.extend(_in_index_order(await scheduler.wait_for_progress()))

    async def _run_group(self, group: Group) -> None:
        """One group's task: :func:`~trio_rl.rollout.run_reporting`, with each finished member
        reported to the book as it arrives (so a checkpoint holds it)."""
        book, report, gid = self.book, self.scheduler.sample_done, group.group_id

        def sample_done(sample: Sample) -> None:
            report(gid)
            if book is not None and sample.status.is_finished:
                book.members_arrived(group, (sample,))

        status, error = GroupStatus.CANCELLED, None
        try:
            await self.runner.run(group, on_sample_done=sample_done)
            status = GroupStatus.COMPLETED
        except GroupFailed as exc:
            status, error = GroupStatus.FAILED, exc
        finally:
            self.scheduler.group_done(GroupOutcome(group, status, error))

    async def _reap(self, outcome: GroupOutcome) -> None:
        group = outcome.group
        if self._keep(outcome):
            # backpressure: while the buffer is full nothing new is submitted
            while len(self._buffer) >= self.buffer_capacity:
                await self._space.wait()
            self._buffer.append(group)
            self._changed.set()
        # Only now: a finished group waiting for buffer space still counts as running for
        # open_groups(), so a checkpoint taken meanwhile does not lose it.
        self._running.pop(group.group_id, None)

    def _keep(self, outcome: GroupOutcome) -> bool:
        """Book a finished group; True if it goes to the buffer."""
        group = outcome.group
        if outcome.status is GroupStatus.FAILED:
            assert outcome.error is not None
            self._handle_failure(group, outcome.error)
            return False
        self._consecutive_failures = 0
        self._completed += 1
        if group.has_aborted:
            if self.aborted == "recycle":
                self._aborted_recycled += 1
                self._recycle(group)
            else:
                self._aborted_dropped += 1
            self._discard(group, "aborted")
            return False
        reason = self.dynamic_filter(group) if self.dynamic_filter else None
        if reason is not None:
            self._filtered[reason] += 1
            self._discard(group, "filtered")
            return False
        return True

    def _handle_failure(self, group: Group, error: GroupFailed) -> None:
        action = self.on_failure.action
        if action == "fail":
            raise error
        self._consecutive_failures += 1
        budget = self.on_failure.max_consecutive_failures
        if budget is not None and self._consecutive_failures >= budget:
            raise FailureBudgetExceeded(
                f"{self._consecutive_failures} group attempts in a row failed "
                f"(FailurePolicy.max_consecutive_failures={budget}); last: {error}"
            ) from error
        tries = self._retries.get(group.group_id, 0)
        if action == "retry" and tries < self.on_failure.max_retries:
            self._retries[group.group_id] = tries + 1
            self._retried += 1
            if self.book is not None:
                # the attempt settles in the books before its samples are reset
                self.book.attempt_failed(group)
            for sample in group.samples:
                sample.reset_for_retry()
            self._queued.appendleft(group)
            logger.warning("rollout group %s failed; retry %d", group.group_id, tries + 1)
            return
        self._retries.pop(group.group_id, None)
        self._failed += 1
        logger.error("rollout group %s failed; skipping it", group.group_id, exc_info=error)
        self._discard(group, "failed")


def _in_index_order(outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
    # Groups that finish at the same (virtual) instant report in whatever order trio ran their
    # tasks, which trio deliberately varies; reaping them by first sample index keeps the
    # buffer, and so every batch, independent of that order.
    outcomes.sort(key=lambda o: o.group.first_index)
    return outcomes


def _first_real(exc: BaseException) -> BaseException:
    """The first leaf of an exception group that is not a cancellation (or ``exc`` itself)."""
    if isinstance(exc, BaseExceptionGroup):
        for leaf in exc.exceptions:
            found = _first_real(leaf)
            if not isinstance(found, trio.Cancelled):
                return found
    return exc


@asynccontextmanager
async def open_async_rollout(
    source: DataSource,
    factory: GroupFactory,
    runner: GroupRunner,
    *,
    batch_size: int,
    policy: SubmissionPolicy | None = None,
    max_groups_in_flight: int | None = None,
    max_samples_in_flight: int | None = None,
    buffer_capacity: int | None = None,
    max_staleness: int | None = None,
    stale: UnusedPolicy = "drop",
    aborted: UnusedPolicy = "recycle",
    on_failure: FailurePolicy | None = None,
    dynamic_filter: DynamicFilter | None = None,
    resumed: Iterable[ResumedGroup] = (),
    policy_version: PolicyVersion | PolicyVersionCell = 0,
    on_discard: DiscardHook | None = None,
    book: GroupBook | None = None,
    ledger: CreditLedger | None = None,
) -> AsyncIterator[AsyncRolloutDriver]:
    """Run a fully-async rollout worker for the duration of the block.

    The worker keeps up to ``B`` groups' worth of work running under ``policy`` (default
    :class:`SampleBackfill`): ``B`` is ``max_groups_in_flight``, or ``max(1,
    max_samples_in_flight // G)``, or ``batch_size``. Finished groups are filtered (aborted
    ones dropped or recycled per ``aborted``; ``dynamic_filter`` drops by reason) and put
    into a buffer of ``buffer_capacity`` groups (default ``2 x batch_size``); when it is full,
    production pauses. ``policy_version`` is a starting version or the pipeline's shared
    :class:`~trio_rl.policy.PolicyVersionCell`. ``resumed`` groups start before any new
    prompt. ``on_discard`` is told of every finished group that will not reach the consumer
    (failed and skipped, aborted, filtered, stale). ``book`` (e.g. the train sink's
    ``sink.book``) is the one owner of work in flight: it is told of every group the worker
    submits, every finished member as it arrives, every failed attempt and every discard
    (:class:`~trio_rl.samples.GroupBook`), so its state is a checkpoint's. ``ledger`` is
    the empty :class:`CreditLedger` the worker's scheduler keeps its books in (default a new
    one); pass your own (a subclass, say) to observe every credit the worker hands out.

    Leaving the block cancels every running group and the worker, and waits for them: no
    task outlives it. Groups still buffered are discarded; save state first if needed.
    """
    where = "open_async_rollout"
    check_int(where, "batch_size", batch_size, minimum=1)
    check_optional_int(where, "max_groups_in_flight", max_groups_in_flight, minimum=1)
    check_optional_int(where, "max_samples_in_flight", max_samples_in_flight, minimum=1)
    check_optional_int(where, "buffer_capacity", buffer_capacity, minimum=1)
    check_optional_int(where, "max_staleness", max_staleness, minimum=0)
    if not isinstance(policy_version, PolicyVersionCell):
        check_int(where, "policy_version", policy_version, minimum=0)
    check_choice(where, "stale", stale, ("drop", "recycle"))
    check_choice(where, "aborted", aborted, ("drop", "recycle"))
    if max_groups_in_flight is None:
        if max_samples_in_flight is not None:
            if max_samples_in_flight < factory.group_size:
                raise RolloutConfigError(
                    f"open_async_rollout.max_samples_in_flight ({max_samples_in_flight}) is "
                    f"below the group size ({factory.group_size})"
                )
            max_groups_in_flight = max(1, max_samples_in_flight // factory.group_size)
        else:
            max_groups_in_flight = batch_size
    capacity = 2 * batch_size if buffer_capacity is None else buffer_capacity
    driver = AsyncRolloutDriver(
        source,
        factory,
        runner,
        batch_size=batch_size,
        policy=policy if policy is not None else SampleBackfill(),
        max_groups_in_flight=max_groups_in_flight,
        buffer_capacity=capacity,
        max_staleness=max_staleness,
        stale=stale,
        aborted=aborted,
        on_failure=on_failure if on_failure is not None else FailurePolicy(),
        dynamic_filter=dynamic_filter,
        policy_version=policy_version,
        on_discard=on_discard,
        book=book,
        ledger=ledger,
    )
    driver.resume(resumed)
    # The body's exception is re-raised outside the nursery, so callers see it unwrapped.
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver._run)
            try:
                yield driver
            except BaseException as exc:
                body_error = exc
            finally:
                nursery.cancel_scope.cancel()
        if body_error is not None:
            raise body_error
    finally:
        driver._closed = True
        driver._changed.set()
        driver.scheduler.close()
