"""A priority lane: credits for work that goes before a driver's own and never reaches it.

An evaluation shares the engines with training. Its groups take credits from the same budget
as the training driver's (so the engines see no more work than the budget allows), but they
are not the driver's groups: they never enter its ledger, its buffer or its book, so nothing
the lane runs is ever trained on.

The lane *goes first*: while a lane request waits for credits, the driver admits no new
group, so the credits its finishing samples return go to the lane. Attached, the lane stands
in front of the scheduler's submission policy (``scheduler.policy`` becomes a
:class:`LanePolicy` around it), so each of the driver's decisions asks the lane first
(:meth:`PriorityLane.decide`): waiting requests that now fit are granted there, and the lane's
credits count as in flight for the driver's own policy. A scheduler without a lane pays
nothing.

Detached (no scheduler: an offline eval, or a driver already closed), the lane is a plain
counting limit of ``limit`` credits.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING

import attrs
import trio

from .._validation import at_least
from ._credits import CreditView, SubmissionPolicy, replace_policy
from ._errors import RolloutConfigError

if TYPE_CHECKING:
    from ._credits import CreditScheduler

__all__ = ["LanePolicy", "LaneStatistics", "PriorityLane"]

logger = logging.getLogger("trio_rl.rollout.lane")


@attrs.frozen
class LaneStatistics:
    """A snapshot of a :class:`PriorityLane`: credits and groups it holds, requests waiting,
    requests granted so far, the driver decisions it refused while a request waited, and
    requests announced and not yet made."""

    held: int
    groups: int
    waiting: int
    granted: int
    refused: int
    announced: int = 0


@attrs.define(slots=True, eq=False)
class _Request:
    credits: int
    granted: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(slots=True, eq=False)
class PriorityLane:
    """Credits for work that goes first and is never the driver's (see the module docs).

    ``limit`` bounds the credits the lane holds when it is detached; attached, the driver's
    budget bounds them. ``recheck`` (seconds) is how often a waiting request looks at the
    driver's ledger itself, for when the driver is not deciding (paused, or waiting for room in
    its buffer); ``warn_after`` (seconds) is when a waiting request logs what it waits for.

    Use: ``lane.announce(m)`` for the ``m`` groups to come, ``await lane.acquire(n)`` before
    starting ``n`` samples' work, ``lane.release(n)`` when they ended (in a ``finally``).
    Attach it to a driver's scheduler with :meth:`attach` (``with
    lane.attach(driver.scheduler): ...``).
    """

    limit: int = attrs.field(default=256, validator=at_least(1))
    recheck: float = attrs.field(default=0.05, validator=at_least(0.0))
    warn_after: float = attrs.field(default=10.0, validator=at_least(0.0))
    held: int = attrs.field(default=0, init=False)
    groups: int = attrs.field(default=0, init=False)
    _scheduler: CreditScheduler | None = attrs.field(default=None, init=False)
    _budget: int | None = attrs.field(default=None, init=False)
    _waiting: deque[_Request] = attrs.field(factory=deque, init=False)
    #: Requests announced (:meth:`announce`) and not granted yet.
    _announced: int = attrs.field(default=0, init=False)
    _granted: int = attrs.field(default=0, init=False)
    _refused: int = attrs.field(default=0, init=False)

    # -- the driver's side ---------------------------------------------------------------

    def attach(self, scheduler: CreditScheduler, budget: int | None = None) -> _Attached:
        """Share ``scheduler``'s budget for the ``with`` block (``budget``: the driver's
        budget in groups, until its first decision tells the lane). Leaving the block
        detaches the lane; work it holds keeps its credits against ``limit``."""
        return _Attached(self, scheduler, budget)

    def decide(self, view: CreditView) -> CreditView | None:
        """The driver's view at a decision, as the lane changes it: waiting requests that fit
        are granted first; None while one still waits (the driver admits nothing), else the
        view with the lane's credits and groups counted in flight."""
        self._budget = view.budget
        if self._waiting or self._announced:
            self._grant(view)
            if self._waiting or self._announced:
                self._refused += 1
                return None
        if not self.held:
            return view
        return CreditView(
            in_flight=view.in_flight + self.held,
            pending_groups=view.pending_groups + self.groups,
            group_size=view.group_size,
            budget=view.budget,
        )

    # -- the lane's side -----------------------------------------------------------------

    def announce(self, requests: int) -> None:
        """``requests`` more :meth:`acquire` calls are coming (an eval's prompts): until each
        is granted, the driver admits nothing new, so the credits its finishing samples free
        all go to the lane, not to a training group started between two of its requests. A
        negative count withdraws what will not be asked after all (an eval cut short)."""
        self._announced = max(0, self._announced + requests)
        if requests < 0:
            self._wake_driver("priority lane withdrew")

    async def acquire(self, credits: int) -> None:
        """Wait until ``credits`` credits are the lane's (one group of that many samples).

        Requests are granted in order. Cancelled while waiting, the request is withdrawn;
        cancelled after the grant, the credits are given back: either way nothing is held.
        """
        request = _Request(max(0, credits))
        self._waiting.append(request)
        self._grant(None)
        if not request.granted.is_set():
            self._wake_driver("priority lane waits")
        try:
            waited = 0.0
            while not request.granted.is_set():
                # The driver grants at its decisions; one that is not deciding (paused, or
                # waiting for room in its buffer) is covered by looking at its ledger here.
                with trio.move_on_after(self.recheck or math.inf):
                    await request.granted.wait()
                waited += self.recheck
                if not request.granted.is_set():
                    self._grant(None)
                    if self.warn_after and waited >= self.warn_after:
                        logger.info(
                            "priority lane: waiting %.0f s for %d credits (%d held, %d in "
                            "flight for the driver)",
                            waited,
                            credits,
                            self.held,
                            self._driver_view().in_flight,
                        )
                        waited = 0.0
        except BaseException:
            if request.granted.is_set():
                self.release(request.credits)
            else:
                self._waiting.remove(request)
                self._wake_driver("priority lane withdrew")
            raise

    def release(self, credits: int) -> None:
        """The work of one acquired group ended: its credits come back (synchronous, safe in a
        ``finally``); waiting requests that now fit are granted, and the driver is woken."""
        self.held -= max(0, credits)
        self.groups -= 1
        self._grant(None)
        self._wake_driver("priority lane released")

    def statistics(self) -> LaneStatistics:
        return LaneStatistics(
            held=self.held,
            groups=self.groups,
            waiting=len(self._waiting),
            granted=self._granted,
            refused=self._refused,
            announced=self._announced,
        )

    # -- internals -------------------------------------------------------------------------

    def _driver_view(self) -> CreditView:
        scheduler = self._scheduler
        if scheduler is None:
            return CreditView(in_flight=0, pending_groups=0, group_size=1, budget=0)
        scheduler.settle()  # the reports made since the driver's last drain count
        budget = self._budget if self._budget is not None else 0
        return scheduler.view(budget)

    def _fits(self, credits: int, view: CreditView) -> bool:
        if not self.held and not view.pending_groups:
            return True  # nothing else runs: any request fits, however large
        scheduler = self._scheduler
        if scheduler is None or not isinstance(scheduler.policy, LanePolicy):
            return self.held + credits <= self.limit
        # As if a group of the driver's size held ``credits``: sample backfill compares
        # credits with B x G, group granularity counts the group.
        as_group = CreditView(
            in_flight=max(0, view.in_flight + self.held + credits - view.group_size),
            pending_groups=view.pending_groups + self.groups,
            group_size=view.group_size,
            budget=view.budget,
        )
        return bool(scheduler.policy.inner.admits(as_group))

    def _grant(self, view: CreditView | None) -> None:
        if not self._waiting:
            return
        if view is None:
            view = self._driver_view()
        while self._waiting and self._fits(self._waiting[0].credits, view):
            request = self._waiting.popleft()
            self._announced = max(0, self._announced - 1)
            self.held += request.credits
            self.groups += 1
            self._granted += 1
            request.granted.set()

    def _wake_driver(self, reason: str) -> None:
        scheduler = self._scheduler
        if scheduler is None:
            return
        try:
            scheduler.nudge(reason)
        except trio.ClosedResourceError:
            self._scheduler = None  # the driver closed: the lane goes on alone


