"""The checks a property and a state machine share, and the drivers they check, built the same
way by both: a sync driver's calls and batches, the async driver's state and batches, and the
resumed groups and the accounts of the credit loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal

import attrs

from ..rollout import (
    AsyncRolloutDriver,
    CreditLedger,
    FailurePolicy,
    GroupFactory,
    GroupOutcome,
    InMemorySource,
    SourceExhaustedError,
    SyncRolloutDriver,
    open_async_rollout,
    reject_aborted,
)
from ..samples import Group, OpenGroup, PolicyVersion, Prompt, Sample, SampleStatus
from ._errors import Invariant
from ._world import World

#: The engine's moves in a schedule (``settle`` drawn three times as often as the others).
ENGINE_STEPS = ["settle", "settle", "settle all", "fail together", "advance"]


def prompts(n: int) -> InMemorySource:
    """A source of ``n`` prompts ``p0``, ``p1``, ..."""
    return InMemorySource([Prompt(f"p{i}", (i,)) for i in range(n)])


def resumed_group(factory: GroupFactory, i: int, group_size: int, arrived: int) -> Group:
    """Prompt ``p{i}`` resumed as group ``r{i}`` with ``min(arrived, group_size)`` completed
    members already in (as a checkpoint hands them back)."""
    members = [
        Sample(
            index=10_000 + 100 * i + k,
            group_index=10_000 + i,
            prompt_tokens=(i,),
            status=SampleStatus.COMPLETED,
        )
        for k in range(min(arrived, group_size))
    ]
    return factory.resume(OpenGroup(f"r{i}", Prompt(f"p{i}", (i,)), group_size, members))


def sync_driver(
    world: World,
    source: InMemorySource,
    factory: GroupFactory,
    *,
    per_admission: int,
    filtering: bool,
    partial: bool,
) -> SyncRolloutDriver:
    """The real sync driver over ``world``'s runner and policy; the world reads its ledger."""
    driver = SyncRolloutDriver(
        source,
        factory,
        world.group_runner,
        policy=world.policy,
        groups_per_admission=per_admission,
        dynamic_filter=reject_aborted if filtering else None,
        partial_rollouts=partial,
    )
    world.ledger = lambda: driver.scheduler.ledger if driver.scheduler is not None else None
    return driver


@attrs.define(eq=False)
class SyncCalls:
    """The consumer of a sync driver: one :meth:`call` is one ``generate`` call, checked for
    ``SYNC_BATCH_SHAPE``; :meth:`awake` is ``NO_LOST_WAKEUP`` while a call runs."""

    world: World
    driver: SyncRolloutDriver
    source: InMemorySource
    factory: GroupFactory
    batch_size: int
    group_size: int
    filtering: bool
    partial: bool
    allow_partial: bool
    calls: int = 0
    handed_out: set[str] = attrs.field(factory=set)

    async def call(self) -> bool:
        """One ``generate`` call and its checks; False once the source is exhausted."""
        world, driver, source = self.world, self.driver, self.source
        t, g = self.batch_size, self.group_size
        first = self.factory.next_sample_index
        try:
            batch = await driver.generate(t, allow_partial=self.allow_partial)
        except SourceExhaustedError:
            world.check(
                source.exhausted,
                Invariant.SYNC_BATCH_SHAPE,
                "SourceExhaustedError raised but the source has prompts",
            )
            world.log(f"call {self.calls + 1}: source exhausted")
            return False
        self.calls += 1
        groups = batch.groups
        world.log(f"call {self.calls} returned {len(groups)} groups")
        check_batch(world, groups, t, g, partial_ok=not batch.complete)
        world.check(
            batch.complete or (self.allow_partial and source.exhausted),
            Invariant.SYNC_BATCH_SHAPE,
            f"partial batch of {len(groups)} while prompts remain",
        )
        if self.partial:
            # Partial rollouts keep finished and part-way groups for the next call.
            again = [gr.group_id for gr in groups if gr.group_id in self.handed_out]
            world.check(
                not again,
                Invariant.SYNC_BATCH_SHAPE,
                f"group {again[:1]} was handed out by an earlier call",
            )
        else:
            world.check(
                all(gr.first_index >= first for gr in groups),
                Invariant.SYNC_BATCH_SHAPE,
                "a group started by an earlier call was carried over",
            )
        self.handed_out.update(gr.group_id for gr in groups)
        if self.filtering:
            world.check(
                not any(gr.has_aborted for gr in groups),
                Invariant.SYNC_BATCH_SHAPE,
                "aborted group accepted",
            )
        world.check(
            driver.scheduler is None, Invariant.SYNC_BATCH_SHAPE, "scheduler survived the call"
        )
        world.check(
            not world.engine.running and not world.recorder.open_groups,
            Invariant.SYNC_BATCH_SHAPE,
            "groups still running after generate() returned",
        )
        return True

    def awake(self) -> None:
        """``NO_LOST_WAKEUP`` while a call runs (every task blocked)."""
        if self.driver.scheduler is None:
            return
        # Once the batch is full, partial rollouts set the abort signal and wait for the
        # leftovers to settle: no more submissions in this call.
        stopping = any(
            c.request.abort is not None and c.request.abort.is_set()
            for c in self.world.engine.running
        )
        self.world.check_awake(
            budget=self.world.last_budget(),
            group_size=self.group_size,
            may_submit=not self.source.exhausted and not stopping,
        )


