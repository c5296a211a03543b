"""The Hypothesis properties: one example is one adversarial schedule in MockClock time.

``check_credit_loop``, ``check_sync_driver`` and ``check_async_driver`` run one example from a
Hypothesis ``data`` object; the ``*_property`` functions wrap them into ready-made test
functions. Every step of every example checks the invariants of docs/testing.md; a violation raises
:class:`~trio_rl.testing.InvariantViolationError` carrying the (shrunk) schedule.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from ..rollout import (
    AsyncRolloutDriver,
    DriverFailedError,
    GroupFactory,
    RolloutError,
    SourceExhaustedError,
    pending_samples,
    run_reporting,
)
from ..samples import Group, Prompt
from ._checks import (
    ENGINE_STEPS,
    SyncCalls,
    async_driver,
    check_async_batch,
    check_async_state,
    check_credit_loop_awake,
    check_credit_loop_end,
    count_outcome,
    prompts,
    resumed_group,
    sync_driver,
)
from ._errors import Invariant
from ._hypothesis import PHASES, namespaced, subject_digest
from ._recorder import TrackingLedger
from ._report import live_tasks, unwrap_single
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
    # Long, on purpose: one example is one story (draws, the loop under test, the schedule,
    # the final accounts), and its closures share the example's state; the rule-based machine
    # (_machine_credit) tells the same story in pieces.
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
        if i < resumed:
            todo.append(resumed_group(factory, i, g, arrived[i]))
        else:
            todo.append(factory.make(Prompt(f"p{i}", (i,))))
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
                    count_outcome(world, outcome, outcomes)
        state["done"] = True

    def awake() -> None:
        if state["done"] or state["stopped"]:
            return
        check_credit_loop_awake(
            world, outcomes, budget=state["budget"], group_size=g, may_submit=bool(todo)
        )

    baseline = live_tasks()
    try:
        async with trio.open_nursery() as harness:
            harness.start_soon(loop)
            for step in world.schedule([*ENGINE_STEPS, "budget", "stop"]):
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
    check_credit_loop_end(world, scheduler.ledger, outcomes, total)


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
        settings_ if settings_ is not None else settings(report_multiple_bugs=False, phases=PHASES)
    )
    if subject is not None:
        chosen = namespaced(chosen, subject_digest(subject))
    # st.random_module() lets Hypothesis explore (and shrink) trio's task scheduling order.
    wrapped: Callable[[], None] = chosen(given(st.data(), st.random_module())(test))
    return wrapped


# --------------------------------------------------------------------------- sync driver


def check_sync_driver(data: st.DataObject, subject: RolloutSubject | None = None) -> None:
    """One example: the real :class:`~trio_rl.rollout.SyncRolloutDriver` over ``subject``.

    Draws ``T``, ``G``, over-sampling, the dynamic filter, partial rollouts and the number of
    calls, then an adversarial schedule. Checks the first six invariants after every step and
    ``SYNC_BATCH_SHAPE`` after every call: exactly ``T`` groups of ``G`` samples sorted by
    first index, all started by that call, everything else cancelled and settled (or
    :class:`SourceExhaustedError` with the source really exhausted).
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
    source = prompts(n)
    factory = GroupFactory(g)
    driver = sync_driver(
        world, source, factory, per_admission=over, filtering=filtering, partial=partial
    )
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
        for step in world.schedule(ENGINE_STEPS):
            await world.quiesce()
            awake()
            if state["done"]:
                break
            await world.engine_step(step)
        await world.finish(
            lambda: bool(state["done"]), each_round=awake, time_bound=HANG_TIMEOUT * (n + 2) * 4
        )
    world.check_no_leftovers(baseline)


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


#: T, G, B, buffer capacity, prompts, on failure, aborted groups, max staleness
_AsyncDraws = tuple[
    int, int, int, int, int, Literal["skip", "retry"], Literal["recycle", "drop"], int | None
]


def _async_draws(world: World) -> _AsyncDraws:
    """The example's shape: T, G, B, buffer capacity, prompts, on failure, aborted groups,
    max staleness."""
    drawn: _AsyncDraws = world.draw(
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
    t, g, budget, capacity, n, failure, aborted, _ = drawn
    world.log(f"T={t} G={g} B={budget} capacity={capacity} prompts={n} {failure} {aborted}")
    return drawn


async def _async_control(
    world: World,
    driver: AsyncRolloutDriver,
    pause_stack: contextlib.AsyncExitStack,
    state: dict[str, Any],
    action: str,
    submissions: Callable[[], int],
) -> None:
    """One control move of the schedule: pause, resume or a new policy version (a pause of a
    paused driver, or a resume of a running one, does nothing)."""
    if action == "pause" and not driver.is_paused:
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


async def _async_body(world: World) -> None:
    # One example is one story (draws, the driver, the schedule of engine and consumer moves,
    # the close) whose closures share the example's state; the draws and the control moves
    # are steps of their own. The rule-based machine (_machine_async) tells it in pieces.
    t, g, budget, capacity, n, failure, aborted, staleness = _async_draws(world)
    source = prompts(n)
    taken: list[str] = []
    state: dict[str, Any] = {"consumer": False, "ended": False, "paused_at": None}

    # The driver keeps its accounts in a ledger that also counts re-submissions (retries).
    ledger = TrackingLedger()

    baseline = live_tasks()
    async with trio.open_nursery() as harness:

        def submissions() -> int:
            # Every submission opens the group in the ledger (retries included).
            return sum(ledger.opens.values())

        async with (
            contextlib.AsyncExitStack() as pause_stack,
            async_driver(
                world,
                source,
                ledger,
                batch_size=t,
                group_size=g,
                budget=budget,
                capacity=capacity,
                staleness=staleness,
                aborted=aborted,
                failure=failure,
            ) as driver,
        ):

            async def consume() -> None:
                # Staleness is judged as each group is taken, at some version from here on.
                version_at_call = driver.policy_version
                try:
                    batch = await driver.next_batch(allow_partial=True)
                except (SourceExhaustedError, DriverFailedError, RolloutError) as exc:
                    world.log(f"next_batch raised {type(exc).__name__}")
                    if isinstance(exc, (SourceExhaustedError, DriverFailedError)):
                        state["ended"] = True
                    return
                finally:
                    state["consumer"] = False
                world.log(f"next_batch returned {len(batch)} groups")
                taken.extend(gr.group_id for gr in batch)
                check_async_batch(
                    world,
                    batch,
                    version_at_call,
                    batch_size=t,
                    group_size=g,
                    staleness=staleness,
                    source=source,
                )

            def take() -> None:
                if not state["consumer"]:
                    state["consumer"] = True
                    harness.start_soon(consume)

            def checks() -> None:
                check_async_state(
                    world,
                    driver,
                    budget=budget,
                    group_size=g,
                    capacity=capacity,
                    source=source,
                    paused_at=state["paused_at"],
                    submissions=submissions(),
                )

            closed = False
            actions = [*ENGINE_STEPS, "take", "pause", "resume", "new version", "close"]
            for step in world.schedule(actions):
                await world.quiesce()
                checks()
                if state["ended"]:
                    break
                action = step.action
                if action == "take":
                    world.log("consumer: next_batch()")
                    take()
                elif action == "close":
                    world.log("close the driver")
                    closed = True
                    break
                elif action in ENGINE_STEPS:
                    await world.engine_step(step)
                else:
                    await _async_control(world, driver, pause_stack, state, action, submissions)
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
