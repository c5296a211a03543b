"""`Admission` and `Expiry`: the async driver's staleness-aware admission of new groups and
early cancellation of running groups whose work can no longer train."""

from __future__ import annotations

from typing import Protocol

import trio

from ..policy import PolicyVersionCell
from ..samples import Group, GroupBook, PolicyVersion, SampleStatus
from ._buffer import run_booked
from ._credits import CreditScheduler, GroupOutcome, GroupStatus
from ._factory import GroupFactory
from ._group import GroupRunner
from ._triage import AsyncTally, GroupTriage

__all__ = ["Admission", "Expiry"]


class _Driver(Protocol):
    """What :class:`Expiry` uses of its driver (an ``AsyncRolloutDriver``)."""

    runner: GroupRunner
    scheduler: CreditScheduler
    book: GroupBook | None
    factory: GroupFactory
    version: PolicyVersionCell
    triage: GroupTriage
    _closed: bool
    _running: dict[str, Group]
    _tally: AsyncTally

    def _recycle(self, group: Group) -> None: ...


class Admission(Protocol):
    """Staleness-aware admission: whether new work can still be trained in time.

    The driver asks :meth:`admits` before it takes a new prompt (after the credit policy said
    yes), and, after :meth:`Expiry.reconsider`, asks :meth:`expired` of every group
    still running: a group whose work can no longer be trained is cancelled early, its credits
    come back, its prompt is recycled, and it is discarded as ``"stale"`` (counted in
    ``AsyncDriverStatistics.cancelled_stale``) instead of being generated to the end and
    dropped. Both are called on the event loop and must not block.
    """

    def admits(self, version: PolicyVersion, samples: int) -> bool:
        """May a new group of ``samples`` samples start now, at policy ``version``?"""
        ...

    def expired(self, group: Group) -> bool:
        """Is every member of running ``group`` (those still to generate included) certain to
        be too stale to train now? Judge each member as the consumer will (a resumed group's
        new members by the version their attempt started at, not the group's start)."""
        ...


class Expiry:
    """A driver's staleness-aware admission and early cancellation (see :class:`Admission`;
    ``driver.expiry``): the running groups' cancel scopes, and the groups cancelled because
    their work could no longer train."""

    def __init__(self, admission: Admission | None, driver: _Driver) -> None:
        self.admission = admission
        self._driver = driver
        self._scopes: dict[str, trio.CancelScope] = {}
        self._expired: set[str] = set()

    def reconsider(self, reason: str = "") -> None:
        """Something the :class:`Admission` reads changed (a batch shipped, the policy version
        advanced, work was scored): cancel every running group whose work expired, and wake
        the driver to decide again."""
        self._cancel_expired()
        if not self._driver._closed:
            self._driver.scheduler.nudge(reason or "reconsider")

    def blocks(self) -> bool:
        """Whether admission holds back a new group now (counted as ``held_back``)."""
        d = self._driver
        if self.admission is None or self.admission.admits(d.version.value, d.factory.group_size):
            return False
        d._tally.held_back += 1
        return True

    async def run(self, group: Group) -> None:
        """The group's task: :func:`run_booked` under a cancel scope of its own."""
        d = self._driver
        if self.admission is None:
            # Nothing can expire: no cancel scope and no entry per group. Speed over one code
            # path: a scope's enter and exit measured 4.8 us (busy VM), ~0.6 us per sample.
            await run_booked(d.runner, group, d.scheduler, d.book)
            return
        scope = self._scopes[group.group_id] = trio.CancelScope()
        try:
            with scope:
                await run_booked(d.runner, group, d.scheduler, d.book)
        finally:
            self._scopes.pop(group.group_id, None)

    def _cancel_expired(self) -> None:
        if self.admission is None:
            return
        running = self._driver._running
        for gid, scope in self._scopes.items():
            group = running.get(gid)
            if (
                group is not None
                and gid not in self._expired
                and not self._scoring(group)
                and self.admission.expired(group)
            ):
                self._expired.add(gid)
                scope.cancel()

    def _scoring(self, group: Group) -> bool:
        """Whether ``group`` is past the point where expiry saves anything: no member is left
        to generate (only rewards remain), or a member's reward call is in flight. Such a group
        is never cancelled as stale: its reward calls end by their own timeout, the group
        finishes, and the sink judges (and counts) its members' staleness as usual. Cancelling
        it would recycle its prompt, and a record whose reward hangs would come back, hang
        again and hold a slot each time."""
        samples = group.samples
        if all(s.status is not SampleStatus.PENDING for s in samples):
            return True
        if self._driver.runner.sample_reward is None:
            return False
        # generated, not yet scored: its reward call is running (a failed call sets a reward)
        return any(s.status.is_finished and s.reward is None for s in samples)

    def take(self, outcome: GroupOutcome) -> bool:
        """Settle ``outcome`` if it is of a group cancelled as expired (and not failed): its
        prompt goes back to the source and every member settles as stale (it was too stale
        to train either way)."""
        group, d = outcome.group, self._driver
        if group.group_id not in self._expired:
            return False
        self._expired.discard(group.group_id)
        if outcome.status is GroupStatus.FAILED:
            return False
        d._tally.cancelled_stale += 1
        d._tally.cancelled_stale_samples += group.size
        d._recycle(group)
        d.triage.discard(group, "stale")
        return True
