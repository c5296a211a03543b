"""The asyncio reference scheduler (miles PR #1673 design), re-implemented as a comparator.

This follows the reference's *design* as described in /work/shared/reference/miles.md sections
3-4 (it is not its code): one asyncio task per sample with a done-callback that returns a credit,
a clearable ``asyncio.Event`` cleared inside ``has_capacity`` when it answers False, and a
``wait_for_progress`` that waits FIRST_COMPLETED over every pending group task plus a helper
task waiting on the event. The fully-async worker loop drives it the way the reference's
``FullyAsyncRolloutFn`` does: submit while ``has_capacity``, wait, reap.

asyncio is allowed here only because this is a benchmark comparator; ``src/`` is trio only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("asyncio_reference")


class GroupLevelSubmission:
    """Group granularity: admit while fewer than ``group_budget`` groups are pending."""

    sample_done_callback = None

    def has_capacity(self, *, pending_groups: int, group_budget: int) -> bool:
        return pending_groups < group_budget

    def on_submit(self, groups: list[Any]) -> None:
        pass

    async def wait_for_progress(
        self, pendings: set[asyncio.Task[Any]]
    ) -> tuple[set[Any], set[Any]]:
        return await asyncio.wait(pendings, return_when=asyncio.FIRST_COMPLETED)


class SampleBackfillSubmission:
    """Sample backfill: a credit counter of samples in flight against ``B x G``."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.samples_in_flight = 0
        self._wakeup = asyncio.Event()

    def sample_done_callback(self, _task: object = None) -> None:
        self.samples_in_flight -= 1
        self._wakeup.set()

    def has_capacity(self, *, pending_groups: int, group_budget: int) -> bool:
        if pending_groups == 0 and self.samples_in_flight != 0:
            logger.warning(
                "samples_in_flight=%d with no pending groups; resetting to 0",
                self.samples_in_flight,
            )
            self.samples_in_flight = 0
        if self.samples_in_flight + self.group_size <= group_budget * self.group_size:
            return True
        # A False answer arms the wakeup: only completions after this decision wake the wait.
        self._wakeup.clear()
        return False

    def on_submit(self, groups: list[Any]) -> None:
        self.samples_in_flight += sum(len(g) for g in groups)

    async def wait_for_progress(
        self, pendings: set[asyncio.Task[Any]]
    ) -> tuple[set[Any], set[Any]]:
        helper = asyncio.ensure_future(self._wakeup.wait())
        try:
            done, pending = await asyncio.wait(
                pendings | {helper}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            helper.cancel()
        done.discard(helper)
        pending.discard(helper)
        return done, pending


async def generate_and_rm_group(
    group: list[Any],
    generate: Callable[[Any], Awaitable[Any]],
    sample_done_callback: Callable[[Any], None] | None,
) -> list[Any]:
    """One task per sample; the credit callback is registered on each before gather's own."""
    tasks = [asyncio.create_task(generate(sample)) for sample in group]
    if sample_done_callback is not None:
        for task in tasks:
            task.add_done_callback(sample_done_callback)
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        # Cancel and settle siblings before the group ends (the #1673 fix).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def fully_async_worker(
    scheduler: GroupLevelSubmission | SampleBackfillSubmission,
    make_group: Callable[[], list[Any]],
    generate: Callable[[Any], Awaitable[Any]],
    *,
    group_budget: int,
    target_samples: int,
    on_target: Callable[[int], None] | None = None,
) -> int:
    """Keep ``group_budget`` groups' worth of work in flight until ``target_samples`` finished
    samples were produced; returns the number of finished samples. Finished groups go into an
    output buffer that a consumer drains at once (the trainer never lags here). ``on_target``
    is called with that number once the target is reached, before the tasks still in flight
    are cancelled."""
    pendings: set[asyncio.Task[Any]] = set()
    output: deque[list[Any]] = deque()
    finished = 0
    try:
        while finished < target_samples:
            while scheduler.has_capacity(pending_groups=len(pendings), group_budget=group_budget):
                group = make_group()
                scheduler.on_submit([group])
                pendings.add(
                    asyncio.create_task(
                        generate_and_rm_group(group, generate, scheduler.sample_done_callback)
                    )
                )
            done, pendings = await scheduler.wait_for_progress(pendings)
            for task in done:
                output.append(task.result())
            while output:
                finished += len(output.popleft())
        if on_target is not None:
            on_target(finished)
    finally:
        for task in pendings:
            task.cancel()
        await asyncio.gather(*pendings, return_exceptions=True)
    return finished
