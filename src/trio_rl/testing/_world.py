"""The per-example world: clock, scripted engine, recorder, and the adversary's moves.

One Hypothesis example is one ``trio.run`` under a manual ``MockClock``. The harness alternates
*steps* (Hypothesis draws one adversary move: settle a held engine call with some fate, settle
them all at once, make several raise in the same tick, or let virtual time pass) with *checks*
made once every task is blocked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast

import trio
import trio.testing
from hypothesis import strategies as st

from ..engines import GenerateRequest
from ..rollout import CreditLedger, CreditView, GroupRunner, SubmissionPolicy
from ._engine import Call, Fate, ScriptedEngine
from ._errors import Invariant, InvariantViolationError
from ._recorder import (
    CreditRecorder,
    RecordingPolicy,
    RecordingRunner,
    recording_generate,
    spec_rule,
)
from ._report import Trace, live_tasks
from ._strategies import ADVANCE_SECONDS, Step, schedules
from ._subject import RolloutSubject

__all__ = ["World"]

_T = TypeVar("_T")


class World:
    """Everything one example needs; the drivers' harnesses build on it."""

    def __init__(
        self,
        data: st.DataObject | None,
        subject: RolloutSubject,
        clock: trio.testing.MockClock,
        *,
        policy: int | None = None,
    ):
        # ``data`` is None when the caller draws everything itself (the stateful machine,
        # which also picks the policy: ``policy`` indexes ``subject.policies``).
        self.data = data
        self.subject = subject
        self.clock = clock
        self.trace = Trace()
        self.engine = ScriptedEngine(self._script)
        self.ledger: Callable[[], CreditLedger | None] = lambda: None
        self.recorder = CreditRecorder(self.trace, lambda: self.ledger())
        factories = subject.policies
        if policy is not None:
            factory = factories[policy % len(factories)]
        elif len(factories) == 1:
            factory = factories[0]
        else:
            factory = self.draw(st.sampled_from(factories), "policy")
        self.inner_policy: SubmissionPolicy = factory()
        self.log(f"policy {self.inner_policy!r}")
        rule = subject.rule if subject.rule is not None else spec_rule(self.inner_policy)
        self.policy = RecordingPolicy(self.inner_policy, self.recorder, rule)
        generate = recording_generate(self.recorder, subject.generate(self.engine))
        self.runner = RecordingRunner(subject.runner(generate), self.recorder)

    @property
    def group_runner(self) -> GroupRunner:
        # The drivers are annotated with GroupRunner but only call ``run``.
        return cast("GroupRunner", self.runner)

    def draw(self, strategy: st.SearchStrategy[_T], label: str) -> _T:
        assert self.data is not None, "a World built with data=None draws nothing"
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

    def schedule(self, actions: Sequence[str]) -> list[Step]:
        """Draw the whole adversarial schedule at once (see :func:`schedules`)."""
        strategy = schedules(actions, self.subject.kinds, max_steps=self.subject.max_steps)
        return self.draw(strategy, "schedule")

    async def engine_step(self, step: Step) -> None:
        """Apply one engine move: ``settle``, ``settle all``, ``fail together`` or ``advance``."""
        held = sorted(self.engine.held, key=lambda c: c.number)
        if step.action == "settle" and held:
            call = held[step.pick % len(held)]
            self.log(f"settle {self._name(call)}: {step.kind} after {step.after:g}s")
            self.engine.settle(call, step.kind, after=step.after)
        elif step.action == "settle all" and held:
            # All at once: the picked call gets the step's fate, the others finish normally.
            chosen = held[step.pick % len(held)]
            self.log(
                f"settle all {len(held)} held at once after {step.after:g}s: "
                f"{self._name(chosen)} {step.kind}, the rest stop"
            )
            for call in held:
                self.engine.settle(call, step.kind if call is chosen else "stop", after=step.after)
        elif step.action == "fail together" and held and "raise" in self.subject.kinds:
            # Several calls raise in one tick (1 + value of them, from the picked one on): the
            # runner sees more than one failure before any cancellation lands.
            start = step.pick % len(held)
            failing = (held + held)[start : start + min(len(held), 1 + step.value)]
            names = ", ".join(self._name(c) for c in failing)
            self.log(f"fail together {len(failing)} held in one tick: {names}")
            self.engine.fail_together(failing)
        elif step.action == "advance":
            dt = ADVANCE_SECONDS[(step.value - 1) % len(ADVANCE_SECONDS)]
            self.log(f"advance {dt:g}s")
            self.clock.jump(dt)
        else:
            self.log(f"{step.action}: nothing to do")

    # -- checks ------------------------------------------------------------------------
    async def quiesce(self) -> None:
        """Let every task run until all are blocked; raise the first recorded violation."""
        await trio.testing.wait_all_tasks_blocked()
        self.recorder.raise_first()

    def check(self, ok: bool, invariant: Invariant, detail: str) -> None:
        self.recorder.check(ok, invariant, detail)
        self.recorder.raise_first()

    def fail(self, invariant: Invariant, detail: str) -> InvariantViolationError:
        self.recorder.fail(invariant, detail)
        assert self.recorder.violation is not None
        return self.recorder.violation

    def check_awake(
        self, *, budget: int | None, group_size: int, may_submit: bool, drains: bool = True
    ) -> None:
        """``NO_LOST_WAKEUP``: the driver is blocked, so it must have no capacity to use and no
        completion it has not applied.

        Called once every task is blocked. ``may_submit`` is False when the driver has a
        legitimate reason not to submit (paused, buffer full, nothing left to submit);
        ``drains`` is False while it may legitimately block on something other than progress
        (backpressure), so undrained completions are expected.
        """
        ledger = self.ledger()
        if ledger is not None and drains:
            pending = ledger.pending()
            stale = [
                gid
                for gid, record in self.recorder.groups.items()
                if record.ended and gid in pending and not self.recorder.not_started(ledger, gid)
            ]
            self.check(
                not stale,
                Invariant.NO_LOST_WAKEUP,
                f"the driver is asleep although group {stale[:1]} ended (its completion "
                "was never applied to the ledger)",
            )
        if not may_submit or budget is None:
            return
        c, p = self.recorder.truth()
        view = CreditView(in_flight=c, pending_groups=p, group_size=group_size, budget=budget)
        self.check(
            not self.inner_policy.admits(view),
            Invariant.NO_LOST_WAKEUP,
            f"the driver is asleep although the policy admits {view} and prompts remain",
        )

    def last_budget(self) -> int | None:
        return self.recorder.decisions[-1][0].budget if self.recorder.decisions else None

    def check_no_leftovers(
        self, baseline: set[trio.lowlevel.Task], allowed: Iterable[trio.lowlevel.Task] = ()
    ) -> None:
        """Nothing the system started is still running: tasks, engine calls, groups."""
        extra = live_tasks() - baseline - {trio.lowlevel.current_task()} - set(allowed)
        self.check(
            not extra,
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            f"tasks still running after close: {sorted(t.name for t in extra)}",
        )
        running = self.engine.running
        self.check(
            not running,
            Invariant.ASYNC_BOUNDED_PAUSED_CLOSED,
            f"{len(running)} engine calls still running after close",
        )
        open_groups = self.recorder.open_groups
        self.check(
            not open_groups,
            Invariant.OUTCOME_AFTER_SAMPLES_SETTLE,
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
        than ``time_bound`` virtual seconds, violates ``NO_DEADLOCK``."""
        self.log("finish: settle everything held as stop, let deadlines pass")
        idle_at: tuple[int, int, int] | None = None
        for _ in range(rounds):
            await self.quiesce()
            each_round()
            await self.quiesce()
            if done():
                return
            self.check(
                trio.current_time() <= time_bound,
                Invariant.NO_DEADLOCK,
                f"run still going at t={trio.current_time():g}s (bound {time_bound:g}s)",
            )
            held = self.engine.held
            if held:
                for call in held:
                    self.engine.settle(call, "stop")
                continue
            wait = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if not math.isinf(wait):
                self.clock.jump(max(wait, 0.0))
                continue
            # Nothing to settle and no deadline: fine once if ``each_round`` made progress
            # (say, a consumer took a batch); twice in a row with no progress is a deadlock.
            progress = (len(self.trace.steps), len(self.engine.calls), len(self.recorder.decisions))
            if progress == idle_at:
                raise self.fail(
                    Invariant.NO_DEADLOCK,
                    "deadlock: the run has not ended, every task is blocked and nothing "
                    "(no engine call, no deadline, no consumer) can wake one",
                )
            idle_at = progress
        raise self.fail(Invariant.NO_DEADLOCK, f"the run did not end within {rounds} rounds")
