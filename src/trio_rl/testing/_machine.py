"""The credit/scheduling protocol as a ``hypothesis.stateful`` rule-based state machine.

Each rule is one move of the adversary (a group arrives, an engine call settles, several fail in
one tick, virtual time passes, the budget changes, the driver is stopped); each invariant is a
member of :class:`~trio_rl.testing.Invariant`, checked after every rule once every task is
blocked. Hypothesis shrinks a failing run to the shortest sequence of rules.

Rules are synchronous, trio is not: each example runs one ``trio.run`` under a manual
``MockClock`` in a thread of its own, and every rule and invariant is handed to it with
``trio.from_thread.run`` (public API) and returns once that run is blocked again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

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

from ..rollout import CreditScheduler, GroupFactory, pending_samples, run_reporting
from ..samples import Group, Prompt, ResumedGroup, Sample, SampleStatus
from ._engine import FateKind
from ._properties import _PHASES, SubjectDatabase, _subject_digest
from ._report import Invariant, live_tasks
from ._strategies import DELAYS, Step
from ._subject import HANG_TIMEOUT, RolloutSubject
from ._world import World

__all__ = ["credit_protocol_machine", "credit_protocol_test"]

_T = TypeVar("_T")

#: Real seconds to wait for the example's trio thread to start or to stop.
_THREAD_TIMEOUT = 30.0


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
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(_THREAD_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"the example's trio run did not end in {_THREAD_TIMEOUT:g}s")


def _held(machine: RuleBasedStateMachine) -> int:
    world: World | None = getattr(machine, "world", None)
    return 0 if world is None else len(world.engine.held)


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
    the: RolloutSubject = subject if subject is not None else RolloutSubject()
    kinds: list[FateKind] = list(the.kinds)
    n_policies = len(the.policies)

    class CreditProtocol(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = trio.testing.MockClock()
            self.trio_run = _Run(self.clock)
            self.world: World | None = None
            self.todo: deque[Group] = deque()
            self.outcomes: dict[str, int] = {}
            self.budget = 1
            self.group_size = 1
            self.count = 0
            self.stopped = False
            self.done = False
            self.failed = False
            self.finished = False
            self.loop_error: BaseException | None = None
            self.scheduler: CreditScheduler | None = None
            self.factory = GroupFactory(1)
            self.cancel = trio.CancelScope()
            self.baseline: set[trio.lowlevel.Task] = set()

        # -- plumbing ------------------------------------------------------------------
        @property
        def w(self) -> World:
            assert self.world is not None, "the machine is not initialised"
            return self.world

        def act(self, move: Callable[[], Awaitable[None] | None]) -> None:
            """Run ``move`` in trio, wait until every task blocks, raise any violation."""

            async def body() -> None:
                result = move()
                if result is not None:
                    await result
                await self.w.quiesce()
                if self.loop_error is not None:
                    raise self.loop_error

            try:
                self.trio_run.call(body)
            except BaseException:
                self.failed = True
                raise

        async def loop(self) -> None:
            scheduler, world = self.scheduler, self.w
            assert scheduler is not None
            try:
                with self.cancel:
                    async with trio.open_nursery() as nursery:
                        while True:
                            while self.todo and scheduler.admits(self.budget):
                                group = self.todo.popleft()
                                scheduler.submitted(group.group_id, pending_samples(group))
                                nursery.start_soon(
                                    run_reporting, world.group_runner, group, scheduler
                                )
                            if self.done and not self.todo and scheduler.ledger.pending_groups == 0:
                                break
                            for outcome in await scheduler.wait_for_progress():
                                record = world.recorder.groups.get(outcome.group_id)
                                world.recorder.check(
                                    record is not None and record.ended,
                                    Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
                                    f"outcome of group {outcome.group_id} delivered before "
                                    "it ended",
                                )
                                self.outcomes[outcome.group_id] = (
                                    self.outcomes.get(outcome.group_id, 0) + 1
                                )
            except Exception as exc:  # reported at the next rule, the run stays up
                self.loop_error = exc
            finally:
                self.finished = True

        def awake(self) -> None:
            world = self.w
            if self.stopped or self.finished:
                return
            undelivered = [
                gid
                for gid, r in world.recorder.groups.items()
                if r.ended and gid not in self.outcomes
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

        # -- rules ---------------------------------------------------------------------
        @initialize(
            group_size=st.integers(1, 4),
            budget=st.integers(1, 4),
            policy=st.integers(0, n_policies - 1),
        )
        def start(self, group_size: int, budget: int, policy: int) -> None:
            self.group_size, self.budget = group_size, budget
            self.factory = GroupFactory(group_size)

            async def setup() -> None:
                self.world = World(None, the, self.clock, policy=policy)
                self.world.log(f"G={group_size} B={budget}")
                scheduler = the.scheduler(self.world.policy, group_size)
                self.scheduler = scheduler
                self.world.ledger = lambda: scheduler.ledger
                self.baseline = live_tasks()
                # The loop outlives this call: a system task of the example's run.
                trio.lowlevel.spawn_system_task(self.loop)

            self.act(setup)

        @precondition(lambda self: not self.stopped)
        @rule(arrived=st.none() | st.integers(0, 4))
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
                    group = self.factory.resume(ResumedGroup(f"r{i}", prompt, g, members))
                    self.w.log(f"group r{i} arrives, resumed with {len(members)} members")
                self.todo.append(group)
                assert self.scheduler is not None
                self.scheduler.nudge("prompt")

            self.act(move)

        @precondition(lambda self: not self.stopped and _held(self) > 0)
        @rule(
            pick=st.integers(0, 7),
            kind=st.sampled_from(kinds),
            delay=st.sampled_from(range(1, len(DELAYS) + 1)),
        )
        def settle(self, pick: int, kind: FateKind, delay: int) -> None:
            """One held engine call ends as ``kind`` after a delay."""
            self.act(lambda: self.w.engine_step(Step("settle", pick, kind, delay)))

        @precondition(lambda self: not self.stopped and _held(self) > 0)
        @rule(pick=st.integers(0, 7), kind=st.sampled_from(kinds))
        def settle_all(self, pick: int, kind: FateKind) -> None:
            """Every held call ends at once; the picked one as ``kind``, the rest ``stop``."""
            self.act(lambda: self.w.engine_step(Step("settle all", pick, kind)))

        @precondition(lambda self: not self.stopped and _held(self) > 1 and "raise" in kinds)
        @rule(pick=st.integers(0, 7), more=st.integers(1, 4))
        def fail_together(self, pick: int, more: int) -> None:
            """Several held calls raise in one tick."""
            self.act(lambda: self.w.engine_step(Step("fail together", pick, "raise", more)))

        @rule(index=st.integers(1, 4))
        def advance(self, index: int) -> None:
            """Virtual time passes (the one move left once the driver is stopped)."""
            self.act(lambda: self.w.engine_step(Step("advance", value=index)))

        @precondition(lambda self: not self.stopped)
        @rule(budget=st.integers(1, 4))
        def set_budget(self, budget: int) -> None:
            """The budget changes and the driver is nudged."""

            def move() -> None:
                self.budget = budget
                self.w.log(f"budget -> {budget}")
                assert self.scheduler is not None
                self.scheduler.nudge("budget")

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

        # -- invariants ----------------------------------------------------------------
        @invariant()
        def credits_and_wakeups(self) -> None:
            """Everything the book recorded, and ``NO_LOST_WAKEUP`` while every task blocks."""

            async def check() -> None:
                self.w.recorder.raise_first()
                self.awake()

            self.act(check)

        def teardown(self) -> None:
            try:
                if self.world is not None and not self.failed:
                    self.act(self._finish)
            finally:
                self.trio_run.close()

        async def _finish(self) -> None:
            world = self.w
            if not self.stopped:
                self.done = True
                assert self.scheduler is not None
                self.scheduler.nudge("done")
                total = self.count
                await world.finish(
                    lambda: self.finished,
                    each_round=self.awake,
                    time_bound=self.clock.current_time() + HANG_TIMEOUT * (total + 2) * 4,
                )
            else:
                await world.quiesce()
            world.check_no_leftovers(self.baseline)
            assert self.scheduler is not None
            self.scheduler.close()  # every task that reports to it has ended
            if self.stopped:
                return
            ledger = self.scheduler.ledger
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

    CreditProtocol.__qualname__ = CreditProtocol.__name__ = "CreditProtocol"
    return CreditProtocol


def credit_protocol_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`credit_protocol_machine` for ``subject``.

    ``settings_`` defaults to the active profile with ``report_multiple_bugs=False``, without
    the ``explain`` phase, and with ``stateful_step_count`` set to ``subject.max_steps``.
    """
    chosen_subject = subject if subject is not None else RolloutSubject()
    machine = credit_protocol_machine(chosen_subject)
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
        namespace = b"machine|" + _subject_digest(chosen_subject)
        chosen = settings(chosen, database=SubjectDatabase(chosen.database, namespace))

    def test_credit_protocol() -> None:
        run_state_machine_as_test(machine, settings=chosen)

    return test_credit_protocol