def check_batch(world: World, groups: Sequence[Group], t: int, g: int, *, partial_ok: bool) -> None:
    """``SYNC_BATCH_SHAPE`` of one batch: ``t`` groups (fewer only if ``partial_ok``) of ``g``
    samples, sorted by first index, each once, each completed with every sample finished."""
    world.check(
        len(groups) == t or (partial_ok and 0 < len(groups) < t),
        Invariant.SYNC_BATCH_SHAPE,
        f"batch of {len(groups)} groups, expected {t}",
    )
    world.check(
        all(gr.size == g for gr in groups),
        Invariant.SYNC_BATCH_SHAPE,
        f"group sizes {[gr.size for gr in groups]}, expected {g}",
    )
    firsts = [gr.first_index for gr in groups]
    world.check(
        firsts == sorted(firsts),
        Invariant.SYNC_BATCH_SHAPE,
        f"batch not sorted by first index: {firsts}",
    )
    ids = [gr.group_id for gr in groups]
    world.check(
        len(set(ids)) == len(ids), Invariant.SYNC_BATCH_SHAPE, "a group appears twice in one batch"
    )
    for gr in groups:
        record = world.recorder.groups.get(gr.group_id)
        world.check(
            record is not None and record.outcome == "completed",
            Invariant.SYNC_BATCH_SHAPE,
            f"group {gr.group_id} in the batch did not complete "
            f"({None if record is None else record.outcome})",
        )
        world.check(
            all(s.status is not SampleStatus.PENDING for s in gr.samples),
            Invariant.SYNC_BATCH_SHAPE,
            f"group {gr.group_id} in the batch has unfinished samples",
        )


@contextlib.asynccontextmanager
async def async_driver(
    world: World,
    source: InMemorySource,
    ledger: CreditLedger,
    *,
    batch_size: int,
    group_size: int,
    budget: int,
    capacity: int,
    staleness: int | None,
    aborted: Literal["recycle", "drop"],
    failure: Literal["skip", "retry"],
) -> AsyncIterator[AsyncRolloutDriver]:
    """The real fully-async driver over ``world``'s runner and policy, keeping its accounts in
    ``ledger`` (checked: ``CREDITS_MATCH_PENDING_SAMPLES``)."""
    world.ledger = lambda: ledger
    async with open_async_rollout(
        source,
        GroupFactory(group_size),
        world.group_runner,
        batch_size=batch_size,
        policy=world.policy,
        max_groups_in_flight=budget,
        buffer_capacity=capacity,
        max_staleness=staleness,
        aborted=aborted,
        on_failure=FailurePolicy(failure, max_retries=1),
        ledger=ledger,
    ) as driver:
        world.check(
            driver.scheduler.ledger is ledger,
            Invariant.CREDITS_MATCH_PENDING_SAMPLES,
            "the driver keeps another ledger",
        )
        yield driver