@attrs.frozen
class LanePolicy:
    """A scheduler's submission policy while a :class:`PriorityLane` is attached: the lane
    decides first (:meth:`PriorityLane.decide`), then ``inner``, the driver's own policy,
    on the view with the lane's credits in flight."""

    inner: SubmissionPolicy
    lane: PriorityLane

    @property
    def counts_samples(self) -> bool:
        return bool(self.inner.counts_samples)

    def admits(self, view: CreditView) -> bool:
        seen = self.lane.decide(view)
        return seen is not None and bool(self.inner.admits(seen))


@attrs.define(slots=True, eq=False)
class _Attached:
    """``with lane.attach(scheduler):`` the lane shares the scheduler's budget."""

    lane: PriorityLane
    scheduler: CreditScheduler
    budget: int | None

    def __enter__(self) -> PriorityLane:
        lane, scheduler = self.lane, self.scheduler
        if lane._scheduler is not None or isinstance(scheduler.policy, LanePolicy):
            raise RolloutConfigError("a PriorityLane is attached to one scheduler at a time")
        lane._scheduler = scheduler
        if self.budget is not None:
            lane._budget = self.budget
        replace_policy(scheduler, LanePolicy(scheduler.policy, lane))
        lane._grant(None)
        return lane

    def __exit__(self, *exc: object) -> None:
        lane, scheduler = self.lane, self.scheduler
        if isinstance(scheduler.policy, LanePolicy) and scheduler.policy.lane is lane:
            replace_policy(scheduler, scheduler.policy.inner)
        lane._wake_driver("priority lane detached")
        lane._scheduler = None
        lane._budget = None
        lane._grant(None)  # detached: waiting requests now fit the lane's own limit
