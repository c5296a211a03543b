"""Scheduler benchmarks: slot occupancy by policy, and CPU cost per sample against asyncio.

Part A (virtual time, ``trio.testing.MockClock``): for each straggler distribution of SPEC
section 6, a :class:`~trio_rl.engines.SimulatedEngine` with 256 decode slots is kept busy by a
fully-async style loop (G = 8, B = 32 groups, unlimited prompts) under group granularity and under
sample backfill; slot occupancy and finished groups per simulated hour are printed side by side.

Part B (real CPU time): zero-latency samples (each yields once), G = 8, with 1k / 10k / 100k
samples in flight (B = N / 8 groups), scheduled by trio-rl's sample backfill
(``CreditScheduler`` + ``run_reporting``) and by the asyncio reference design
(``_asyncio_reference.py``) in the same process; ``time.process_time`` per finished sample, with
the cyclic GC on and off. Each run is timed in full (including the shutdown that cancels the N
samples still in flight once the target is reached) and up to the target (steady state, no
shutdown).

Run: ``python benchmarks/bench_scheduler.py`` (``--help`` for bigger or partial runs).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _asyncio_reference as ref
from trio_rl.engines import DISTRIBUTIONS, SamplingParams, SimulatedEngine
from trio_rl.rollout import (
    CreditScheduler,
    GroupFactory,
    GroupGranularity,
    GroupRunner,
    GroupStatus,
    InMemorySource,
    SampleBackfill,
    SubmissionPolicy,
    engine_generate,
    open_async_rollout,
    run_reporting,
)
from trio_rl.samples import Prompt, Sample, SampleStatus

G = 8

# --------------------------------------------------------------------------- part A

#: Distinct prompts for part A (the source wraps around; a repeated prompt draws afresh).
_PROMPTS = [Prompt(key=f"p{i}", tokens=(i, 17, 42)) for i in range(20_000)]


def _runner(engine: SimulatedEngine, distribution: str) -> GroupRunner:
    # Wall-time distributions take their drawn time whatever max_tokens is; a small cap only
    # keeps their synthetic token lists (30 tok/s x ~25 min) from dominating the run's cost.
    wall_time = distribution in ("swe", "heavy-tail")
    params = SamplingParams(max_tokens=1024 if wall_time else 32768)
    return GroupRunner(engine_generate(engine, params))


async def _occupancy_driver(
    distribution: str, policy: SubmissionPolicy, *, slots: int, budget: int, hours: float, seed: int
) -> dict[str, float]:
    """The real fully-async driver (``open_async_rollout``) with a trainer that never lags."""
    engine = SimulatedEngine(distribution, slots=slots, seed=seed)
    source = InMemorySource(_PROMPTS, epochs=None)
    async with open_async_rollout(
        source,
        GroupFactory(G, seed=seed),
        _runner(engine, distribution),
        batch_size=budget,
        policy=policy,
        max_groups_in_flight=budget,
        aborted="drop",
    ) as driver:
        engine.reset_statistics()
        with trio.move_on_after(hours * 3600.0):
            while True:
                await driver.next_batch()
        stats = driver.statistics()
    return {
        "occupancy": engine.statistics().occupancy,
        "groups_per_hour": stats.completed / hours,
    }


async def _occupancy_bare(
    distribution: str, policy: SubmissionPolicy, *, slots: int, budget: int, hours: float, seed: int
) -> dict[str, float]:
    """A bare admission loop on ``CreditScheduler`` (what the driver does, minus buffering)."""
    engine = SimulatedEngine(distribution, slots=slots, seed=seed)
    runner = _runner(engine, distribution)
    factory = GroupFactory(G, seed=seed)
    scheduler = CreditScheduler(policy, G)
    prompt_ids = itertools.count()
    groups = 0
    engine.reset_statistics()
    with trio.move_on_after(hours * 3600.0):
        async with trio.open_nursery() as nursery:
            while True:
                while scheduler.admits(budget):
                    i = next(prompt_ids)
                    group = factory.make(Prompt(key=f"p{i}", tokens=(i, 17, 42)))
                    scheduler.submitted(group.group_id, credits=G)
                    nursery.start_soon(run_reporting, runner, group, scheduler)
                for outcome in await scheduler.wait_for_progress():
                    groups += outcome.status is GroupStatus.COMPLETED
    scheduler.close()
    stats = engine.statistics()
    return {
        "occupancy": stats.occupancy,
        "groups_per_hour": groups / hours,
    }


#: Simulated hours per run: long enough for many group lifetimes (swe episodes last ~25 min).
HORIZON_HOURS = {"long-cot": 2.0, "correlated": 1.0, "swe": 24.0, "heavy-tail": 2.0}


def part_a(scale: float, slots: int, budget: int, seed: int, loop: str) -> list[dict[str, Any]]:
    print(
        f"\n== A. slot occupancy and groups per simulated hour "
        f"({slots} slots, G = {G}, B = {budget} groups, seed {seed}, {loop} loop)"
    )
    run_fn = _occupancy_bare if loop == "bare" else _occupancy_driver
    header = (
        f"{'distribution':<12} | {'group: occ':>10} {'groups/h':>9} | "
        f"{'backfill: occ':>13} {'groups/h':>9} | {'ratio':>6} | {'sim h':>5} | {'wall s':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name in DISTRIBUTIONS:
        hours = HORIZON_HOURS.get(name, 2.0) * scale
        t0 = time.perf_counter()
        results = {}
        for label, policy in (("group", GroupGranularity()), ("backfill", SampleBackfill())):
            run = functools.partial(
                run_fn, name, policy, slots=slots, budget=budget, hours=hours, seed=seed
            )
            results[label] = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
        wall = time.perf_counter() - t0
        g, b = results["group"], results["backfill"]
        ratio = (
            b["groups_per_hour"] / g["groups_per_hour"] if g["groups_per_hour"] else float("nan")
        )
        print(
            f"{name:<12} | {g['occupancy']:>10.3f} {g['groups_per_hour']:>9.1f} | "
            f"{b['occupancy']:>13.3f} {b['groups_per_hour']:>9.1f} | {ratio:>5.2f}x | {hours:>5g} | {wall:>6.1f}"
        )
        rows.append(
            {"distribution": name, "hours": hours, "group": g, "backfill": b, "ratio": ratio}
        )
    return rows


# --------------------------------------------------------------------------- part B

_PROMPT = Prompt(key="bench", tokens=(1, 2, 3))

#: ``(time.process_time(), samples finished by then)`` when the current part-B run reached its
#: target, before shutdown.
_reached: list[tuple[float, int]] = []


def _mark_target(finished: int) -> None:
    _reached.append((time.process_time(), finished))


async def _zero_latency(sample: Sample) -> None:
    await trio.lowlevel.checkpoint()
    sample.status = SampleStatus.COMPLETED


async def _trio_driver(policy: SubmissionPolicy, concurrent: int, target: int) -> int:
    """The real fully-async driver; the trainer takes batches of B groups as they come."""
    budget = concurrent // G
    async with open_async_rollout(
        InMemorySource([_PROMPT], epochs=None),
        GroupFactory(G),
        GroupRunner(_zero_latency),
        batch_size=budget,
        policy=policy,
        max_groups_in_flight=budget,
    ) as driver:
        finished = 0
        while finished < target:
            finished += sum(g.size for g in await driver.next_batch())
        # Every group the worker finished, taken or still buffered (the worker runs ahead of
        # the consumer by up to the buffer's capacity).
        _mark_target(driver.statistics().completed * G)
    return finished


async def _trio_bare(policy: SubmissionPolicy, concurrent: int, target: int) -> int:
    """A bare admission loop on ``CreditScheduler`` + ``run_reporting``."""
    budget = concurrent // G
    factory = GroupFactory(G)
    runner = GroupRunner(_zero_latency)
    scheduler = CreditScheduler(policy, G)
    finished = 0
    async with trio.open_nursery() as nursery:
        while finished < target:
            while scheduler.admits(budget):
                group = factory.make(_PROMPT)
                scheduler.submitted(group.group_id, credits=G)
                nursery.start_soon(run_reporting, runner, group, scheduler)
            for outcome in await scheduler.wait_for_progress():
                if outcome.status is GroupStatus.COMPLETED:
                    finished += outcome.group.size
        _mark_target(finished)
        nursery.cancel_scope.cancel()
    scheduler.close()
    return finished


async def _asyncio_zero_latency(granularity: str, concurrent: int, target: int) -> int:
    budget = concurrent // G
    factory = GroupFactory(G)

    async def generate(sample: Sample) -> Sample:
        await asyncio.sleep(0)
        sample.status = SampleStatus.COMPLETED
        return sample

    scheduler: ref.GroupLevelSubmission | ref.SampleBackfillSubmission
    if granularity == "sample":
        scheduler = ref.SampleBackfillSubmission(G)
    else:
        scheduler = ref.GroupLevelSubmission()
    return await ref.fully_async_worker(
        scheduler,
        lambda: factory.make(_PROMPT).samples,
        generate,
        group_budget=budget,
        target_samples=target,
        on_target=_mark_target,
    )


async def _plain_trio(policy: SubmissionPolicy, concurrent: int, target: int) -> int:
    """A floor for comparison: the same shape in plain trio with no trio-rl code (a nursery per
    group, a task per sample, credits on a memory channel, sample-backfill admission)."""
    budget = concurrent // G
    send, receive = trio.open_memory_channel[int](math.inf)
    factory = GroupFactory(G)

    async def sample_task(sample: Sample) -> None:
        try:
            await _zero_latency(sample)
        finally:
            send.send_nowait(1)

    async def group_task(samples: list[Sample]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for sample in samples:
                    nursery.start_soon(sample_task, sample)
        finally:
            send.send_nowait(0)

    in_flight = finished = 0
    async with trio.open_nursery() as nursery:
        while finished < target:
            while in_flight + G <= budget * G:
                in_flight += G
                nursery.start_soon(group_task, factory.make(_PROMPT).samples)
            event = await receive.receive()
            while True:
                if event:
                    in_flight -= 1
                else:
                    finished += G
                try:
                    event = receive.receive_nowait()
                except trio.WouldBlock:
                    break
        _mark_target(finished)
        nursery.cancel_scope.cancel()
    return finished


def _run_asyncio(granularity: str, concurrent: int, target: int) -> int:
    return asyncio.run(_asyncio_zero_latency(granularity, concurrent, target))


def _measure(fn: Callable[[], int], gc_on: bool) -> tuple[float, float]:
    """CPU us per sample: the whole run per sample delivered, and the run up to the target
    (no shutdown) per sample finished by then."""
    gc.collect()
    _reached.clear()
    if gc_on:
        gc.enable()
    else:
        gc.disable()
    try:
        t0 = time.process_time()
        finished = fn()
        cpu = time.process_time() - t0
    finally:
        gc.enable()
    ((reached, finished_then),) = _reached
    return cpu / finished * 1e6, (reached - t0) / finished_then * 1e6


def part_b(
    sizes: list[int], factor: float, minimum: int, granularities: list[str], loop: str
) -> list[dict[str, Any]]:
    trio_fn = {"driver": _trio_driver, "bare": _trio_bare, "plain": _plain_trio}[loop]
    print(
        f"\n== B. scheduler CPU per finished sample (us, time.process_time), zero-latency samples, "
        f"G = {G}; each run finishes max({factor:g} x N, {minimum}) samples; trio-rl: {loop} loop"
    )
    print(
        "   (whole run incl. the shutdown that cancels the N samples in flight; "
        "'steady': up to the target, no shutdown)"
    )
    header = (
        f"{'policy':<8} {'N in flight':>11} | {'trio-rl':>8} {'asyncio':>8} | "
        f"{'steady':>7} {'steady':>7} | {'trio-rl nogc':>12} {'asyncio nogc':>12} | "
        f"{'steady':>7} {'steady':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for granularity in granularities:
        policy: SubmissionPolicy = (
            SampleBackfill() if granularity == "sample" else GroupGranularity()
        )
        for n in sizes:
            target = max(int(factor * n), minimum)
            row: dict[str, Any] = {"policy": granularity, "n": n}
            for gc_on in (True, False):
                suffix = "" if gc_on else "_nogc"
                row["trio" + suffix], row["trio_steady" + suffix] = _measure(
                    functools.partial(trio.run, trio_fn, policy, n, target), gc_on
                )
                row["asyncio" + suffix], row["asyncio_steady" + suffix] = _measure(
                    functools.partial(_run_asyncio, granularity, n, target), gc_on
                )
            print(
                f"{granularity:<8} {n:>11,} | {row['trio']:>8.1f} {row['asyncio']:>8.1f} | "
                f"{row['trio_steady']:>7.1f} {row['asyncio_steady']:>7.1f} | "
                f"{row['trio_nogc']:>12.1f} {row['asyncio_nogc']:>12.1f} | "
                f"{row['trio_steady_nogc']:>7.1f} {row['asyncio_steady_nogc']:>7.1f}"
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the simulated hours of part A"
    )
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32, help="B, in groups (part A)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="1000,10000,100000", help="samples in flight (part B)")
    parser.add_argument("--factor", type=float, default=1.0, help="finished samples per run / N")
    parser.add_argument(
        "--minimum", type=int, default=20000, help="minimum finished samples per run"
    )
    parser.add_argument(
        "--granularity", default="sample", help="comma list of sample,group (part B)"
    )
    parser.add_argument(
        "--loop",
        choices=["driver", "bare", "plain"],
        default="driver",
        help="trio side of part B: the real open_async_rollout driver, a bare CreditScheduler "
        "loop, or plain trio without trio-rl (a floor); part A: driver or bare",
    )
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}")
    if args.part in ("a", "all"):
        part_a(args.scale, args.slots, args.budget, args.seed, args.loop)
    if args.part in ("b", "all"):
        part_b(
            [int(s) for s in args.sizes.split(",")],
            args.factor,
            args.minimum,
            args.granularity.split(","),
            args.loop,
        )


if __name__ == "__main__":
    main()