def check_async_batch(
    world: World,
    batch: Sequence[Group],
    version_at_call: PolicyVersion,
    *,
    batch_size: int,
    group_size: int,
    staleness: int | None,
    source: InMemorySource,
) -> None:
    """A batch of the async driver: its shape (partial only once the source is exhausted) and,
    with ``staleness``, no group staler than that at the version of the call."""
    check_batch(world, batch, batch_size, group_size, partial_ok=source.exhausted)
    if staleness is not None:
        world.check(
            all(gr.staleness(version_at_call) <= staleness for gr in batch),
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            f"a group staler than {staleness} versions was handed to the consumer",
        )


def check_async_state(
    world: World,
    driver: AsyncRolloutDriver,
    *,
    budget: int,
    group_size: int,
    capacity: int,
    source: InMemorySource,
    paused_at: int | None,
    submissions: int,
) -> None:
    """``ASYNC_BOUNDED_PAUSED_CLOSED`` while the driver runs (the buffer within ``capacity``;
    ``submissions``, every group submission so far, still ``paused_at`` while paused) and
    ``NO_LOST_WAKEUP``."""
    stats = driver.statistics()
    world.check(
        stats.buffered <= capacity,
        Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
        f"buffer holds {stats.buffered} groups, capacity {capacity}",
    )
    if paused_at is not None:
        world.check(
            submissions == paused_at,
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            f"{submissions - paused_at} groups submitted while paused",
        )
    alive = driver.failure is None
    world.check_awake(
        budget=budget,
        group_size=group_size,
        may_submit=alive
        and not driver.is_paused
        and stats.buffered < capacity
        and not source.exhausted,
        drains=alive and stats.buffered < capacity,
    )


def count_outcome(world: World, outcome: GroupOutcome, outcomes: dict[str, int]) -> None:
    """A credit loop was handed ``outcome``: ``OUTCOME_AFTER_SAMPLES_SETTLE`` (its group has
    ended), and it is counted in ``outcomes``."""
    record = world.recorder.groups.get(outcome.group_id)
    world.recorder.check(
        record is not None and record.ended,
        Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
        f"outcome of group {outcome.group_id} delivered before it ended",
    )
    outcomes[outcome.group_id] = outcomes.get(outcome.group_id, 0) + 1


def check_credit_loop_awake(
    world: World, outcomes: Mapping[str, int], *, budget: int, group_size: int, may_submit: bool
) -> None:
    """``NO_LOST_WAKEUP`` while a credit loop runs: every group that ended had its outcome
    delivered, and the loop is not asleep while it could submit."""
    undelivered = [
        gid for gid, r in world.recorder.groups.items() if r.ended and gid not in outcomes
    ]
    world.check(
        not undelivered,
        Invariant.NO_LOST_WAKEUP,
        f"the driver is asleep although group {undelivered[:1]} ended and its outcome "
        "was never delivered",
    )
    world.check_awake(budget=budget, group_size=group_size, may_submit=may_submit)


def check_credit_loop_end(
    world: World, ledger: CreditLedger, outcomes: Mapping[str, int], groups: int
) -> None:
    """A credit loop that ran ``groups`` groups to the end: the ledger holds nothing, and each
    group's outcome was delivered exactly once."""
    world.check(
        ledger.in_flight == 0 and ledger.opened == ledger.returned and ledger.pending_groups == 0,
        Invariant.CREDITS_MATCH_PENDING_SAMPLES,
        f"run over but ledger holds {ledger.in_flight} credits "
        f"(opened {ledger.opened}, returned {ledger.returned})",
    )
    world.check(
        len(outcomes) == groups and all(v == 1 for v in outcomes.values()),
        Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
        f"{groups} groups ran but outcomes were delivered as {sorted(outcomes.values())}",
    )
