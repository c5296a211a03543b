"""The real sync driver as a rule-based state machine, each ``generate`` call a rule."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from ..rollout import GroupFactory
from ._checks import SyncCalls, sync_driver
from ._checks import prompts as _prompts
from ._machine import Machine, bind, machine_test
from ._report import live_tasks
from ._subject import HANG_TIMEOUT, RolloutSubject

__all__ = ["SyncDriverMachine", "sync_driver_machine", "sync_driver_test"]


class SyncDriverMachine(Machine):
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
            source = _prompts(prompts)
            factory = GroupFactory(group_size)
            driver = sync_driver(
                world,
                source,
                factory,
                per_admission=per_admission,
                filtering=filtering,
                partial=partial,
            )
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
            self.trio_run.start_soon(partial(self.guarded, self.one_call))

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


def sync_driver_machine(subject: RolloutSubject | None = None) -> type[RuleBasedStateMachine]:
    """A rule-based state machine for the real sync driver over ``subject``.

    The same checks as :func:`~trio_rl.testing.check_sync_driver`; each ``generate`` rule
    starts one call, which runs while the engine's rules settle its samples. Run it with
    ``.TestCase`` or :func:`sync_driver_test`.
    """
    return bind(SyncDriverMachine, "SyncDriver", subject, __name__)


def sync_driver_test(
    subject: RolloutSubject | None = None, *, settings_: settings | None = None
) -> Callable[[], None]:
    """A ready-made test that runs :func:`sync_driver_machine` for ``subject`` (settings as
    for :func:`credit_protocol_test`)."""
    return machine_test(sync_driver_machine(subject), subject, settings_, "sync_driver")
