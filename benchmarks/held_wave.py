"""The trio-rl driver with every sample of a wave alive at once: a check on part B's figures.

Part B's zero-latency samples finish in the pass after they start, so a driver that starts
its admitted groups one schedule point apart never has the whole budget's tasks
alive: the collector then sees far fewer objects than N in flight would hold. Here each
sample waits at a gate that opens once N samples are waiting, as engine latency would hold
them, so all N tasks are alive at once whatever the start pacing. trio-rl side only: run it
against two source trees to compare revisions, e.g.::

    PYTHONPATH=../main/src python benchmarks/held_wave.py 100000   # before
    python benchmarks/held_wave.py 100000                           # after

Prints CPU per sample generated (GC on) and the gen-2 collections of the run.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import trio

from trio_rl.rollout import GroupFactory, GroupRunner, InMemorySource, open_async_rollout
from trio_rl.samples import Prompt, Sample, SampleStatus

G = 8


class _Gate:
    """Holds each sample until ``n`` are waiting, then lets the whole wave go."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.waiting = 0
        self.generated = 0
        self.event = trio.Event()

    async def generate(self, sample: Sample) -> None:
        self.waiting += 1
        if self.waiting >= self.n:
            self.waiting = 0
            event, self.event = self.event, trio.Event()
            event.set()
        else:
            await self.event.wait()
        sample.status = SampleStatus.COMPLETED
        self.generated += 1


async def _run(gate: _Gate, target: int) -> None:
    async with open_async_rollout(
        InMemorySource([Prompt(key="bench", tokens=(1, 2, 3))], epochs=None),
        GroupFactory(G),
        GroupRunner(gate.generate),
        batch_size=1,
        buffer_capacity=1,
        max_groups_in_flight=gate.n // G,
    ) as driver:
        taken = 0
        while taken < target:
            taken += sum(g.size for g in await driver.next_batch())


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    gate = _Gate(n)
    full = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full[0] += 1

    gc.collect()
    gc.callbacks.append(count)
    start = time.process_time()
    trio.run(_run, gate, 3 * n)
    cpu = time.process_time() - start
    gc.callbacks.remove(count)
    print(
        f"N = {n:,} held: {cpu / gate.generated * 1e6:.1f} us per sample generated, "
        f"{full[0]} gen-2 collections, load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
