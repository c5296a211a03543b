"""The per-call cost of running a reward in a worker pool: process workers against threads.

A trivial reward (``fn(record, completion) -> float`` on a small record, the built-in tasks'
shape) is called through :class:`trio_rl.workers.WorkerPool` in each mode, and directly on the
loop as the floor:

- serial: one call at a time (the round trip: pickling, two pipe writes, two wake-ups);
- concurrent: ``--callers`` tasks calling at once (what a step's samples finishing together
  do), as calls per second of the pool.

Repetitions are interleaved; each figure is the median and the spread (min-max) over them.
The pool's workers are started before the clock starts (start-up is a one-time cost).

    python benchmarks/bench_reward_workers.py [--calls 2000] [--callers 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

# the script's directory is on sys.path (python puts it first): the reward's module is there
from _bench_rewards import score
from trio_rl.workers import WorkerPool, open_worker_pool

RECORD = {"id": "r17", "prompt": "abcd=", "answer": "dcba"}


async def _serial(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - start) / calls


async def _concurrent(call: Callable[[], Awaitable[Any]], calls: int, callers: int) -> float:
    per = max(1, calls // callers)

    async def caller() -> None:
        for _ in range(per):
            await call()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(caller)
    return per * callers / (time.perf_counter() - start)


async def _warm(pool: WorkerPool, callers: int) -> None:
    # start the workers the concurrent part will use (the pool grows while calls wait)
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(lambda: pool.run(RECORD, "dcba"))


def _spread(values: list[float], scale: float, unit: str) -> str:
    med = statistics.median(values) * scale
    return f"{med:8.1f} {unit} ({min(values) * scale:.1f}-{max(values) * scale:.1f})"


async def main(calls: int, callers: int, repeat: int) -> None:
    serial: dict[str, list[float]] = {"loop": [], "thread": [], "process": []}
    rate: dict[str, list[float]] = {"thread": [], "process": []}

    async def on_loop() -> float:
        await trio.lowlevel.checkpoint()
        return score(RECORD, "dcba")

    for _ in range(repeat):
        serial["loop"].append(await _serial(on_loop, calls))
        for mode in ("thread", "process"):
            async with open_worker_pool(score, mode=mode, size=callers, name=mode) as pool:
                await _warm(pool, callers)

                async def through_pool(pool: WorkerPool = pool) -> Any:
                    return await pool.run(RECORD, "dcba")

                serial[mode].append(await _serial(through_pool, calls))
                rate[mode].append(await _concurrent(through_pool, calls, callers))
    print(f"{calls} calls x {repeat}, {callers} concurrent callers (median, min-max)")
    print("mode       serial, per call          concurrent, calls per second")
    for mode in ("loop", "thread", "process"):
        line = f"{mode:<9}{_spread(serial[mode], 1e6, 'us')}"
        if mode in rate:
            line += f"   {_spread(rate[mode], 1, '/s')}"
        print(line)
    extra = (statistics.median(serial["process"]) - statistics.median(serial["thread"])) * 1e6
    ratio = statistics.median(rate["process"]) / statistics.median(rate["thread"])
    print(
        f"goal 9: reward workers: a process call costs {extra:+.0f} us over a thread call "
        f"(serial); concurrent, processes do {ratio:.2f}x the calls per second of threads"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.calls, args.callers, args.repeat)
