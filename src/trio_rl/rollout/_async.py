"""The fully-async driver (reference ``FullyAsyncRolloutFn``): a worker keeps engines busy.

:func:`open_async_rollout` is an ``async with`` service: it owns a nursery holding one worker
task, which owns a nursery holding one task per running group. Finished groups go into a
bounded buffer; the trainer pulls batches with :meth:`AsyncRolloutDriver.next_batch`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import trio

from .._validation import check_choice, check_int, check_optional_int
from ..policy import PolicyVersionCell, as_cell
from ..samples import Group, GroupBook, OpenGroup, PolicyVersion
from ._buffer import GroupBuffer
from ._credits import (
    CreditLedger,
    CreditScheduler,
    GroupOutcome,
    SampleBackfill,
    SubmissionPolicy,
)
from ._errors import (
    DriverFailedError,
    RolloutConfigError,
    RolloutError,
    SourceExhaustedError,
)
from ._expiry import Admission, Expiry
from ._factory import GroupFactory
from ._group import START_BATCH, GroupRunner, pending_samples
from ._sources import DataSource
from ._sync import DynamicFilter, recycled_prompt
from ._triage import (
    AsyncDriverStatistics,
    DiscardHook,
    FailurePolicy,
    GroupTriage,
    UnusedPolicy,
)
from ._wind_down import wind_down

__all__ = ["AsyncRolloutDriver", "open_async_rollout"]

logger = logging.getLogger("trio_rl.rollout")

#: The name of every group task (trio would otherwise format one per spawn).
_GROUP_TASK = "trio_rl.rollout.group"


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
        triage: GroupTriage,
        policy_version: PolicyVersion | PolicyVersionCell,
        book: GroupBook | None = None,
        ledger: CreditLedger | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.source = source
        self.factory = factory
        self.runner = runner
        self.batch_size = batch_size
        self.max_groups_in_flight = max_groups_in_flight
        self.buffer_capacity = buffer_capacity
        #: The one owner of work in flight, told of every group's life (see `GroupBook`).
        self.book = book
        #: The fate of every finished group (retry, skip, drop, recycle; discards reported).
        self.triage = triage
        triage.recycle, triage.retry = self._recycle, self._queue_retry
        self._tally = triage.tally
        #: The worker's scheduler; inspect ``scheduler.ledger`` for credits in flight.
        self.scheduler = CreditScheduler(policy, factory.group_size, ledger=ledger)
        #: The shared policy-version cell (the orchestrator's, when it opened the driver).
        self.version = as_cell(policy_version)
        self._queued: deque[Group] = deque()  # resumed and retried groups, before new prompts
        self._buffer = GroupBuffer(buffer_capacity)
        self._pauses = 0
        self._dry = False
        self._closed = False
        self._failure: BaseException | None = None
        self._running: dict[str, Group] = {}
        self.expiry = Expiry(admission, self)

    # -- consumer side ------------------------------------------------------------------

    @property
    def policy_version(self) -> PolicyVersion:
        return self.version.value

    @property
    def failure(self) -> BaseException | None:
        """Why the worker stopped, or None while it runs (or after a clean close).

        Set once, when the worker fails (a group failure under ``FailurePolicy("fail")``, a
        failure budget exceeded, an error in the source or a hook); from then on the worker
        admits nothing and :meth:`next_batch` raises :class:`DriverFailedError` chained to it.
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

    async def aresume(self, groups: Iterable[OpenGroup]) -> None:
        """Queue resumed groups (their new members stamped with the current version); the
        worker starts them before any new prompt. A checkpoint every ``START_BATCH`` groups
        lets a cancellation into a resume of any size; cancelled, the groups made so far stay
        queued."""
        made = 0
        version = self.version.value
        try:
            for g in groups:
                self._queued.append(self.factory.resume(g, version))
                made += 1
                if made % START_BATCH == 0:
                    await trio.lowlevel.checkpoint()
        finally:
            if made and not self._closed:
                self.scheduler.nudge("resumed groups")

    async def next_batch(
        self, batch_size: int | None = None, *, allow_partial: bool = False
    ) -> list[Group]:
        """Take ``batch_size`` (default: the driver's) groups, sorted by first sample index.

        Staleness is judged here, as each group is taken: a group whose staleness exceeds
        ``max_staleness`` is dropped or recycled (and another is waited for). Waits while the
        buffer is empty. Raises :class:`DriverFailedError` (with the worker's error as cause) if
        the worker failed, even when groups are buffered. When the source is exhausted and
        nothing is running, raises :class:`SourceExhaustedError`, or with ``allow_partial`` returns
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
                    raise SourceExhaustedError(
                        f"data source exhausted with {len(batch)} of {size} groups available"
                    )
                if self.triage.fresh_enough(group, self.version.value):
                    batch.append(group)
        except BaseException:
            self._buffer.give_back(batch)
            raise
        self._tally.consumed_batch(batch, self.version.value)
        batch.sort(key=lambda g: g.first_index)
        return batch

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise DriverFailedError(f"rollout worker failed: {self._failure!r}") from self._failure
        if self._closed:
            raise RolloutError("the rollout driver is closed")

    async def _take(self) -> Group | None:
        while True:
            self._raise_if_failed()
            group = self._buffer.pop()
            if group is not None:
                return group
            if self._dry:
                return None
            await self._buffer.changed.wait()

    def _recycle(self, group: Group) -> None:
        # The prompt carries the samples' routing keys, so the group made from it again goes
        # back to the engines that cache its prefixes (as the sync driver's recycles do).
        self.source.recycle(recycled_prompt(group))
        self._dry = False
        if not self._closed:
            self.scheduler.nudge("recycled")

    def _queue_retry(self, group: Group) -> None:
        self._queued.appendleft(group)

    def buffered_groups(self) -> list[Group]:
        """The finished groups waiting in the buffer (not yet taken), oldest first."""
        return list(self._buffer)

    def held_groups(self) -> list[OpenGroup]:
        """Every group the driver holds (running, queued for a retry or resume, buffered) as an
        :class:`OpenGroup` of its finished members: a view, e.g. for ``Orchestrator.held_groups``.
        A checkpoint saves the ``book`` the driver reports to (the sink's), never this view.
        """
        groups = [*self._running.values(), *self._queued, *self._buffer]
        return [
            OpenGroup(
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
        return self._tally.statistics(
            policy_version=self.version.value,
            paused=self.is_paused,
            in_flight_groups=ledger.pending_groups,
            in_flight_samples=ledger.in_flight,
            buffered=len(self._buffer),
        )


# -- the worker: module functions over the driver it serves (its consumer side is the class)


def _next_group(d: AsyncRolloutDriver) -> Group | None:
    if d._queued:
        return d._queued.popleft()
    try:
        prompt = d.source.take()
    except SourceExhaustedError:
        return None
    return d.factory.make(prompt, d.version.value)


async def _run_worker(d: AsyncRolloutDriver) -> None:
    """The worker; records its failure for the consumer instead of raising."""
    try:
        async with trio.open_nursery() as groups:
            await _work(d, groups)
    except Exception as exc:
        d._failure = _first_real(exc)
        logger.error("rollout worker failed", exc_info=d._failure)
    finally:
        d.scheduler.poll()  # settle the ledger: every group task has ended by now
        d._buffer.changed.set()


async def _work(d: AsyncRolloutDriver, groups: trio.Nursery) -> None:
    scheduler = d.scheduler
    # Reports made before the worker started (a resume's nudge) are applied first.
    outcomes: deque[GroupOutcome] = deque(_in_index_order(scheduler.poll()))
    while True:
        # Reap until nothing is left: reaping may wait on backpressure, and reports that
        # arrive meanwhile must be applied before the next decision (a wait applied every
        # report made before it returned, so with nothing to reap there is nothing to poll).
        while outcomes:
            await _reap(d, outcomes.popleft())
            if not outcomes:
                outcomes.extend(_in_index_order(scheduler.poll()))
        budget = d.max_groups_in_flight
        admitted: list[Group] = []
        while not d.is_paused and scheduler.admits(budget):
            if not d._queued and d.expiry.blocks():
                break
            group = _next_group(d)
            if group is None:
                break
            scheduler.submitted(group.group_id, pending_samples(group))
            d._running[group.group_id] = group
            d._tally.submitted += 1
            if d.book is not None:
                d.book.group_opened(group)
            admitted.append(group)
            if len(admitted) == START_BATCH:
                await _start_groups(d, groups, admitted)
                # a huge budget lets a cancellation in between batches of group starts
                # (after the starts: a group taken is always submitted, booked and started)
                await trio.lowlevel.checkpoint()
        await _start_groups(d, groups, admitted)
        dry = (
            scheduler.ledger.pending_groups == 0
            and not d._queued
            and d.source.exhausted
            and not d.is_paused
        )
        if dry != d._dry:
            d._dry = dry
            d._buffer.changed.set()
        outcomes.extend(_in_index_order(await scheduler.wait_for_progress()))


async def _start_groups(d: AsyncRolloutDriver, groups: trio.Nursery, admitted: list[Group]) -> None:
    """Start the admitted groups' tasks, in order, with a schedule point after each start.

    Every decision was taken before the first start, on the ledger as of the last drain, as
    if the tasks had started with it. The schedule point (shielded: an admitted group always
    starts) lets each group start its samples before the next group's task is made: a refill
    then allocates and frees a group at a time instead of making the whole budget's tasks,
    contexts and coroutines first. Speed over a straight loop, measured: on the scheduler
    benchmark's zero-latency samples (part B, GC on, 1k / 10k / 100k in flight) full
    collections 3 / 5 / 53 -> 0 / 0 / 7 per run and CPU per sample down by 30-50 %, since
    those samples finish before the rest of the refill is built; with every task alive at
    once, as engine latency keeps them (``benchmarks/held_wave.py``, 100k), full collections
    down by a quarter to a third and CPU per sample unchanged.
    """
    for group in admitted:
        groups.start_soon(d.expiry.run, group, name=_GROUP_TASK)
        await trio.lowlevel.cancel_shielded_checkpoint()
    admitted.clear()


async def _reap(d: AsyncRolloutDriver, outcome: GroupOutcome) -> None:
    group = outcome.group
    if not d.expiry.take(outcome) and d.triage.keep(outcome):
        await d._buffer.put(group)  # backpressure: nothing is submitted meanwhile
    # Only now: a finished group waiting for buffer space still counts as running for
    # held_groups(), so a count taken meanwhile does not miss it.
    d._running.pop(group.group_id, None)


def _group_budget(max_samples_in_flight: int | None, group_size: int, batch_size: int) -> int:
    """The groups in flight without ``max_groups_in_flight``: as many as ``max_samples_in_flight``
    holds, else ``batch_size``."""
    if max_samples_in_flight is None:
        return batch_size
    if max_samples_in_flight < group_size:
        raise RolloutConfigError(
            f"open_async_rollout.max_samples_in_flight ({max_samples_in_flight}) is "
            f"below the group size ({group_size})"
        )
    return max(1, max_samples_in_flight // group_size)


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
    resumed: Iterable[OpenGroup] = (),
    policy_version: PolicyVersion | PolicyVersionCell = 0,
    on_discard: DiscardHook | None = None,
    book: GroupBook | None = None,
    ledger: CreditLedger | None = None,
    admission: Admission | None = None,
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
    the empty :class:`CreditLedger` the worker's scheduler keeps its accounts in (default a new
    one); pass your own (a subclass, say) to observe every credit the worker hands out.
    ``admission`` (see :class:`Admission`) holds back new groups whose work could no longer
    be trained in time and cancels running ones whose work expired (call
    ``driver.expiry.reconsider()`` when what it reads changes).

    Leaving the block stops submission, lets work that is ready finish (a sample whose reply
    has arrived completes, as does its group; a group whose task has not started does not
    start; a few scheduling passes, no waiting), then cancels every running group and the
    worker, and waits for them: no task outlives it. Groups still buffered are discarded;
    save state first if needed.
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
        max_groups_in_flight = _group_budget(max_samples_in_flight, factory.group_size, batch_size)
    capacity = 2 * batch_size if buffer_capacity is None else buffer_capacity
    driver = AsyncRolloutDriver(
        source,
        factory,
        runner,
        batch_size=batch_size,
        policy=policy if policy is not None else SampleBackfill(),
        max_groups_in_flight=max_groups_in_flight,
        buffer_capacity=capacity,
        triage=GroupTriage(
            on_failure=on_failure if on_failure is not None else FailurePolicy(),
            aborted=aborted,
            stale=stale,
            max_staleness=max_staleness,
            dynamic_filter=dynamic_filter,
            book=book,
            on_discard=on_discard,
        ),
        policy_version=policy_version,
        book=book,
        ledger=ledger,
        admission=admission,
    )
    await driver.aresume(resumed)
    # The body's exception is re-raised outside the nursery, so callers see it unwrapped.
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run_worker, driver)
            try:
                yield driver
            except BaseException as exc:
                body_error = exc
            finally:
                driver._pauses += 1  # never resumed: the driver is closing
                await wind_down(driver.scheduler)
                nursery.cancel_scope.cancel()
        if body_error is not None:
            raise body_error
    finally:
        driver._closed = True
        driver._buffer.changed.set()
        driver.scheduler.close()
