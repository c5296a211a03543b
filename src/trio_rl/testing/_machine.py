"""The harness as ``hypothesis.stateful`` rule-based state machines.

Each rule is one move of the adversary or of the driver's user (a group arrives, an engine call
settles, several fail in one tick, virtual time passes, the budget changes, the consumer takes
a batch, pauses, resumes, updates the weights, closes); the invariants are the members of
:class:`~trio_rl.testing.Invariant`, checked after every rule once every task is blocked.
Hypothesis shrinks a failing run to the shortest sequence of rules.

Rules are synchronous, trio is not: each example runs one ``trio.run`` under a manual
``MockClock`` in a thread of its own, and every rule and invariant is handed to it with
``trio.from_thread.run`` (public API) and returns once that run is blocked again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import ClassVar, Literal, TypeVar

import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ..rollout import (
    AsyncRolloutDriver,
    CreditScheduler,
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
from ._engine import FateKind
from ._properties import _PHASES, SubjectDatabase, SyncCalls, _check_batch, _subject_digest
from ._recorder import TrackingLedger
from ._report import Invariant, live_tasks
from ._strategies import DELAYS, Step
from ._subject import HANG_TIMEOUT, RolloutSubject
from ._world import World

__all__ = [
    "AsyncDriverMachine",
    "CreditProtocolMachine",
    "SyncDriverMachine",
    "async_driver_machine",
    "async_driver_test",
    "credit_protocol_machine",
    "credit_protocol_test",
    "sync_driver_machine",
    "sync_driver_test",
]

_T = TypeVar("_T")

#: Real seconds to wait for the example's trio thread to start or to stop.
_THREAD_TIMEOUT = 30.0
#: Every fate the adversary may draw; a subject's ``kinds`` are indexed modulo their number.
_KIND_INDEX = st.integers(0, 4)


class _Run:
    """One ``trio.run`` under ``clock`` in its own thread, driven from the machine's thread."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self._clock = clock
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self._thread.start()
        if not self._ready.wait(_THREAD_TIMEOUT):
            raise RuntimeError(f"the example's trio run did not start in {_THREAD_TIMEOUT:g}s")

    def _thread_main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()

        try:
            trio.run(main, clock=self._clock)
        finally:
            self._ready.set()

    def call(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``fn`` in the trio thread and return its result (or raise its exception)."""
        return trio.from_thread.run(fn, trio_token=self._token)

    def close(self) -> None:
        """End the run (its system tasks are cancelled) and join its thread."""
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(_THREAD_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"the example's trio run did not end in {_THREAD_TIMEOUT:g}s")


def _held(machine: _Machine) -> int:
    world = machine.world
    return 0 if world is None or not machine.moving else len(world.engine.held)


class _Machine(RuleBasedStateMachine):
    """What every harness machine shares: the trio run, the engine's moves, the checks."""

    subject: ClassVar[RolloutSubject] = RolloutSubject()

    def __init__(self) -> None:
        super().__init__()
        self.clock = trio.testing.MockClock()
        self.trio_run = _Run(self.clock)
        self.world: World | None = None
        self.baseline: set[trio.lowlevel.Task] = set()
        self.failed = False
        #: An error a background task of the example raised; reported at the next rule.
        self.task_error: BaseException | None = None

    # -- plumbing ----------------------------------------------------------------------
    @property
    def w(self) -> World:
        assert self.world is not None, "the machine is not initialised"
        return self.world

    @property
    def moving(self) -> bool:
        """False once the system under test is stopped: only time may pass then."""
        return True

    def act(self, move: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``move`` in trio, wait until every task blocks, raise any violation."""

        async def body() -> None:
            result = move()
            if result is not None:
                await result
            await self.w.quiesce()
            if self.task_error is not None:
                raise self.task_error

        try:
            self.trio_run.call(body)
        except BaseException:
            self.failed = True
            raise

    async def guarded(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run a background task of the example; keep its error for the next rule."""
        try:
            await fn()
        except Exception as exc:
            if self.task_error is None:
                self.task_error = exc

    def kind(self, index: int) -> FateKind:
        kinds = self.subject.kinds
        return kinds[index % len(kinds)]

    def make_world(self, policy: int, description: str) -> World:
        world = World(None, self.subject, self.clock, policy=policy)
        world.log(description)
        self.world = world
        return world

    # -- the engine's moves --------------------------------------------------------------
    @precondition(lambda self: _held(self) > 0)
    @rule(
        pick=st.integers(0, 7),
        kind=_KIND_INDEX,
        delay=st.sampled_from(range(1, len(DELAYS) + 1)),
    )
    def settle(self, pick: int, kind: int, delay: int) -> None:
        """One held engine call ends as ``kind`` after a delay."""
        self.act(lambda: self.w.engine_step(Step("settle", pick, self.kind(kind), delay)))

    @precondition(lambda self: _held(self) > 0)
    @rule(pick=st.integers(0, 7), kind=_KIND_INDEX)
    def settle_all(self, pick: int, kind: int) -> None:
        """Every held call ends at once; the picked one as ``kind``, the rest ``stop``."""
        self.act(lambda: self.w.engine_step(Step("settle all", pick, self.kind(kind))))

    @precondition(lambda self: _held(self) > 1 and "raise" in self.subject.kinds)
    @rule(pick=st.integers(0, 7), more=st.integers(1, 4))
    def fail_together(self, pick: int, more: int) -> None:
        """Several held calls raise in one tick."""
        self.act(lambda: self.w.engine_step(Step("fail together", pick, "raise", more)))

    @precondition(lambda self: self.world is not None)
    @rule(index=st.integers(1, 4))
    def advance(self, index: int) -> None:
        """Virtual time passes (the one move left once the system is stopped)."""
        self.act(lambda: self.w.engine_step(Step("advance", value=index)))

    # -- checks ----------------------------------------------------------------------
    def check(self) -> None:
        """The checks made after every rule (in trio, every task blocked)."""

    @invariant()
    def invariants_hold(self) -> None:
        """Everything the book recorded, and the machine's own checks."""

        async def check() -> None:
            self.w.recorder.raise_first()
            self.check()

        self.act(check)

    async def finish(self) -> None:
        """Let the run end and make the final checks (in trio)."""

    def teardown(self) -> None:
        try:
            if self.world is not None and not self.failed:
                self.act(self.finish)
        finally:
            self.trio_run.close()


# --------------------------------------------------------------------------- credit loop


class CreditProtocolMachine(_Machine):
    """The credit loop of :func:`~trio_rl.testing.check_credit_loop`, groups arriving as rules.

    Use :func:`credit_protocol_machine` to bind it to a subject.
    """

    def __init__(self) -> None:
        super().__init__()
        self.todo: deque[Group] = deque()
        self.outcomes: dict[str, int] = {}
        self.budget = 1
        self.group_size = 1
        self.count = 0
        self.stopped = False
        self.done = False
        self.finished = False
        self.scheduler: CreditScheduler | None = None
        self.factory = GroupFactory(1)
        self.cancel = trio.CancelScope()

    @property
    def moving(self) -> bool:
        return not self.stopped

    @property
    def sched(self) -> CreditScheduler:
        assert self.scheduler is not None, "the machine is not initialised"
        return self.scheduler

    async def loop(self) -> None:
        scheduler, world = self.sched, self.w
        try:
            with self.cancel:
                async with trio.open_nursery() as nursery:
                    while True:
                        while self.todo and scheduler.admits(self.budget):
                            group = self.todo.popleft()
                            scheduler.submitted(group.group_id, pending_samples(group))
                            nursery.start_soon(run_reporting, world.group_runner, group, scheduler)
                        if self.done and not self.todo and scheduler.ledger.pending_groups == 0:
                            break
                        for outcome in await scheduler.wait_for_progress():
                            record = world.recorder.groups.get(outcome.group_id)
                            world.recorder.check(
                                record is not None and record.ended,
                                Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
                                f"outcome of group {outcome.group_id} delivered before it ended",
                            )
                            self.outcomes[outcome.group_id] = (
                                self.outcomes.get(outcome.group_id, 0) + 1
                            )
        finally:
            self.finished = True

    def check(self) -> None:
        """``NO_LOST_WAKEUP`` while the loop runs."""
        world = self.w
        if self.stopped or self.finished:
            return
        undelivered = [
            gid for gid, r in world.recorder.groups.items() if r.ended and gid not in self.outcomes
        ]
        world.check(
            not undelivered,
            Invariant.NO_LOST_WAKEUP,
            f"the driver is asleep although group {undelivered[:1]} ended and its "
            "outcome was never delivered",
        )
        world.check_awake(
            budget=self.budget, group_size=self.group_size, may_submit=bool(self.todo)
        )

    @initialize(group_size=st.integers(1, 4), budget=st.integers(1, 4), policy=st.integers(0, 7))
    def start(self, group_size: int, budget: int, policy: int) -> None:
        """Draw ``G``, ``B`` and the policy; start the loop."""
        self.group_size, self.budget = group_size, budget
        self.factory = GroupFactory(group_size)

        def setup() -> None:
            world = self.make_world(policy, f"G={group_size} B={budget}")
            scheduler = self.subject.scheduler(world.policy, group_size)
            self.scheduler = scheduler
            world.ledger = lambda: scheduler.ledger
            self.baseline = live_tasks()
            # The loop outlives this call: a system task of the example's run.
            trio.lowlevel.spawn_system_task(self.guarded, self.loop)

        self.act(setup)

    @precondition(lambda self: not self.stopped)
    @rule(arrived=st.one_of(st.none(), st.integers(0, 4)))
    def add_group(self, arrived: int | None) -> None:
        """A prompt arrives (``arrived``: a resumed group with that many members in)."""

        def move() -> None:
            i = self.count
            self.count += 1
            prompt = Prompt(f"p{i}", (i,))
            g = self.group_size
            if arrived is None:
                group = self.factory.make(prompt)
                self.w.log(f"group p{i} arrives")
            else:
                members = [
                    Sample(
                        index=10_000 + 100 * i + k,
                        group_index=10_000 + i,
                        prompt_tokens=(i,),
                        status=SampleStatus.COMPLETED,
                    )
                    for k in range(min(arrived, g))
                ]
                group = self.factory.resume(OpenGroup(f"r{i}", prompt, g, members))
                self.w.log(f"group r{i} arrives, resumed with {len(members)} members")
            self.todo.append(group)
            self.sched.nudge("prompt")

        self.act(move)

    @precondition(lambda self: not self.stopped)
    @rule(budget=st.integers(1, 4))
    def set_budget(self, budget: int) -> None:
        """The budget changes and the driver is nudged."""

        def move() -> None:
            self.budget = budget
            self.w.log(f"budget -> {budget}")
            self.sched.nudge("budget")

        self.act(move)

    @precondition(lambda self: not self.stopped)
    @rule()
    def stop(self) -> None:
        """The driver loop is cancelled."""

        def move() -> None:
            self.w.log("stop: cancel the driver loop")
            self.stopped = True
            self.cancel.cancel()

        self.act(move)

    async def finish(self) -> None:
        world = self.w
        if not self.stopped:
            self.done = True
            self.sched.nudge("done")
            await world.finish(
                lambda: self.finished,
                each_round=self.check,
                time_bound=self.clock.current_time() + HANG_TIMEOUT * (self.count + 2) * 4,
            )
        else:
            await world.quiesce()
        world.check_no_leftovers(self.baseline)
        self.sched.close()  # every task that reports to it has ended
        if self.stopped:
            return
        ledger = self.sched.ledger
        world.check(
            ledger.in_flight == 0
            and ledger.opened == ledger.returned
            and ledger.pending_groups == 0,
            Invariant.CREDITS_MATCH_PENDING_SAMPLES,
            f"run over but ledger holds {ledger.in_flight} credits "
            f"(opened {ledger.opened}, returned {ledger.returned})",
        )
        world.check(
            len(self.outcomes) == self.count and all(v == 1 for v in self.outcomes.values()),
            Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
            f"{self.count} groups ran but outcomes were delivered as "
            f"{sorted(self.outcomes.values())}",
        )


# --------------------------------------------------------------------------- sync driver


class SyncDriverMachine(_Machine):
    """The real :class:`~trio_rl.rollout.SyncRolloutDriver`, each ``generate`` call a rule.

    Use :func:`sync_driver_machine` to bind it to a subject.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sync: SyncCalls | None = None
        self.calling = False
        self.exhausted = False
        self.prompts = 0

    @property
    def moving(self) -> bool:
        return not self.exhausted

    @property
    def calls(self) -> SyncCalls:
        assert self.sync is not None, "the machine is not initialised"
        return self.sync

    @initialize(
        batch_size=st.integers(1, 3),
        group_size=st.integers(1, 3),
        per_admission=st.integers(1, 2),
        prompts=st.integers(1, 9),
        filtering=st.booleans(),
        partial=st.booleans(),
        allow_partial=st.booleans(),
        policy=st.integers(0, 7),
    )
    def start(
        self,
        batch_size: int,
        group_size: int,
        per_admission: int,
        prompts: int,
        filtering: bool,
        partial: bool,
        allow_partial: bool,
        policy: int,
    ) -> None:
        """Draw the driver's settings and build it."""
        self.prompts = prompts

        def setup() -> None:
            world = self.make_world(
                policy,
                f"T={batch_size} G={group_size} O={per_admission} prompts={prompts} "
                f"filter={filtering} partial={partial}",
            )
            source = InMemorySource([Prompt(f"p{i}", (i,)) for i in range(prompts)])
            factory = GroupFactory(group_size)
            driver = SyncRolloutDriver(
                source,
                factory,
                world.group_runner,
                policy=world.policy,
                groups_per_admission=per_admission,
                dynamic_filter=reject_aborted if filtering else None,
                partial_rollouts=partial,
            )
            world.ledger = lambda: driver.scheduler.ledger if driver.scheduler else None
            self.sync = SyncCalls(
                world,
                driver,
                source,
                factory,
                batch_size,
                group_size,
                filtering,
                partial,
                allow_partial,
            )
            self.baseline = live_tasks()

        self.act(setup)

    async def one_call(self) -> None:
        try:
            if not await self.calls.call():
                self.exhausted = True
        finally:
            self.calling = False

    @precondition(lambda self: self.moving and not self.calling)
    @rule()
    def generate(self) -> None:
        """The trainer asks for the next batch (one ``generate`` call, run in the background
        until it returns)."""

        def move() -> None:
            self.w.log(f"generate() call {self.calls.calls + 1}")
            self.calling = True
            trio.lowlevel.spawn_system_task(self.guarded, self.one_call)

        self.act(move)

    def check(self) -> None:
        if self.calling:
            self.calls.awake()

    async def finish(self) -> None:
        world = self.w
        await world.finish(
            lambda: not self.calling,
            each_round=self.check,
            time_bound=self.clock.current_time() + HANG_TIMEOUT * (self.prompts + 2) * 4,
        )
        world.check_no_leftovers(self.baseline)


# --------------------------------------------------------------------------- async driver


class _AsyncDriverObserver(_Machine):
    """The fully-async machine's state, its consumer and its checks; the rules that move
    the driver are :class:`AsyncDriverMachine`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.driver: AsyncRolloutDriver | None = None
        self.ledger = TrackingLedger()
        self.source = InMemorySource([])
        self.harness: trio.Nursery | None = None
        self.harness_task: trio.lowlevel.Task | None = None
        self.taken: list[str] = []
        self.consuming = False
        self.ended = False
        self.closed = False
        self.close_now = trio.Event()
        self.driver_exited = trio.Event()
        self.resume_now: trio.Event | None = None
        self.paused_at: int | None = None
        self.batch_size = self.group_size = self.budget = self.capacity = self.prompts = 1
        self.staleness: int | None = None

    @property
    def moving(self) -> bool:
        return not self.closed and not self.ended

    @property
    def drv(self) -> AsyncRolloutDriver:
        assert self.driver is not None, "the machine is not initialised"
        return self.driver

    def submissions(self) -> int:
        # Every submission opens the group in the ledger (retries included).
        return sum(self.ledger.opens.values())

    # -- the consumer ------------------------------------------------------------------
    async def consume(self) -> None:
        driver = self.drv
        version_at_call = driver.policy_version
        try:
            batch = await driver.next_batch(allow_partial=True)
        except (SourceExhausted, DriverFailed, RolloutError) as exc:
            self.w.log(f"next_batch raised {type(exc).__name__}")
            if isinstance(exc, (SourceExhausted, DriverFailed)):
                self.ended = True
            return
        except trio.ClosedResourceError:
            return
        finally:
            self.consuming = False
        world = self.w
        world.log(f"next_batch returned {len(batch)} groups")
        again = [g.group_id for g in batch if g.group_id in self.taken]
        world.check(
            not again, Invariant.ASYNC_BOUNDED_PAUSED_CLOSED, f"group {again[:1]} handed out twice"
        )
        self.taken.extend(g.group_id for g in batch)
        _check_batch(
            world, batch, self.batch_size, self.group_size, partial_ok=self.source.exhausted
        )
        if self.staleness is not None:
            world.check(
                all(g.staleness(version_at_call) <= self.staleness for g in batch),
                Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
                f"a group staler than {self.staleness} versions was handed to the consumer",
            )

    def take(self) -> None:
        if not self.consuming and self.harness is not None:
            self.consuming = True
            self.harness.start_soon(self.consume)

    def check(self) -> None:
        """Bounded buffer, no submission while paused, and ``NO_LOST_WAKEUP``."""
        if self.closed or self.driver is None:
            return
        driver, world = self.drv, self.w
        stats = driver.statistics()
        world.check(
            stats.buffered <= self.capacity,
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            f"buffer holds {stats.buffered} groups, capacity {self.capacity}",
        )
        if self.paused_at is not None:
            world.check(
                self.submissions() == self.paused_at,
                Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
                f"{self.submissions() - self.paused_at} groups submitted while paused",
            )
        alive = driver.failure is None
        world.check_awake(
            budget=self.budget,
            group_size=self.group_size,
            may_submit=alive
            and not driver.is_paused
            and stats.buffered < self.capacity
            and not self.source.exhausted,
            drains=alive and stats.buffered < self.capacity,
        )

    def _resume(self) -> None:
        if self.resume_now is not None:
            self.w.log("resume")
            self.paused_at = None
            self.resume_now.set()
            self.resume_now = None

    async def _close(self) -> None:
        self.closed = True
        self.close_now.set()
        await trio.testing.wait_all_tasks_blocked()
        world = self.w
        world.check(
            self.driver_exited.is_set(),
            Invariant.NO_DEADLOCK,
            "closing the driver blocks: its context did not exit once every task was blocked",
        )
        # The driver is closed: nothing it started may still run.
        await world.quiesce()
        harness = self.harness
        allowed = {t for t in (self.harness_task,) if t is not None}
        if harness is not None:
            allowed |= set(harness.child_tasks)
        world.check_no_leftovers(self.baseline, allowed=allowed)

    async def finish(self) -> None:
        world = self.w
        if not self.closed:
            self._resume()

            def round_checks() -> None:
                self.check()
                if not self.ended:
                    self.take()

            await world.finish(
                lambda: self.ended,
                each_round=round_checks,
                rounds=400,
                time_bound=self.clock.current_time() + HANG_TIMEOUT * (self.prompts + 2) * 20,
            )
            await self._close()


class AsyncDriverMachine(_AsyncDriverObserver):
    """The real fully-async driver (:func:`~trio_rl.rollout.open_async_rollout`), with the
    consumer's moves (take a batch, pause, resume, a weight update, close) as rules.

    Use :func:`async_driver_machine` to bind it to a subject.
    """

    @initialize(
        batch_size=st.integers(1, 3),
        group_size=st.integers(1, 3),
        budget=st.integers(1, 3),
        capacity=st.integers(1, 6),
        prompts=st.integers(1, 8),
        failure=st.sampled_from(["skip", "retry"]),
        aborted=st.sampled_from(["recycle", "drop"]),
        staleness=st.sampled_from([None, 0, 1]),
        policy=st.integers(0, 7),
    )
    def start(
        self,
        batch_size: int,
        group_size: int,
        budget: int,
        capacity: int,
        prompts: int,
        failure: Literal["skip", "retry"],
        aborted: Literal["recycle", "drop"],
        staleness: int | None,
        policy: int,
    ) -> None:
        """Draw the driver's settings and open it."""
        self.batch_size, self.group_size, self.budget = batch_size, group_size, budget
        self.capacity, self.prompts, self.staleness = capacity, prompts, staleness
        description = (
            f"T={batch_size} G={group_size} B={budget} capacity={capacity} prompts={prompts} "
            f"{failure} {aborted}"
        )

        async def run_harness() -> None:
            world = self.w
            self.harness_task = trio.lowlevel.current_task()
            try:
                async with trio.open_nursery() as harness:
                    self.harness = harness
                    async with open_async_rollout(
                        self.source,
                        GroupFactory(group_size),
                        world.group_runner,
                        batch_size=batch_size,
                        policy=world.policy,
                        max_groups_in_flight=budget,
                        buffer_capacity=capacity,
                        max_staleness=staleness,
                        aborted=aborted,
                        on_failure=FailurePolicy(failure, max_retries=1),
                        ledger=self.ledger,
                    ) as driver:
                        self.driver = driver
                        await self.close_now.wait()
                    self.driver_exited.set()
            finally:
                self.driver_exited.set()

        async def setup() -> None:
            world = self.make_world(policy, description)
            world.ledger = lambda: self.ledger
            self.source = InMemorySource([Prompt(f"p{i}", (i,)) for i in range(prompts)])
            self.baseline = live_tasks()
            # The driver outlives this call: it is held open by a system task of the run.
            trio.lowlevel.spawn_system_task(self.guarded, run_harness)
            await trio.testing.wait_all_tasks_blocked()
            if self.task_error is not None:
                raise self.task_error
            world.check(
                self.drv.scheduler.ledger is self.ledger,
                Invariant.CREDITS_MATCH_PENDING_SAMPLES,
                "the driver keeps another ledger",
            )

        self.act(setup)

    @precondition(lambda self: self.moving)
    @rule()
    def take_batch(self) -> None:
        """The consumer calls ``next_batch`` (unless a call is already waiting)."""

        def move() -> None:
            self.w.log("consumer: next_batch()")
            self.take()

        self.act(move)

    @precondition(lambda self: self.moving and self.resume_now is None)
    @rule()
    def pause(self) -> None:
        """The consumer pauses submissions (a task holds ``driver.paused()`` until resume)."""
        resume = trio.Event()

        async def hold(task_status: trio.TaskStatus[None]) -> None:
            async with self.drv.paused():
                task_status.started()
                await resume.wait()

        async def move() -> None:
            self.w.log("pause")
            self.resume_now = resume
            assert self.harness is not None
            await self.harness.start(hold)
            await self.w.quiesce()
            self.paused_at = self.submissions()

        self.act(move)

    @precondition(lambda self: self.moving and self.resume_now is not None)
    @rule()
    def resume(self) -> None:
        """The consumer resumes submissions."""
        self.act(self._resume)

    @precondition(lambda self: self.moving)
    @rule()
    def new_version(self) -> None:
        """A weight update: the engine generates with the new version from now on."""

        def move() -> None:
            driver = self.drv
            driver.set_policy_version(driver.policy_version + 1)
            self.w.engine.policy_version = driver.policy_version
            self.w.log(f"policy version -> {driver.policy_version}")

        self.act(move)

    @precondition(lambda self: self.moving)
    @rule()
    def close(self) -> None:
        """The consumer closes the driver early."""

        async def move() -> None:
            self.w.log("close the driver")
            await self._close()

        self.act(move)


# --------------------------------------------------------------------------- public API


def _bind(base: type[_Machine], name: str, subject: RolloutSubject | None) -> type[_Machine]:
    chosen = subject if subject is not None else RolloutSubject()
    machine = type(name, (base,), {"subject": chosen, "__module__": __name__})
    return machine


def credit_protocol_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the credit protocol of ``subject``.

    It drives the same minimal driver loop as :func:`~trio_rl.testing.check_credit_loop`
    (``subject``'s policy, scheduler and group runner over the harness's
    :class:`~trio_rl.testing.ScriptedEngine`), with groups arriving as rules rather than
    drawn up front. Invariants ``ONE_CREDIT_PER_SAMPLE`` to ``NO_LOST_WAKEUP`` are checked after
    every rule; at teardown every held call is let finish and ``NO_DEADLOCK`` and the final
    books are checked. Run it with ``TestCredits = credit_protocol_machine(subject).TestCase``
    or :func:`credit_protocol_test`.
    """
    return _bind(CreditProtocolMachine, "CreditProtocol", subject)


def sync_driver_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the real sync driver over ``subject``.

    The same checks as :func:`~trio_rl.testing.check_sync_driver`; each ``generate`` rule
    starts one call, which runs while the engine's rules settle its samples. Run it with
    ``.TestCase`` or :func:`sync_driver_test`.
    """
    return _bind(SyncDriverMachine, "SyncDriver", subject)


def async_driver_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the real fully-async driver over ``subject``.

    The same checks as :func:`~trio_rl.testing.check_async_driver`, with the consumer's moves
    (``take_batch``, ``pause``, ``resume``, ``new_version``, ``close``) as rules beside the
    engine's. Run it with ``.TestCase`` or :func:`async_driver_test`.
    """
    return _bind(AsyncDriverMachine, "AsyncDriver", subject)


def _test(
    machine: type[RuleBasedStateMachine],
    subject: RolloutSubject | None,
    settings_: settings | None,
    name: str,
) -> Callable[[], None]:
    chosen_subject = subject if subject is not None else RolloutSubject()
    chosen = (
        settings_
        if settings_ is not None
        else settings(
            report_multiple_bugs=False,
            phases=_PHASES,
            stateful_step_count=max(chosen_subject.max_steps, 1),
        )
    )
    # As for the properties: saved failing examples are namespaced by the subject.
    if chosen.database is not None:
        namespace = f"{name}|".encode() + _subject_digest(chosen_subject)
        chosen = settings(chosen, database=SubjectDatabase(chosen.database, namespace))

    def test() -> None:
        run_state_machine_as_test(machine, settings=chosen)

    test.__name__ = test.__qualname__ = f"test_{name}"
    return test


def credit_protocol_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`credit_protocol_machine` for ``subject``.

    ``settings_`` defaults to the active profile with ``report_multiple_bugs=False``, without
    the ``explain`` phase, and with ``stateful_step_count`` set to ``subject.max_steps``.
    """
    return _test(credit_protocol_machine(subject), subject, settings_, "credit_protocol")


def sync_driver_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`sync_driver_machine` for ``subject`` (settings as
    for :func:`credit_protocol_test`)."""
    return _test(sync_driver_machine(subject), subject, settings_, "sync_driver")


def async_driver_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`async_driver_machine` for ``subject`` (settings as
    for :func:`credit_protocol_test`)."""
    return _test(async_driver_machine(subject), subject, settings_, "async_driver")
