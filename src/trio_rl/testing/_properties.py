"""The Hypothesis properties: one example is one adversarial schedule in MockClock time.

``check_credit_loop``, ``check_sync_driver`` and ``check_async_driver`` run one example from a
Hypothesis ``data`` object; the ``*_property`` functions wrap them into ready-made test
functions. Every step of every example checks the invariants of docs/testing.md; a violation raises
:class:`~trio_rl.testing.InvariantViolation` carrying the (shrunk) schedule.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
import trio
import trio.testing
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.database import ExampleDatabase

from ..rollout import (
    DriverFailed,
    FailurePolicy,
    GroupFactory,
    InMemorySource,
    RolloutError,
    SourceExhausted,
    SyncRolloutDriver,
    open_async_rollout,
    pending_samples,
    reject_aborted,
    run_reporting,
)
from ..samples import Group, OpenGroup, Prompt, Sample, SampleStatus
from ._recorder import TrackingLedger
from ._report import Invariant, live_tasks, unwrap_single
from ._subject import HANG_TIMEOUT, RolloutSubject
from ._world import World

__all__ = [
    "async_driver_property",
    "check_async_driver",
    "check_credit_loop",
    "check_sync_driver",
    "credit_loop_property",
    "sync_driver_property",
]

_ENGINE_STEPS = ["settle", "settle", "settle all", "fail together", "advance"]
#: Every phase but "explain", which re-runs failing examples under a tracer (slow, and the
#: schedule in the error already explains).
_PHASES = tuple(p for p in Phase if p is not Phase.explain)


def _run(
    data: st.DataObject, subject: RolloutSubject, body: Callable[[World], Awaitable[None]]
) -> None:
    clock = trio.testing.MockClock()
    worlds: list[World] = []

    async def main() -> None:
        world = World(data, subject, clock)
        worlds.append(world)
        await body(world)

    try:
        trio.run(main, clock=clock)
    except BaseException as exc:
        leaf = unwrap_single(exc)
        # Hypothesis's own control flow (end of data, ...) must reach Hypothesis untouched.
        if type(leaf).__module__.startswith("hypothesis"):
            raise leaf from None
        violation = worlds[0].recorder.violation if worlds else None
        if violation is not None:
            if leaf is violation:
                raise violation from None
            raise violation from leaf
        if leaf is not exc:
            raise leaf from None
        raise


# --------------------------------------------------------------------------- credit loop


def check_credit_loop(data: st.DataObject, subject: RolloutSubject | None = None) -> None:
    """One example: a minimal driver loop over ``subject``'s policy, scheduler and runner.

    Draws the group size, budget and number of groups (some of them resumed, with members
    already arrived), then a schedule of engine moves, budget changes and an optional early
    stop; the loop admits groups while the policy says so and reaps them from the scheduler.
    Checks the invariants from ``ONE_CREDIT_PER_SAMPLE`` to ``NO_DEADLOCK`` (see
    :class:`~trio_rl.testing.Invariant`) after every step, and at the end that every group
    ended exactly once and nothing is left running.
    """
    subject = subject if subject is not None else RolloutSubject()
    _run(data, subject, _credit_loop_body)


async def _credit_loop_body(world: World) -> None:
    g, budget, n, arrived = world.draw(
        st.tuples(
            st.integers(1, 4),
            st.integers(1, 4),
            st.integers(1, 8),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        "G, B, groups, members already arrived in the first (resumed) groups",
    )
    resumed = min(len(arrived), n)
    factory = GroupFactory(g)
    todo: deque[Group] = deque()
    for i in range(n):
        prompt = Prompt(f"p{i}", (i,))
        if i < resumed:
            members = [
                Sample(
                    index=10_000 + 100 * i + k,
                    group_index=10_000 + i,
                    prompt_tokens=(i,),
                    status=SampleStatus.COMPLETED,
                )
                for k in range(min(arrived[i], g))
            ]
            todo.append(factory.resume(OpenGroup(f"r{i}", prompt, g, members)))
        else:
            todo.append(factory.make(prompt))
    world.log(f"G={g} B={budget} groups={n} resumed={resumed}")
    total = len(todo)

    scheduler = world.subject.scheduler(world.policy, g)
    world.ledger = lambda: scheduler.ledger
    outcomes: dict[str, int] = {}
    state: dict[str, Any] = {"budget": budget, "done": False, "stopped": False}

    async def loop() -> None:
        async with trio.open_nursery() as nursery:
            while True:
                while todo and scheduler.admits(state["budget"]):
                    group = todo.popleft()
                    scheduler.submitted(group.group_id, pending_samples(group))
                    nursery.start_soon(run_reporting, world.group_runner, group, scheduler)
                if not todo and scheduler.ledger.pending_groups == 0:
                    break
                for outcome in await scheduler.wait_for_progress():
                    record = world.recorder.groups.get(outcome.group_id)
                    world.recorder.check(
                        record is not None and record.ended,
                        Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
                        f"outcome of group {outcome.group_id} delivered before it ended",
                    )
                    outcomes[outcome.group_id] = outcomes.get(outcome.group_id, 0) + 1
        state["done"] = True

    def awake() -> None:
        if state["done"] or state["stopped"]:
            return
        undelivered = [
            gid for gid, r in world.recorder.groups.items() if r.ended and gid not in outcomes
        ]
        world.check(
            not undelivered,
            Invariant.NO_LOST_WAKEUP,
            f"the driver is asleep although group {undelivered[:1]} ended and its outcome "
            "was never delivered",
        )
        world.check_awake(budget=state["budget"], group_size=g, may_submit=bool(todo))

    baseline = live_tasks()
    try:
        async with trio.open_nursery() as harness:
            harness.start_soon(loop)
            for step in world.schedule([*_ENGINE_STEPS, "budget", "stop"]):
                await world.quiesce()
                awake()
                if state["done"]:
                    break
                if step.action == "budget":
                    state["budget"] = step.value
                    world.log(f"budget -> {step.value}")
                    scheduler.nudge("budget")
                elif step.action == "stop":
                    world.log("stop: cancel the driver loop")
                    state["stopped"] = True
                    harness.cancel_scope.cancel()
                    break
                else:
                    await world.engine_step(step)
            if not state["stopped"]:
                await world.finish(
                    lambda: bool(state["done"]),
                    each_round=awake,
                    time_bound=HANG_TIMEOUT * (total + 2) * 4,
                )
    finally:
        scheduler.close()
    await world.quiesce()
    world.check_no_leftovers(baseline)
    if state["stopped"]:
        return
    ledger = scheduler.ledger
    world.check(
        ledger.in_flight == 0 and ledger.opened == ledger.returned and ledger.pending_groups == 0,
        Invariant.CREDITS_MATCH_PENDING_SAMPLES,
        f"run over but ledger holds {ledger.in_flight} credits "
        f"(opened {ledger.opened}, returned {ledger.returned})",
    )
    world.check(
        len(outcomes) == total and all(v == 1 for v in outcomes.values()),
        Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
        f"{total} groups ran but outcomes were delivered as {sorted(outcomes.values())}",
    )


def credit_loop_property(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made Hypothesis test of :func:`check_credit_loop` for ``subject``.

    Assign it to a module-level ``test_*`` name and pytest runs it. ``settings_`` defaults to
    the active profile with ``report_multiple_bugs=False`` and without the slow ``explain``
    phase.
    """
    return _property(check_credit_loop, subject, settings_)


