"""The close of the fully-async driver: work that is ready finishes before the cancellation."""

from __future__ import annotations

import trio

from ._credits import CreditScheduler

__all__ = ["wind_down"]

#: At most this many scheduling passes for ready work when the driver closes (`wind_down`).
_WIND_DOWN_PASSES = 8
#: ... ending early after this many passes in a row that settled nothing.
_WIND_DOWN_IDLE = 3


async def wind_down(scheduler: CreditScheduler) -> None:
    """Stop admitting (the caller has paused submission for good), then let work that is ready
    finish before the cancellation.

    A sample whose reply has arrived (its task is runnable) finishes in its next step, and
    its group a step later; cancelling it instead throws that work away and costs trio's
    cancellation path (~30 us per task, more than running it). So, submission paused, the
    loop runs a few scheduling passes (no wait: a pass is one turn of the run
    queue), until nothing is pending or three passes in a row settled nothing. Three, not
    two: trio runs each batch of runnable tasks in either order, so the pass after a
    sample's first step (which settles nothing) may look before the samples finish, and with
    two idle passes a wave one step from done would be cancelled whenever trio ran this task
    first. Shielded: a cancelled caller gets the same passes, in which its cancelled samples end as
    they would have in the cancellation.
    """
    scheduler.winding_down = True  # groups not started yet do not start
    ledger = scheduler.ledger
    scheduler.settle()
    before, idle = (ledger.in_flight, ledger.pending_groups), 0
    for _ in range(_WIND_DOWN_PASSES):
        await trio.lowlevel.cancel_shielded_checkpoint()
        # The worker may be blocked on backpressure, not draining: the reports made in this
        # pass reach the ledger here (their groups stay queued for the worker).
        scheduler.settle()
        now = (ledger.in_flight, ledger.pending_groups)
        idle = idle + 1 if now == before else 0
        if idle == _WIND_DOWN_IDLE or not ledger.pending_groups:
            return
        before = now
