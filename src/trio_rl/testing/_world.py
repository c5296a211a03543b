"""The per-example world: clock, scripted engine, book, and the adversary's moves.

One Hypothesis example is one ``trio.run`` under a manual ``MockClock``. The harness alternates
*steps* (Hypothesis draws one adversary move: settle a held engine call with some fate, settle
them all at once, or let virtual time pass) with *checks* made once every task is blocked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import trio
import trio.testing
from hypothesis import strategies as st

from ..engines import GenerateRequest
from ..rollout import CreditLedger, CreditView, GroupRunner, SubmissionPolicy
from ._engine import Call, Fate, FateKind, ScriptedEngine
from ._recorder import (
    CreditRecorder,
    RecordingPolicy,
    RecordingRunner,
    recording_generate,
    spec_rule,
)
from ._report import InvariantViolation, Trace, live_tasks
from ._subject import RolloutSubject

__all__ = ["World"]

_T = TypeVar("_T")

#: How long after a step settles a call it ends; 0 first, so shrinking goes towards
#: immediate, step-by-step schedules.
_DELAYS = st.sampled_from([0.0, 0.0, 1.0, 5.0])
_ADVANCE = st.sampled_from([1.0, 5.0, 30.0, 100.0])


class World:
    """Everything one example needs; the drivers' harnesses build on it."""

    def __init__(self, data: st.DataObject, subject: RolloutSubject, clock: trio.testing.MockClock):
        self.data = data
        self.subject = subject
        self.clock = clock
        self.trace = Trace()
        self.engine = ScriptedEngine(self._script)
        self.ledger: Callable[[], CreditLedger | None] = lambda: None
        self.recorder = CreditRecorder(self.trace, lambda: self.ledger())
        self.inner_policy: SubmissionPolicy = subject.policy()
        rule = subject.rule if subject.rule is not None else spec_rule(self.inner_policy)
        self.policy = RecordingPolicy(self.inner_policy, self.recorder, rule)
        generate = recording_generate(self.recorder, subject.generate(self.engine))
        self.runner = RecordingRunner(subject.runner(generate), self.recorder)

    @property
    def group_runner(self) -> GroupRunner:
        # The drivers are annotated with GroupRunner but only call ``run``.
        return cast(GroupRunner, self.runner)

    def draw(self, strategy: st.SearchStrategy[_T], label: str) -> _T:
        return self.data.draw(strategy, label=label)

    def log(self, step: str) -> None:
        self.trace.log(step)

    # -- the adversary -----------------------------------------------------------------
    # Every draw happens in the harness's own task, never inside the system under test, so
    # the schedule is one linear sequence of choices that Hypothesis can shrink.
    @staticmethod
    def _script(request: GenerateRequest) -> Fate:
        return Fate("stop")  # held: a step decides how and when it ends

    def _name(self, call: Call) -> str:
        return "sample " + (call.request.request_id.split("-", 1)[0] or str(call.number))

    def _fate(self, call: Call) -> tuple[FateKind, float]:
        kind = self.draw(st.sampled_from(self.subject.kinds), f"{self._name(call)}: fate")
        return kind, self.draw(_DELAYS, f"{self._name(call)}: after")

    async def engine_step(self, action: str) -> None:
        """Apply one engine move: ``settle``, ``settle all`` or ``advance``."""
        held = sorted(self.engine.held, key=lambda c: c.number)
        if action == "settle" and held:
            call = held[self.draw(st.integers(0, len(held) - 1), "which held call")]
            kind, after = self._fate(call)
            self.log(f"settle {self._name(call)}: {kind} after {after:g}s")
            self.engine.settle(call, kind, after=after)
        elif action == "settle all" and held:
            fates = [(call, *self._fate(call)) for call in held]
            self.log(
                "settle all at once: "
                + ", ".join(f"{self._name(c)}={k}@{a:g}s" for c, k, a in fates)
            )
            for call, kind, after in fates:
                self.engine.settle(call, kind, after=after)
        elif action == "advance":
            dt = self.draw(_ADVANCE, "advance seconds")
            self.log(f"advance {dt:g}s")
            self.clock.jump(dt)
        else:
            self.log(f"{action}: nothing to do")

    # -- checks ------------------------------------------------------------------------
    async def quiesce(self) -> None:
        """Let every task run until all are blocked; raise the first recorded violation."""
        await trio.testing.wait_all_tasks_blocked()
        self.recorder.raise_first()

    def check(self, ok: bool, invariant: int, detail: str) -> None:
        self.recorder.check(ok, invariant, detail)
        self.recorder.raise_first()

    def fail(self, invariant: int, detail: str) -> InvariantViolation:
        self.recorder.fail(invariant, detail)
        assert self.recorder.violation is not None
        return self.recorder.violation

    def check_awake(self, *, budget: int | None, group_size: int, may_submit: bool) -> None:
        """Invariant 5: the driver is blocked, so it must have no capacity to use.

        Called once every task is blocked. ``may_submit`` is False when the driver has a
        legitimate reason to sleep (paused, buffer full, nothing left to submit, done).
        """
        if not may_submit or budget is None:
            return
        c, p = self.recorder.truth()
        view = CreditView(in_flight=c, pending_groups=p, group_size=group_size, budget=budget)
        self.check(
            not self.inner_policy.admits(view),
            5,
            f"the driver is asleep although the policy admits {view} and prompts remain",
        )

    def last_budget(self) -> int | None:
        return self.recorder.decisions[-1][0].budget if self.recorder.decisions else None

    def check_no_leftovers(self, baseline: set[trio.lowlevel.Task], allowed: Sequence[object] = ()) -> None:
        """Nothing the system started is still running: tasks, engine calls, groups."""
        extra = live_tasks() - baseline - {trio.lowlevel.current_task()} - set(allowed)
        self.check(not extra, 8, f"tasks still running after close: {sorted(t.name for t in extra)}")
        running = self.engine.running
        self.check(not running, 8, f"{len(running)} engine calls still running after close")
        open_groups = self.recorder.open_groups
        self.check(
            not open_groups,
            2,
            f"{len(open_groups)} groups never ended: {[g.group_id for g in open_groups]}",
        )

    async def finish(
        self,
        done: Callable[[], bool],
        *,
        each_round: Callable[[], None] = lambda: None,
        rounds: int = 200,
        time_bound: float = math.inf,
    ) -> None:
        """End the run: settle everything held as ``stop`` and let deadlines pass until
        ``done()``. A run that cannot end, or needs more than ``rounds`` rounds or more
        than ``time_bound`` virtual seconds, violates invariant 6 (no deadlock)."""
        self.log("finish: settle everything held as stop, let deadlines pass")
        for _ in range(rounds):
            await self.quiesce()
            each_round()
            await self.quiesce()
            if done():
                return
            self.check(
                trio.current_time() <= time_bound,
                6,
                f"run still going at t={trio.current_time():g}s (bound {time_bound:g}s)",
            )
            held = self.engine.held
            if held:
                for call in held:
                    self.engine.settle(call, "stop")
                continue
            wait = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if math.isinf(wait):
                raise self.fail(
                    6,
                    "deadlock: the run has not ended, every task is blocked and nothing "
                    "(no engine call, no deadline) can wake one",
                )
            self.clock.jump(max(wait, 0.0))
        raise self.fail(6, f"the run did not end within {rounds} rounds")
