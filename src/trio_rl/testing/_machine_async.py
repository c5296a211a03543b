"""The real fully-async driver as a rule-based state machine, with the consumer's moves (take
a batch, pause, resume, a weight update, close) as rules beside the engine's."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from ..rollout import (
    AsyncRolloutDriver,
    DriverFailedError,
    InMemorySource,
    RolloutError,
    SourceExhaustedError,
)
from ._checks import async_driver, check_async_batch, check_async_state
from ._checks import prompts as _prompts
from ._errors import Invariant
from ._machine import Machine, bind, machine_test
from ._recorder import TrackingLedger
from ._report import live_tasks
from ._subject import HANG_TIMEOUT, RolloutSubject

__all__ = ["AsyncDriverMachine", "async_driver_machine", "async_driver_test"]


class _AsyncDriverObserver(Machine):
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
        except (SourceExhaustedError, DriverFailedError, RolloutError) as exc:
            self.w.log(f"next_batch raised {type(exc).__name__}")
            if isinstance(exc, (SourceExhaustedError, DriverFailedError)):
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
        check_async_batch(
            world,
            batch,
            version_at_call,
            batch_size=self.batch_size,
            group_size=self.group_size,
            staleness=self.staleness,
            source=self.source,
        )

    def take(self) -> None:
        if not self.consuming and self.harness is not None:
            self.consuming = True
            self.harness.start_soon(self.consume)

    def check(self) -> None:
        """Bounded buffer, no submission while paused, and ``NO_LOST_WAKEUP``."""
        if self.closed or self.driver is None:
            return
        check_async_state(
            self.w,
            self.drv,
            budget=self.budget,
            group_size=self.group_size,
            capacity=self.capacity,
            source=self.source,
            paused_at=self.paused_at,
            submissions=self.submissions(),
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
                    async with async_driver(
                        world,
                        self.source,
                        self.ledger,
                        batch_size=batch_size,
                        group_size=group_size,
                        budget=budget,
                        capacity=capacity,
                        staleness=staleness,
                        aborted=aborted,
                        failure=failure,
                    ) as driver:
                        self.driver = driver
                        await self.close_now.wait()
                    self.driver_exited.set()
            finally:
                self.driver_exited.set()

        async def setup() -> None:
            world = self.make_world(policy, description)
            world.ledger = lambda: self.ledger
            self.source = _prompts(prompts)
            self.baseline = live_tasks()
            # The driver outlives this call: it is held open by a task of the run's nursery (which
            # checks that the driver keeps its accounts in ``self.ledger``).
            self.trio_run.start_soon(partial(self.guarded, run_harness))
            await trio.testing.wait_all_tasks_blocked()
            if self.task_error is not None:
                raise self.task_error

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


def async_driver_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the real fully-async driver over ``subject``.

    The same checks as :func:`~trio_rl.testing.check_async_driver`, with the consumer's moves
    (``take_batch``, ``pause``, ``resume``, ``new_version``, ``close``) as rules beside the
    engine's. Run it with ``.TestCase`` or :func:`async_driver_test`.
    """
    return bind(AsyncDriverMachine, "AsyncDriver", subject, __name__)


def async_driver_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`async_driver_machine` for ``subject`` (settings as
    for :func:`credit_protocol_test`)."""
    return machine_test(async_driver_machine(subject), subject, settings_, "async_driver")