def _property(
    check: Callable[[st.DataObject, RolloutSubject | None], None],
    subject: RolloutSubject | None,
    settings_: settings | None,
) -> Callable[[], None]:
    def test(data: st.DataObject, _random: Any) -> None:
        check(data, subject)

    test.__name__ = test.__qualname__ = check.__name__.replace("check_", "test_")
    chosen = (
        settings_ if settings_ is not None else settings(report_multiple_bugs=False, phases=_PHASES)
    )
    # Failing examples saved in Hypothesis's database are keyed by the test function, the same
    # for every subject; namespace the keys by the subject, so properties of different
    # subjects do not replay each other's examples.
    if subject is not None and chosen.database is not None:
        chosen = settings(
            chosen, database=SubjectDatabase(chosen.database, _subject_digest(subject))
        )
    # st.random_module() lets Hypothesis explore (and shrink) trio's task scheduling order.
    wrapped: Callable[[], None] = chosen(given(st.data(), st.random_module())(test))
    return wrapped


class SubjectDatabase(ExampleDatabase):
    """Another Hypothesis example database, with every key prefixed by a namespace."""

    def __init__(self, inner: ExampleDatabase, namespace: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = hashlib.sha256(namespace).digest()

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def _subject_digest(subject: RolloutSubject) -> bytes:
    def name(value: object) -> str:
        return (
            str(getattr(value, "__module__", ""))
            + "."
            + str(getattr(value, "__qualname__", type(value).__qualname__))
        )

    parts = [name(p) for p in subject.policies]
    parts += [name(subject.runner), name(subject.generate), name(subject.scheduler)]
    parts += [name(subject.rule), repr(subject.kinds), str(subject.max_steps)]
    return "|".join(parts).encode()


# --------------------------------------------------------------------------- sync driver


def check_sync_driver(data: st.DataObject, subject: RolloutSubject | None = None) -> None:
    """One example: the real :class:`~trio_rl.rollout.SyncRolloutDriver` over ``subject``.

    Draws ``T``, ``G``, over-sampling, the dynamic filter, partial rollouts and the number of
    calls, then an adversarial schedule. Checks the first six invariants after every step and
    ``SYNC_BATCH_SHAPE`` after every call: exactly ``T`` groups of ``G`` samples sorted by
    first index, all started by that call, everything else cancelled and settled (or
    :class:`SourceExhausted` with the source really exhausted).
    """
    subject = subject if subject is not None else RolloutSubject()
    _run(data, subject, _sync_body)


async def _sync_body(world: World) -> None:
    t, g, calls, over, spare, filtering, partial, allow_partial = world.draw(
        st.tuples(
            st.integers(1, 3),
            st.integers(1, 3),
            st.integers(1, 2),
            st.integers(1, 2),
            st.integers(0, 3),
            st.booleans(),
            st.booleans(),
            st.booleans(),
        ),
        "T, G, calls, groups per admission, spare prompts, reject aborted, partial "
        "rollouts, allow partial batch",
    )
    n = t * calls + spare
    world.log(f"T={t} G={g} calls={calls} O={over} prompts={n} filter={filtering}")
    source = InMemorySource([Prompt(f"p{i}", (i,)) for i in range(n)])
    factory = GroupFactory(g)
    driver = SyncRolloutDriver(
        source,
        factory,
        world.group_runner,
        policy=world.policy,
        groups_per_admission=over,
        dynamic_filter=reject_aborted if filtering else None,
        partial_rollouts=partial,
    )
    world.ledger = lambda: driver.scheduler.ledger if driver.scheduler is not None else None
    state: dict[str, Any] = {"done": False}

    sync = SyncCalls(world, driver, source, factory, t, g, filtering, partial, allow_partial)

    async def consumer() -> None:
        try:
            for _ in range(calls):
                if not await sync.call():
                    return
        finally:
            state["done"] = True

    def awake() -> None:
        if not state["done"]:
            sync.awake()

    baseline = live_tasks()
    async with trio.open_nursery() as harness:
        harness.start_soon(consumer)
        for step in world.schedule(_ENGINE_STEPS):
            await world.quiesce()
            awake()
            if state["done"]:
                break
            await world.engine_step(step)
        await world.finish(
            lambda: bool(state["done"]), each_round=awake, time_bound=HANG_TIMEOUT * (n + 2) * 4
        )
    world.check_no_leftovers(baseline)


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
        except SourceExhausted:
            world.check(
                source.exhausted,
                Invariant.SYNC_BATCH_SHAPE,
                "SourceExhausted raised but the source has prompts",
            )
            world.log(f"call {self.calls + 1}: source exhausted")
            return False
        self.calls += 1
        groups = batch.groups
        world.log(f"call {self.calls} returned {len(groups)} groups")
        _check_batch(world, groups, t, g, partial_ok=not batch.complete)
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


def _check_batch(
    world: World, groups: tuple[Group, ...] | list[Group], t: int, g: int, *, partial_ok: bool
) -> None:
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


def sync_driver_property(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made Hypothesis test of :func:`check_sync_driver` for ``subject``."""
    return _property(check_sync_driver, subject, settings_)


# --------------------------------------------------------------------------- async driver


def check_async_driver(data: st.DataObject, subject: RolloutSubject | None = None) -> None:
    """One example: the real fully-async driver (:func:`~trio_rl.rollout.open_async_rollout`).

    Draws the batch size, budget, buffer capacity, failure and aborted-group policies, then a
    schedule that interleaves engine moves with the consumer taking batches, pauses and
    resumes, weight updates and an early close. Checks the first six invariants after every
    step, and ``ASYNC_BOUNDED_PAUSED_CLOSED``:
    the buffer never exceeds its capacity, nothing is submitted while paused, and closing
    leaves no task, engine call or group running.
    """
    subject = subject if subject is not None else RolloutSubject()
    _run(data, subject, _async_body)


async def _async_body(world: World) -> None:
    t, g, budget, capacity, n, failure, aborted, staleness = world.draw(
        st.tuples(
            st.integers(1, 3),
            st.integers(1, 3),
            st.integers(1, 3),
            st.integers(1, 6),
            st.integers(1, 8),
            st.sampled_from(["skip", "retry"]),
            st.sampled_from(["recycle", "drop"]),
            st.sampled_from([None, 0, 1]),
        ),
        "T, G, B, buffer capacity, prompts, on failure, aborted groups, max staleness",
    )
    world.log(f"T={t} G={g} B={budget} capacity={capacity} prompts={n} {failure} {aborted}")
    source = InMemorySource([Prompt(f"p{i}", (i,)) for i in range(n)])
    taken: list[str] = []
    state: dict[str, Any] = {"consumer": False, "ended": False, "paused_at": None}

    # The driver keeps its books in a ledger that also counts re-submissions (retries).
    ledger = TrackingLedger()
    world.ledger = lambda: ledger

    baseline = live_tasks()
    async with trio.open_nursery() as harness:

        def submissions() -> int:
            # Every submission opens the group in the ledger (retries included).
            return sum(ledger.opens.values())

        async with (
            contextlib.AsyncExitStack() as pause_stack,
            open_async_rollout(
                source,
                GroupFactory(g),
                world.group_runner,
                batch_size=t,
                policy=world.policy,
                max_groups_in_flight=budget,
                buffer_capacity=capacity,
                max_staleness=staleness,
                aborted=aborted,
                on_failure=FailurePolicy(failure, max_retries=1),
                ledger=ledger,
            ) as driver,
        ):
            world.check(
                driver.scheduler.ledger is ledger,
                Invariant.CREDITS_MATCH_PENDING_SAMPLES,
                "the driver keeps another ledger",
            )

            async def consume() -> None:
                # Staleness is judged as each group is taken, at some version from here on.
                version_at_call = driver.policy_version
                try:
                    batch = await driver.next_batch(allow_partial=True)
                except (SourceExhausted, DriverFailed, RolloutError) as exc:
                    world.log(f"next_batch raised {type(exc).__name__}")
                    if isinstance(exc, (SourceExhausted, DriverFailed)):
                        state["ended"] = True
                    return
                finally:
                    state["consumer"] = False
                world.log(f"next_batch returned {len(batch)} groups")
                taken.extend(gr.group_id for gr in batch)
                _check_batch(world, batch, t, g, partial_ok=source.exhausted)
                if staleness is not None:
                    world.check(
                        all(gr.staleness(version_at_call) <= staleness for gr in batch),
                        Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
                        f"a group staler than {staleness} versions was handed to the consumer",
                    )

            def take() -> None:
                if not state["consumer"]:
                    state["consumer"] = True
                    harness.start_soon(consume)

            def checks() -> None:
                stats = driver.statistics()
                world.check(
                    stats.buffered <= capacity,
                    Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
                    f"buffer holds {stats.buffered} groups, capacity {capacity}",
                )
                if state["paused_at"] is not None:
                    world.check(
                        submissions() == state["paused_at"],
                        Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
                        f"{submissions() - state['paused_at']} groups submitted while paused",
                    )
                alive = driver.failure is None
                world.check_awake(
                    budget=budget,
                    group_size=g,
                    may_submit=alive
                    and not driver.is_paused
                    and stats.buffered < capacity
                    and not source.exhausted,
                    drains=alive and stats.buffered < capacity,
                )

            closed = False
            actions = [*_ENGINE_STEPS, "take", "pause", "resume", "new version", "close"]
            for step in world.schedule(actions):
                await world.quiesce()
                checks()
                if state["ended"]:
                    break
                action = step.action
                if action == "take":
                    world.log("consumer: next_batch()")
                    take()
                elif action == "pause" and not driver.is_paused:
                    world.log("pause")
                    await pause_stack.enter_async_context(driver.paused())
                    await world.quiesce()
                    state["paused_at"] = submissions()
                elif action == "resume" and driver.is_paused:
                    world.log("resume")
                    state["paused_at"] = None
                    await pause_stack.aclose()
                elif action == "new version":
                    # A weight update: the engine generates with the new version from now on.
                    driver.set_policy_version(driver.policy_version + 1)
                    world.engine.policy_version = driver.policy_version
                    world.log(f"policy version -> {driver.policy_version}")
                elif action == "close":
                    world.log("close the driver")
                    closed = True
                    break
                elif action in _ENGINE_STEPS:
                    await world.engine_step(step)
            if not closed:
                state["paused_at"] = None
                await pause_stack.aclose()

                def round_checks() -> None:
                    checks()
                    if not state["ended"]:
                        take()

                await world.finish(
                    lambda: bool(state["ended"]),
                    each_round=round_checks,
                    rounds=400,
                    time_bound=HANG_TIMEOUT * (n + 2) * 20,
                )
        # The driver is closed: nothing it started may still run.
        await world.quiesce()
        world.check_no_leftovers(baseline, allowed=harness.child_tasks)
        world.check(
            len(set(taken)) == len(taken),
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            "a group was handed out twice",
        )


def async_driver_property(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made Hypothesis test of :func:`check_async_driver` for ``subject``."""
    return _property(check_async_driver, subject, settings_)
