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

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import ClassVar, TypeVar

import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ._engine import FateKind
from ._hypothesis import PHASES, namespaced, subject_digest
from ._strategies import DELAYS, Step
from ._subject import RolloutSubject
from ._world import World

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
        self._nursery: trio.Nursery | None = None
        #: What ended the run other than `close` (a background task's failure), raised by it.
        self._failure: BaseException | None = None
        # A daemon so that a run stuck past `close`'s deadline, which it then raises, cannot
        # hold the test process's exit; otherwise `close` joins it.
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self._thread.start()
        if not self._ready.wait(_THREAD_TIMEOUT):
            raise RuntimeError(f"the example's trio run did not start in {_THREAD_TIMEOUT:g}s")

    def _thread_main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            # the example's background tasks (a driver held open, a credit loop, a generate()
            # call that outlives its rule) live here, so ending the run cancels and awaits them
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main, clock=self._clock)
        except BaseException as exc:  # seen by the machine's thread, in `close`
            self._failure = exc
        finally:
            self._ready.set()

    def call(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``fn`` in the trio thread and return its result (or raise its exception)."""
        return trio.from_thread.run(fn, trio_token=self._token)

    def start_soon(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Start ``fn`` as a task of the run's nursery (call from inside the run)."""
        assert self._nursery is not None
        self._nursery.start_soon(fn)

    def close(self, *, raise_failure: bool = True) -> None:
        """End the run (its background tasks are cancelled and awaited) and join its thread;
        then raise what ended the run otherwise, if anything did (``raise_failure`` False: an
        error already on its way out must not be replaced by it)."""
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it ended on its own meanwhile
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(_THREAD_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"the example's trio run did not end in {_THREAD_TIMEOUT:g}s")
        if self._failure is not None and raise_failure:
            raise RuntimeError("the example's trio run failed") from self._failure


def _held(machine: Machine) -> int:
    world = machine.world
    return 0 if world is None or not machine.moving else len(world.engine.held)


class Machine(RuleBasedStateMachine):
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
        """Everything the recorder saw, and the machine's own checks."""

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
        except BaseException:
            self.trio_run.close(raise_failure=False)
            raise
        self.trio_run.close(raise_failure=not self.failed)


def bind(
    base: type[Machine], name: str, subject: RolloutSubject | None, module: str
) -> type[Machine]:
    """``base`` bound to ``subject`` (the default subject if None), as class ``name`` of
    ``module``."""
    chosen = subject if subject is not None else RolloutSubject()
    machine = type(name, (base,), {"subject": chosen, "__module__": module})
    return machine


def machine_test(
    machine: type[RuleBasedStateMachine],
    subject: RolloutSubject | None,
    settings_: settings | None,
    name: str,
) -> Callable[[], None]:
    """A test that runs ``machine`` (bound to ``subject``) under ``settings_``, by default the
    active profile's with ``report_multiple_bugs=False``, no ``explain`` phase and
    ``stateful_step_count`` set to ``subject.max_steps``."""
    chosen_subject = subject if subject is not None else RolloutSubject()
    chosen = (
        settings_
        if settings_ is not None
        else settings(
            report_multiple_bugs=False,
            phases=PHASES,
            stateful_step_count=max(chosen_subject.max_steps, 1),
        )
    )
    # As for the properties: saved failing examples are namespaced by the subject.
    chosen = namespaced(chosen, f"{name}|".encode() + subject_digest(chosen_subject))

    def test() -> None:
        run_state_machine_as_test(machine, settings=chosen)

    test.__name__ = test.__qualname__ = f"test_{name}"
    return test
