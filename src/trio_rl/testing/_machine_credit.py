"""The credit protocol as a rule-based state machine: the minimal driver loop of
:func:`~trio_rl.testing.check_credit_loop`, with groups arriving as rules."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from ..rollout import CreditScheduler, GroupFactory, pending_samples, run_reporting
from ..samples import Group, Prompt
from ._checks import check_credit_loop_awake, check_credit_loop_end, count_outcome, resumed_group
from ._machine import Machine, bind, machine_test
from ._report import live_tasks
from ._subject import HANG_TIMEOUT, RolloutSubject

__all__ = ["CreditProtocolMachine", "credit_protocol_machine", "credit_protocol_test"]


class CreditProtocolMachine(Machine):
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
                            count_outcome(world, outcome, self.outcomes)
        finally:
            self.finished = True

    def check(self) -> None:
        """``NO_LOST_WAKEUP`` while the loop runs."""
        world = self.w
        if self.stopped or self.finished:
            return
        check_credit_loop_awake(
            world,
            self.outcomes,
            budget=self.budget,
            group_size=self.group_size,
            may_submit=bool(self.todo),
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
            # The loop outlives this call: a task of the example's run's nursery.
            self.trio_run.start_soon(partial(self.guarded, self.loop))

        self.act(setup)

    @precondition(lambda self: not self.stopped)
    @rule(arrived=st.one_of(st.none(), st.integers(0, 4)))
    def add_group(self, arrived: int | None) -> None:
        """A prompt arrives (``arrived``: a resumed group with that many members in)."""

        def move() -> None:
            i = self.count
            self.count += 1
            g = self.group_size
            if arrived is None:
                group = self.factory.make(Prompt(f"p{i}", (i,)))
                self.w.log(f"group p{i} arrives")
            else:
                group = resumed_group(self.factory, i, g, arrived)
                self.w.log(f"group r{i} arrives, resumed with {min(arrived, g)} members")
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
        check_credit_loop_end(world, self.sched.ledger, self.outcomes, self.count)


def credit_protocol_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the credit protocol of ``subject``.

    It drives the same minimal driver loop as :func:`~trio_rl.testing.check_credit_loop`
    (``subject``'s policy, scheduler and group runner over the harness's
    :class:`~trio_rl.testing.ScriptedEngine`), with groups arriving as rules rather than
    drawn up front. Invariants ``ONE_CREDIT_PER_SAMPLE`` to ``NO_LOST_WAKEUP`` are checked after
    every rule; at teardown every held call is let finish and ``NO_DEADLOCK`` and the final
    accounts are checked. Run it with ``TestCredits = credit_protocol_machine(subject).TestCase``
    or :func:`credit_protocol_test`.
    """
    return bind(CreditProtocolMachine, "CreditProtocol", subject, __name__)


def credit_protocol_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`credit_protocol_machine` for ``subject``.

    ``settings_`` defaults to the active profile with ``report_multiple_bugs=False``, without
    the ``explain`` phase, and with ``stateful_step_count`` set to ``subject.max_steps``.
    """
    return machine_test(credit_protocol_machine(subject), subject, settings_, "credit_protocol")
