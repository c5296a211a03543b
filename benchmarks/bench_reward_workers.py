"""The per-call cost of running a reward in a worker pool: process workers against threads.

A trivial reward (``fn(record, completion) -> float`` on a small record, the built-in tasks'
shape) is called through :class:`trio_rl.workers.WorkerPool` in each mode, and directly on the
loop as the floor:

- serial: one call at a time (the round trip: pickling, two pipe writes, two wake-ups);
- concurrent: ``--callers`` tasks calling at once (what a step's samples finishing together
  do), as calls per second of the pool.

Repetitions are interleaved; each figure is the median and the spread (min-max) over them.
The pool's workers are started before the clock starts (start-up is a one-time cost).

Then the pace (:mod:`_bench_pace`): ``trio-rl run`` of a 32-record project twice at the same
time, a control and a run whose reward hangs on 2 of the 32 records (killed at
``--pace-timeout`` seconds), ``--pace-steps`` steps each, ``--repeat`` times: the hanging
run's steps per minute over the control's, in the wall span both were shipping.

    python benchmarks/bench_reward_workers.py [--calls 2000] [--callers 16] [--repeat 3]
        [--pace-steps 160] [--pace-timeout 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

# the script's directory is on sys.path (python puts it first): the reward's module is there
from _bench_pace import HANGING, pace_ratio, side_by_side
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


def pace(steps: int, timeout: float, repeat: int) -> None:
    print(
        f"\npace: trio-rl run, {steps} steps, a control and a reward hanging on records "
        f"{' and '.join(HANGING)} of 32 (timeout {timeout:g} s) at the same time, x {repeat}"
    )
    print("pair  common span   control steps/min   hanging steps/min   ratio   failed samples")
    ratios = []
    for i in range(repeat):
        control, hang = side_by_side(steps, timeout)
        if control.returncode or hang.returncode:
            print(f"{i + 1:>4}  a run failed: exit {control.returncode} / {hang.returncode}")
            continue
        span, ratio, c, h = pace_ratio(control, hang)
        ratios.append(ratio)
        print(
            f"{i + 1:>4}  {span:9.1f} s   {c * 60 / span:17.0f}   {h * 60 / span:17.0f}   "
            f"{ratio:5.2f}   {hang.reward_failures} (control {control.reward_failures})"
        )
    if ratios:
        med = statistics.median(ratios)
        print(
            f"goal 9: reward workers: a reward hanging on 2 of 32 records ships {med:.2f}x the "
            f"control's steps per minute, side by side (median of {len(ratios)}, "
            f"{min(ratios):.2f}-{max(ratios):.2f}; goal >= 0.8: "
            f"{'reached' if med >= 0.8 else 'not reached'})"
        )


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
    parser.add_argument("--pace-steps", type=int, default=160, help="0: no pace part")
    parser.add_argument("--pace-timeout", type=float, default=1.0)
    args = parser.parse_args()
    if args.calls:
        trio.run(main, args.calls, args.callers, args.repeat)
    if args.pace_steps:
        pace(args.pace_steps, args.pace_timeout, args.repeat)
