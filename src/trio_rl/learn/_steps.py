"""What the learning run says about its steps: each shipped step's record (the standard one
of `trio_rl.publish.step_record`, as ``trio-rl simulate`` writes it) and plain console line,
the event-loop lag it reports, and the watch that ends a run whose groups all have equal rewards
(why it ended is `trio_rl.learn._verdict`'s)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Protocol

import trio

from ..config import LearnRunConfig
from ..orchestrator import Orchestrator
from ..publish import Shipment, step_record

__all__ = [
    "Display",
    "plain_line",
    "probe_loop_lag",
    "step_line_record",
    "watch_convergence",
]


class Display(Protocol):
    """Shows each step's record (e.g. :class:`trio_rl.tools.console.ConsoleDisplay`)."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _p95(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


async def probe_loop_lag(lags: list[float], interval: float = 0.005) -> None:
    """Append the event loop's lag to ``lags`` every ``interval`` seconds until cancelled."""
    while True:
        start = trio.current_time()
        await trio.sleep(interval)
        lags.append(trio.current_time() - start - interval)


def step_line_record(
    shipment: Shipment, lags: list[float], started: float, last_wall: float, version: int
) -> dict[str, Any]:
    """The standard record of a shipped step; queue depth, open groups and the engine's
    occupancy are added by the caller once it has read them."""
    wall = time.perf_counter() - started
    return step_record(
        shipment.record,
        wall_s=wall,
        interval_s=wall - last_wall,
        loop_lag_p95_ms=round(_p95(lags) * 1e3, 3),
        policy_version=version,
    )


def _percent(value: float | None) -> str:
    return "  -" if value is None else f"{value * 100:3.0f}%"


def plain_line(rec: dict[str, Any], reward_failures: int) -> str:
    """A step's plain console line (without a display)."""
    reward = rec["reward_mean"]
    return (
        f"step {rec['step']:>4}  reward {'(none new)' if reward is None else f'{reward:.3f}'}"
        f"  policy v{rec['policy_version']:<4} off-policy max "
        f"{rec['off_policy_max']:.0f}  stale {rec['stale']:>4}  "
        f"{rec['samples_per_s']:>6.1f} samples/s  "
        f"lag p95 {rec['loop_lag_p95_ms']:.1f} ms  "
        f"{_percent(rec['slot_occupancy'])} rows busy  {rec['wall_s']:.1f} s"
        + (f"  reward failed {reward_failures} samples" if reward_failures else "")
    )


async def watch_convergence(
    orch: Orchestrator, config: LearnRunConfig, scope: trio.CancelScope
) -> None:
    """Cancel ``scope`` when ``run.converged_after`` batches' worth of samples were pruned
    (every group had equal rewards: the policy is deterministic on every prompt)."""
    start = orch.sink.counters.pruned
    step = config.rollout.batch_groups * config.rollout.group_size
    limit = config.run.converged_after * step
    while orch.sink.counters.pruned - start < limit:  # noqa: ASYNC110 - the sink has no event
        await trio.sleep(0.05)
    scope.cancel()
