"""A scripted, adversarial engine: every request's fate is decided by the test.

The engine never generates anything real. Each ``generate`` call asks a *script* for a
:class:`Fate`: finish (``stop``/``length``), return an ``abort`` finish reason, raise
:class:`ScriptedEngineError`, or hang. A fate with ``after=None`` parks the call until the test
settles it with :meth:`ScriptedEngine.settle`; this is how a Hypothesis schedule picks, step by
step, which in-flight sample ends next and how. Under ``trio.testing.MockClock`` a fate with a
delay ends after that many virtual seconds.

Every call is recorded (start, how it ended, when), so a test can check that nothing is left
running and that every started sample settled exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import trio

from ..engines import Completion, GenerateRequest
from ..samples import PolicyVersion
from ._errors import ScriptedEngineError

__all__ = [
    "Call",
    "Fate",
    "FateKind",
    "ScriptedEngine",
]

#: ``stop``/``length``: a normal completion; ``abort``: a completion with finish reason
#: ``abort``; ``raise``: :class:`ScriptedEngineError`; ``hang``: wait until cancelled.
FateKind = Literal["stop", "length", "abort", "raise", "hang"]
_KINDS: tuple[str, ...] = ("stop", "length", "abort", "raise", "hang")


@attrs.frozen
class Fate:
    """What one ``generate`` call does.

    ``after`` is the virtual delay before acting; ``None`` means "held until
    :meth:`ScriptedEngine.settle` decides" (the fate then only says how it ends by default).
    ``tokens`` is the completion length for a finishing fate.
    """

    kind: FateKind = attrs.field(validator=attrs.validators.in_(_KINDS))
    after: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.ge(0.0)),
    )
    tokens: int = attrs.field(default=1, validator=attrs.validators.ge(0))


#: How a call ended; ``None`` while it is running.
Outcome = Literal["stop", "length", "abort", "raise", "cancelled"]


@attrs.define(slots=True, eq=False)
class Call:
    """The record of one ``generate`` call."""

    number: int
    request: GenerateRequest
    fate: Fate
    started_at: float
    ended_at: float | None = None
    outcome: Outcome | None = None
    _release: trio.Event = attrs.field(factory=trio.Event, alias="_release")
    _forced: Fate | None = attrs.field(default=None, alias="_forced")
    #: Released by :meth:`ScriptedEngine.fail_together`: raise on waking, with no checkpoint.
    _at_once: bool = attrs.field(default=False, alias="_at_once")

    @property
    def running(self) -> bool:
        return self.outcome is None


def _always_stop(_request: GenerateRequest) -> Fate:
    return Fate("stop", after=0.0)


class ScriptedEngine:
    """An :class:`~trio_rl.engines.Engine` whose every call follows a script.

    ``script(request)`` is called once per ``generate`` call, synchronously, when it starts (so
    a Hypothesis ``data.draw`` inside it is fine: trio's scheduling is deterministic under
    Hypothesis). ``policy_version`` is stamped on completions; set the attribute to simulate a
    weight update.

    On cancellation a call records outcome ``"cancelled"`` and lets ``Cancelled`` propagate,
    like a real engine abandoning the request. When the request's abort signal
    (:attr:`~trio_rl.engines.GenerateRequest.abort`, the soft stop of partial rollouts) is set
    while the call waits, it returns an empty completion with finish reason ``abort``; a call
    settled as ``hang`` ignores the signal.
    """

    def __init__(
        self,
        script: Callable[[GenerateRequest], Fate] = _always_stop,
        *,
        policy_version: PolicyVersion = 0,
    ) -> None:
        self.script = script
        self.policy_version = policy_version
        self.calls: list[Call] = []
        self._numbers = itertools.count()

    # -- the Engine protocol -------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        fate = self.script(request)
        call = Call(next(self._numbers), request, fate, trio.current_time())
        self.calls.append(call)
        outcome: Outcome = "cancelled"
        try:
            final = fate
            # A driver's soft stop (request.abort) ends the wait like a real engine: the call
            # returns what it has (nothing) with finish reason ``abort``. A ``hang`` ignores it.
            with request.abort.scope() if request.abort is not None else trio.CancelScope() as stop:
                if fate.after is None:
                    await call._release.wait()
                else:
                    with trio.move_on_after(fate.after):
                        await call._release.wait()
                if call._forced is not None:
                    final = call._forced
                    if not call._at_once:
                        await trio.sleep(final.after or 0.0)
            if stop.cancelled_caught:
                outcome = "abort"
                return Completion(
                    tokens=[],
                    logprobs=[],
                    finish_reason="abort",
                    policy_version=self.policy_version,
                )
            if final.kind == "hang":
                await trio.sleep_forever()
            if final.kind == "raise":
                outcome = "raise"
                raise ScriptedEngineError(f"scripted failure of call {call.number}")
            outcome = final.kind
            return Completion(
                tokens=list(range(final.tokens)),
                logprobs=[-1.0] * final.tokens,
                finish_reason=final.kind,
                policy_version=self.policy_version,
            )
        finally:
            call.outcome = outcome
            call.ended_at = trio.current_time()

    # -- control and inspection --------------------------------------------------------
    def settle(self, call: Call, kind: FateKind | None = None, *, after: float = 0.0) -> None:
        """Decide a held (or delayed) call: it ends as ``kind`` ``after`` virtual seconds from
        now (default: now, as its scripted fate).

        ``kind="hang"`` turns it into a call that only cancellation ends. Settling a call that
        already ended or was already settled raises ``ValueError``.
        """
        if not call.running or call._release.is_set():
            raise ValueError(f"call {call.number} is not waiting to be settled")
        if kind is not None or after:
            call._forced = Fate(kind or call.fate.kind, after=after, tokens=call.fate.tokens)
        call._release.set()

    def fail_together(self, calls: Sequence[Call]) -> None:
        """Make the held ``calls`` all raise :class:`ScriptedEngineError` in the same tick.

        They are released together and each raises as soon as it wakes, with no checkpoint in
        between, so a cancellation that the first failure triggers (a group runner cancelling
        the siblings) cannot reach the others first: like a real engine failing several
        samples that wait on one event. Raises ``ValueError`` if one is not held.
        """
        for call in calls:
            if not call.running or call._release.is_set():
                raise ValueError(f"call {call.number} is not waiting to be settled")
        for call in calls:
            call._forced = Fate("raise", after=0.0, tokens=call.fate.tokens)
            call._at_once = True
            # Setting each event in this one synchronous stretch wakes all of them in the same
            # scheduler batch, exactly as one shared event would.
            call._release.set()

    @property
    def requests(self) -> list[GenerateRequest]:
        """Every request the engine was asked, in the order the calls started."""
        return [c.request for c in self.calls]

    @property
    def running(self) -> list[Call]:
        """Calls that have started and not ended (including hanging ones)."""
        return [c for c in self.calls if c.running]

    @property
    def held(self) -> list[Call]:
        """Running calls that :meth:`settle` can still end (not yet released)."""
        return [c for c in self.calls if c.running and not c._release.is_set()]
