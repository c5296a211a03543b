"""The policy-wait clock: seconds the orchestrator waited for the policy, and its step time."""

from __future__ import annotations

import attrs
import trio

from .._validation import check_at_least

__all__ = ["PolicyWaits", "policy_wait_dominates"]


def policy_wait_dominates(wait: float, step_time: float) -> bool:
    """The reference's (#3811) imbalance rule: the orchestrator waited for the policy at least
    as long as it worked in the step (``wait >= step_time - wait``, its active time), so the
    trainer is the bottleneck. Never for a step of no time."""
    return step_time > 0 and wait >= max(step_time - wait, 0.0)


@attrs.define(slots=True, eq=False)
class PolicyWaits:
    """The policy-wait seconds accumulated since the last shipped record, and when that record
    was taken (``trio.current_time()``; at first, when the publisher opened: the first step
    measures startup to its record). Lives on the event loop."""

    pending: float = 0.0
    last: float = attrs.field(factory=trio.current_time)

    def add(self, seconds: float) -> None:
        check_at_least("add_policy_wait seconds (a policy wait)", seconds, 0)
        self.pending += seconds

    def snapshot(self) -> tuple[float, float]:
        """Read and reset, in one step with no await: ``(wait, step_time)``, the wait since the
        last snapshot and the time since it. The record and its warning use this one value."""
        now = trio.current_time()
        wait, step_time = self.pending, now - self.last
        self.pending, self.last = 0.0, now
        return wait, step_time

    def give_back(self, wait: float) -> None:
        """A snapshot whose record was never published: its wait goes to the next one."""
        self.pending += wait
