"""`Deadlines`: the deadlines of many cancel scopes, kept in dicts and served by one task.

trio keeps a cancel scope's deadline in a heap, and a scope that closes before its deadline
leaves its entry there, the scope with it, until the heap is next pruned. A tool call's
deadline (``tool_timeout``, 30 s by default) and an episode's (``episode_timeout``, 600 s)
nearly always close long before they fall due, so with 10,000 episodes in flight the heap
holds tens of thousands of closed scopes that the garbage collector walks again and again:
``bench_episodes`` at 10,000 episodes measured a tool call's scope with a deadline at 0.10x
of a single-turn sample's CPU more than the same scope without one.

Here arming a deadline is a dict insert and disarming it a delete, so a closed scope is freed
at once. One task sleeps until the earliest armed deadline and cancels its scope, exactly as
the scope's own deadline would have. Deadlines of one duration fall due in the order they are
armed, so each duration keeps an insertion-ordered dict of its own (a "lane"): the earliest
deadline is the first entry of one of the lanes.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import attrs
import trio

__all__ = ["Deadlines"]


@attrs.define(slots=True, eq=False)
class _Served:
    """A cancel scope entered with a deadline that `Deadlines` serves (`Deadlines.after`)."""

    deadlines: Deadlines
    seconds: float
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    def __enter__(self) -> trio.CancelScope:
        self.deadlines.arm(self.scope, self.seconds)
        return self.scope.__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        self.deadlines.disarm(self.scope, self.seconds)
        return self.scope.__exit__(*exc_info)


@attrs.define(eq=False)
class Deadlines:
    """Deadlines of cancel scopes, served by :meth:`serve` (one task, in the nursery of
    whoever owns the scopes' lifetimes: :class:`~trio_rl.envs.EpisodeRunner`).

    :meth:`arm` gives a scope a deadline ``seconds`` from now; :meth:`disarm` takes it back
    (call it when the scope closes, whether or not it fell due). A scope whose deadline falls
    due is cancelled with :meth:`trio.CancelScope.cancel`: its ``cancel_called`` and
    ``cancelled_caught`` read as they would after its own deadline.
    """

    #: duration -> {scope: deadline}, in the order armed (so in the order they fall due)
    _lanes: dict[float, dict[trio.CancelScope, float]] = attrs.field(factory=dict, init=False)
    #: the serving task's sleep (None while it is not sleeping) and when it ends
    _sleep: trio.CancelScope | None = attrs.field(default=None, init=False)
    _wakes: float = attrs.field(default=math.inf, init=False)
    #: whether :meth:`serve` runs (once it stopped, no deadline armed here would fall due)
    serving: bool = attrs.field(default=False, init=False)

    def arm(self, scope: trio.CancelScope, seconds: float) -> None:
        """Cancel ``scope`` ``seconds`` from now, unless disarmed first (each scope is armed
        once: its lane keeps the order it was first armed in)."""
        deadline = trio.current_time() + seconds
        lane = self._lanes.get(seconds)
        if lane is None:
            lane = self._lanes[seconds] = {}
        lane[scope] = deadline
        if deadline < self._wakes and self._sleep is not None:
            self._sleep.cancel()  # the server sleeps past it: it looks again

    def disarm(self, scope: trio.CancelScope, seconds: float) -> None:
        """Forget ``scope``'s deadline (armed with ``seconds``); nothing if it fell due."""
        self._lanes[seconds].pop(scope, None)

    def after(self, seconds: float) -> _Served:
        """``with deadlines.after(seconds) as scope:``, like ``trio.move_on_after(seconds)``:
        a cancel scope whose deadline this server keeps while it is open."""
        return _Served(self, seconds)

    @property
    def armed(self) -> int:
        """How many deadlines are armed."""
        return sum(len(lane) for lane in self._lanes.values())

    def _fire(self, now: float) -> float:
        """Cancel the scopes due by ``now``; the next deadline (a function of its own, so that
        no scope stays referenced from the serving task's frame while it sleeps)."""
        wakes = math.inf
        for lane in self._lanes.values():
            while lane:
                scope = next(iter(lane))
                deadline = lane[scope]
                if deadline > now:
                    wakes = min(wakes, deadline)
                    break
                del lane[scope]
                scope.cancel()
        return wakes

    async def serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Cancel every armed scope whose deadline falls due, as it falls due; runs until
        cancelled (its owner's nursery closing), and holds nothing then. Started with
        ``nursery.start``: :attr:`serving` is true once it returns."""
        self.serving = True
        task_status.started()
        try:
            while True:
                self._wakes = self._fire(trio.current_time())
                try:
                    with trio.CancelScope(deadline=self._wakes) as self._sleep:
                        await trio.sleep_forever()
                finally:
                    self._sleep = None
        finally:
            self.serving = False
            # a scope still open keeps its deadline: trio's own, from here on
            for lane in self._lanes.values():
                for scope, deadline in lane.items():
                    scope.deadline = deadline
            self._lanes.clear()
