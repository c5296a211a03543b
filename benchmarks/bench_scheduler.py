"""Scheduler benchmarks: slot occupancy by policy, and CPU cost per sample against asyncio.

Part A (virtual time, ``trio.testing.MockClock``): for each straggler distribution of SPEC
section 6, a :class:`~trio_rl.engines.SimulatedEngine` with 256 decode slots is kept busy by a
fully-async style loop (G = 8, B = 32 groups, unlimited prompts) under group granularity and under
sample backfill; slot occupancy and finished groups per simulated hour are printed side by side.

Part B (real CPU time): zero-latency samples (each yields once), G = 8, with 1k / 10k / 100k
samples in flight (B = N / 8 groups), scheduled by trio-rl's sample backfill
(``CreditScheduler`` + ``run_reporting``) and by the asyncio reference design
(``_asyncio_reference.py``) in the same process; ``time.process_time`` per finished sample, with
the cyclic GC on and off. Each run is timed in full (fill, run and the shutdown once the target
is reached, per sample generated to completion) and over its steady window (from the N-th sample
generated, the first wave's end, to the target-th: no fill, no shutdown), with the collector's
time per generation.

Part C (real time): 256 slots, lognormal latencies, both sides in turn; 3 runs per latency scale
with scales 1.25x apart, each side's highest sample rate at median occupancy >= 0.95, and the
occupancy, CPU per sample and loop lag p95 of both sides at the reference's highest such rate.
Replies come as a socket's would: a timerfd (``_timerfd.py``) armed at the next due time ends
each loop's I/O wait when a reply is due, where a loop timer's timeout is rounded up to a whole
millisecond by epoll (``--rt-engine`` for the other engines).

Part B then prints the machinery-only ratio: the asyncio side builds its groups from
trio-rl's ``GroupFactory`` too, so only tasks, nurseries and credits are compared.

Part C2 (real time): both sides side by side at several offered loads (``--rt-loads``,
median latencies in ms; one saturates a core on a quiet 2-core machine): samples/s, CPU per
sample, occupancy and the share of a core each loop used.

Lines starting ``goal 1:`` and ``goal 2:`` give the verdicts from the run's medians.

Run: ``python benchmarks/bench_scheduler.py`` (``--help`` for bigger or partial runs).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import heapq
import itertools
import math
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _asyncio_reference as ref
from _timerfd import TimerFd
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

#: The peak of traced bytes over the current memory run's steady window: a wave of N samples
#: in flight with their tasks, and whatever the loop holds for them. The bytes alive at one
#: instant depend on where in a wave it falls (between waves no task is alive on either side).
_traced: list[int] = []


#: Samples the trio consumer took in the current run (finished but still buffered ones not).
_delivered: list[int] = []


#: Samples generated to completion in the current part-B run, on either side (taken by the
#: consumer or not): the whole run's divisor, and the clock of the steady window.
_generated = [0]

#: The steady window, in samples generated: from the N-th (the end of the first wave, the
#: initial fill of N samples built before any finishes) to the target-th. Zero-latency samples
#: are generated in bursts, a wave at a time, and where the consumer's count falls against a
#: burst depends on the order trio runs one batch of tasks in (it reverses half the batches),
#: so a window marked by the consumer's count held one wave's generation or two (10k, 2N
#: finished: 6.8-88 us); marked by samples generated it holds waves 2 to the last, whole, and
#: the consumption of the waves before them.
_window = (0, 0)
#: ``time.process_time()`` at the window's two ends.
_marks: list[float] = []


def _window_mark() -> None:
    """Called by a generate function when ``_generated[0]`` is an end of ``_window``."""
    _marks.append(time.process_time())
    if tracemalloc.is_tracing():
        if len(_marks) == 1:
            tracemalloc.reset_peak()
        else:
            _traced.append(tracemalloc.get_traced_memory()[1])


async def _zero_latency(sample: Sample) -> None:
    await trio.lowlevel.checkpoint()
    sample.status = SampleStatus.COMPLETED
    _generated[0] += 1
    if _generated[0] in _window:
        _window_mark()


#: The trio consumer's batch and the driver's buffer, as fractions of B, at least one group
#: (set by :func:`main`; default 0: one group each). The reference's consumer drains its output
#: at once (every finished group is counted and dropped after each wake-up) and its worker
#: never runs ahead; the like-for-like trio consumer takes each group as it comes, and a
#: one-group buffer keeps the worker from running ahead. A consumer that holds a batch of B
#: groups while the buffer holds another (``--batch 1 --buffer 1``) keeps up to 3N samples
#: alive against the reference's N, and its memory per in-flight sample is 2-3x for that alone.
_batch_fraction = 0.0
_buffer_fraction = 0.0


async def _trio_driver(policy: SubmissionPolicy, concurrent: int, target: int) -> int:
    """The real fully-async driver; the trainer takes batches as they come."""
    budget = concurrent // G
    batch = max(1, round(budget * _batch_fraction))
    async with open_async_rollout(
        InMemorySource([_PROMPT], epochs=None),
        GroupFactory(G),
        GroupRunner(_zero_latency),
        batch_size=batch,
        buffer_capacity=max(1, round(budget * _buffer_fraction)),
        policy=policy,
        max_groups_in_flight=budget,
    ) as driver:
        finished = 0
        while finished < target:
            finished += sum(g.size for g in await driver.next_batch())
    _delivered.append(finished)
    # The whole run is charged per sample the worker finished (taken or left in the buffer),
    # as the asyncio worker's figure is: the work the scheduler did. What the consumer took is
    # kept in _delivered for the report.
    return driver.statistics().completed * G


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
        nursery.cancel_scope.cancel()
    scheduler.close()
    return finished


#: The asyncio side's scheduler module (miles' own file, or the labelled fallback) and what
#: the asyncio side builds its groups from; set by :func:`main`.
_reference: Any = ref
_reference_label = "re-implementation"
_asyncio_samples = "miles"


async def _asyncio_zero_latency(granularity: str, concurrent: int, target: int) -> int:
    budget = concurrent // G
    make_group: Callable[[], list[Any]]
    if _asyncio_samples == "miles":
        counter = itertools.count().__next__
        prompt = ref.MilesSample(prompt="p", tokens=list(_PROMPT.tokens), label="x")

        def make_group() -> list[Any]:
            return ref.miles_group(prompt, G, counter)

        completed: Any = ref.MilesSample.Status.COMPLETED
    else:
        factory = GroupFactory(G)

        def make_group() -> list[Any]:
            return list(factory.make(_PROMPT).samples)

        completed = SampleStatus.COMPLETED

    async def generate(sample: Any) -> Any:
        await asyncio.sleep(0)
        sample.status = completed
        _generated[0] += 1
        if _generated[0] in _window:
            _window_mark()
        return sample

    scheduler: Any
    if granularity == "sample":
        scheduler = _reference.SampleBackfillSubmission(G)
    else:
        scheduler = _reference.GroupLevelSubmission()
    return await ref.fully_async_worker(
        scheduler,
        make_group,
        generate,
        group_budget=budget,
        target_samples=target,
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
        nursery.cancel_scope.cancel()
    return finished


def _run_asyncio(granularity: str, concurrent: int, target: int) -> int:
    return asyncio.run(_asyncio_zero_latency(granularity, concurrent, target))


class _Collector:
    """The cyclic collector's share of a run (the profile goal 1's growth needs): wall seconds
    spent in collections of each generation (``gc.callbacks``, a few thousand calls per run)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self.samples = 1
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._start
            self.counts[generation] += 1


#: The last GC-on run's collector profile (set by :func:`_measure`).
_last_collector: list[_Collector] = []


def _measure(fn: Callable[[], int], gc_on: bool, target: int, n: int) -> tuple[float, float]:
    """CPU us per sample: the whole run (initial fill, run, shutdown) per sample generated to
    completion, and the steady window (see ``_window``: no fill, no shutdown) per sample
    generated in it."""
    global _window
    gc.collect()
    _marks.clear()
    _window = (n, target)
    if gc_on:
        gc.enable()
    else:
        gc.disable()
    _generated[0] = 0
    collector = _Collector()
    if gc_on:
        gc.callbacks.append(collector)
        _last_collector[:] = [collector]
    try:
        t0 = time.process_time()
        fn()
        cpu = time.process_time() - t0
    finally:
        gc.enable()
        if gc_on:
            gc.callbacks.remove(collector)
            collector.samples = max(1, _generated[0])
    (start, end) = _marks
    # Whole run: per sample generated to completion, whoever took it. The trio driver's exit
    # lets samples whose reply is in finish; the reference's cancels them: each side is
    # charged for the work it did and credited with the samples it finished.
    return cpu / _generated[0] * 1e6, (end - start) / (target - n) * 1e6


def _memory(fn: Callable[[], int], n: int, target: int) -> float:
    """Peak traced bytes over the steady window per in-flight sample (see ``_traced``)."""
    global _window
    gc.collect()
    _marks.clear()
    _traced.clear()
    _window = (n, target)
    _generated[0] = 0
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
    finally:
        tracemalloc.stop()
    (peak,) = _traced
    return (peak - base) / n


def _spread(values: list[float]) -> str:
    """Median and range of repeated figures, e.g. ``41.2 [39.8-44.0]``."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.1f}"
    return f"{med:.1f} [{min(values):.1f}-{max(values):.1f}]"


def part_b(
    sizes: list[int],
    factor: float,
    minimum: int,
    granularities: list[str],
    loop: str,
    repeat: int,
    memory: bool,
    gc_off: bool = True,
    machinery: bool = True,
) -> list[dict[str, Any]]:
    trio_fn = {"driver": _trio_driver, "bare": _trio_bare, "plain": _plain_trio}[loop]
    print(
        f"\n== B. scheduler CPU per finished sample (us, time.process_time), zero-latency samples, "
        f"G = {G}; each run finishes max({factor:g} x N, {minimum}) samples; trio-rl: {loop} loop "
        f"(batch {_batch_fraction:g} B, buffer {_buffer_fraction:g} B, at least one group); "
        f"asyncio: {_reference_label}, samples built as {_asyncio_samples} builds them"
    )
    print(
        f"   median [min-max] of {repeat} interleaved repetitions; whole run: fill, run and "
        "shutdown, per sample generated to completion; 'steady': per sample generated from the "
        "N-th to the target-th (after the first wave, before the shutdown)"
    )
    columns = [
        ("trio", "trio-rl whole"),
        ("asyncio", "asyncio whole"),
        ("trio_steady", "trio-rl steady"),
        ("asyncio_steady", "asyncio steady"),
        ("trio_nogc", "trio-rl whole, GC off"),
        ("asyncio_nogc", "asyncio whole, GC off"),
        ("trio_steady_nogc", "trio-rl steady, GC off"),
        ("asyncio_steady_nogc", "asyncio steady, GC off"),
    ]
    rows = []
    for granularity in granularities:
        policy: SubmissionPolicy = (
            SampleBackfill() if granularity == "sample" else GroupGranularity()
        )
        for n in sizes:
            target = max(int(factor * n), minimum)
            runs: dict[str, list[float]] = {key: [] for key, _ in columns}
            collected: dict[str, list[_Collector]] = {"trio-rl": [], "asyncio": []}
            trio_call = functools.partial(trio.run, trio_fn, policy, n, target)
            asyncio_call = functools.partial(_run_asyncio, granularity, n, target)
            for _ in range(repeat):
                for gc_on in (True, False) if gc_off else (True,):
                    suffix = "" if gc_on else "_nogc"
                    whole, steady = _measure(trio_call, gc_on, target, n)
                    runs["trio" + suffix].append(whole)
                    runs["trio_steady" + suffix].append(steady)
                    if gc_on:
                        collected["trio-rl"] += _last_collector
                    whole, steady = _measure(asyncio_call, gc_on, target, n)
                    runs["asyncio" + suffix].append(whole)
                    runs["asyncio_steady" + suffix].append(steady)
                    if gc_on:
                        collected["asyncio"] += _last_collector
            row: dict[str, Any] = {"policy": granularity, "n": n}
            print(
                f"{granularity} backfill, N = {n:,} in flight:"
                if granularity == "sample"
                else f"{granularity} granularity, N = {n:,} in flight:"
            )
            for key, label in columns:
                if not runs[key]:
                    continue
                row[key] = statistics.median(runs[key])
                row[key + "_runs"] = runs[key]
                print(f"   {label:<24} {_spread(runs[key]):>26} us/sample")
            for side in ("trio", "trio_steady", "trio_nogc", "trio_steady_nogc"):
                other = side.replace("trio", "asyncio")
                if side in row:
                    print(f"   ratio {side:<18} {row[side] / row[other]:>6.2f}x", end="")
            print()
            print("   collector, GC-on runs (medians): " + _collector_line(collected))
            for side, key in (("trio-rl", "trio_gen2"), ("asyncio", "asyncio_gen2")):
                row[key] = statistics.median(c.counts[2] for c in collected[side])
            row["load"] = os.getloadavg()[0]
            if memory:
                trio_bytes = _memory(trio_call, n, target)
                asyncio_bytes = _memory(asyncio_call, n, target)
                row["trio_bytes"], row["asyncio_bytes"] = trio_bytes, asyncio_bytes
                print(
                    f"   traced memory per in-flight sample (peak over the steady window): trio-rl "
                    f"{trio_bytes / 1024:.2f} KiB, asyncio {asyncio_bytes / 1024:.2f} KiB "
                    f"({trio_bytes / asyncio_bytes:.2f}x)"
                )
            rows.append(row)
    _goal_1(rows)
    if machinery:
        _machinery_only(rows, factor, minimum, loop, repeat)
    return rows


def _machinery_only(
    rows: list[dict[str, Any]], factor: float, minimum: int, loop: str, repeat: int
) -> None:
    """The machinery-only ratio: both sides build their groups from trio-rl's
    ``GroupFactory`` (the asyncio side's ``--asyncio-samples trio-rl``), so only tasks,
    nurseries and credits differ; GC on, ``repeat`` interleaved runs per size, medians."""
    global _asyncio_samples
    trio_fn = {"driver": _trio_driver, "bare": _trio_bare, "plain": _plain_trio}[loop]
    print(
        "-- machinery only: the asyncio side builds trio-rl's samples too (GroupFactory), so "
        f"the ratio compares tasks, nurseries and credits; GC on, {repeat} interleaved runs, "
        "medians [min-max]"
    )
    saved, _asyncio_samples = _asyncio_samples, "trio-rl"
    try:
        for row in rows:
            n, granularity = row["n"], row["policy"]
            policy: SubmissionPolicy = (
                SampleBackfill() if granularity == "sample" else GroupGranularity()
            )
            target = max(int(factor * n), minimum)
            trio_call = functools.partial(trio.run, trio_fn, policy, n, target)
            asyncio_call = functools.partial(_run_asyncio, granularity, n, target)
            found: dict[str, list[float]] = {k: [] for k in ("t", "a", "ts", "as", "tg", "ag")}
            for _ in range(repeat):
                whole, steady = _measure(trio_call, True, target, n)
                found["t"].append(whole)
                found["ts"].append(steady)
                found["tg"].append(_last_collector[0].counts[2])
                whole, steady = _measure(asyncio_call, True, target, n)
                found["a"].append(whole)
                found["as"].append(steady)
                found["ag"].append(_last_collector[0].counts[2])
            med = {k: statistics.median(v) for k, v in found.items()}
            print(
                f"machinery only ({granularity}): N = {n:>9,}  whole trio-rl {_spread(found['t'])} "
                f"vs asyncio {_spread(found['a'])} us ({med['t'] / med['a']:.2f}x), steady "
                f"{_spread(found['ts'])} vs {_spread(found['as'])} us "
                f"({med['ts'] / med['as']:.2f}x); gen-2 collections per run {med['tg']:.0f} vs "
                f"{med['ag']:.0f}"
            )
            ratio = med["t"] / med["a"]
            print(
                f"goal 1: machinery only, N = {n:>9,}: whole run {ratio:.2f}x (goal <= 1.0x: "
                f"{'reached' if ratio <= 1.0 else 'not reached'}), steady "
                f"{med['ts'] / med['as']:.2f}x; load average {os.getloadavg()[0]:.2f}"
            )
    finally:
        _asyncio_samples = saved


def _collector_line(collected: dict[str, list[_Collector]]) -> str:
    """Per side: collections and seconds per generation, medians over the GC-on runs."""
    parts = []
    for side, profiles in collected.items():
        gens = ", ".join(
            f"gen{g} {statistics.median(c.counts[g] for c in profiles):.0f} x "
            f"{statistics.median(c.seconds[g] for c in profiles):.2f} s"
            for g in range(3)
        )
        per_sample = statistics.median(sum(c.seconds) / c.samples * 1e6 for c in profiles)
        parts.append(f"{side} {gens} ({per_sample:.1f} us per sample generated)")
    return "; ".join(parts)


def _goal_1(rows: list[dict[str, Any]]) -> None:
    """Goal 1 from this run's medians: ratio <= 1.0x at every size, steady and whole
    run (GC on, python's thresholds unless changed on the command line), growth from the
    smallest to the largest size <= 1.5x, memory per in-flight sample <= the reference's."""
    for granularity in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == granularity]
        print(f"-- goal 1 ({granularity}): trio-rl / asyncio, medians of this run, GC on")
        for r in mine:
            whole, steady = r["trio"] / r["asyncio"], r["trio_steady"] / r["asyncio_steady"]
            memory = ""
            if "trio_bytes" in r:
                memory = (
                    f"; memory {r['trio_bytes'] / 1024:.2f} against {r['asyncio_bytes'] / 1024:.2f}"
                    f" KiB/sample ({r['trio_bytes'] / r['asyncio_bytes']:.2f}x, "
                    f"{'reached' if r['trio_bytes'] <= r['asyncio_bytes'] else 'not reached'})"
                )
            verdict = "reached" if max(whole, steady) <= 1.0 else "not reached"
            print(
                f"goal 1: N = {r['n']:>9,}  whole {r['trio']:6.1f} vs {r['asyncio']:6.1f} us "
                f"({whole:.2f}x), steady {r['trio_steady']:6.1f} vs {r['asyncio_steady']:6.1f} us "
                f"({steady:.2f}x): <= 1.0x {verdict}{memory}; gen-2 collections per run "
                f"{r['trio_gen2']:.0f} vs {r['asyncio_gen2']:.0f}; load average {r['load']:.2f}"
            )
            if r["n"] >= 1_000_000:
                gen2 = r["trio_gen2"] / max(1, r["asyncio_gen2"])
                print(
                    f"goal 1: at N = {r['n']:,} in flight: CPU per sample whole {whole:.2f}x, "
                    f"steady {steady:.2f}x (goal <= 0.8x: "
                    f"{'reached' if max(whole, steady) <= 0.8 else 'not reached'}); gen-2 "
                    f"collections per run {r['trio_gen2']:.0f} vs {r['asyncio_gen2']:.0f} "
                    f"({gen2:.2f}x; goal <= 2x: {'reached' if gen2 <= 2 else 'not reached'})"
                )
        if len(mine) > 1:
            first, last = mine[0], mine[-1]
            parts = []
            for key, label in (("", "whole"), ("_steady", "steady")):
                t = last["trio" + key] / first["trio" + key]
                a = last["asyncio" + key] / first["asyncio" + key]
                parts.append(f"{label} trio-rl {t:.2f}x, asyncio {a:.2f}x")
            worst = max(last["trio" + k] / first["trio" + k] for k in ("", "_steady"))
            verdict = "reached" if worst <= 1.5 else "not reached"
            print(
                f"goal 1: growth of CPU per sample from {first['n']:,} to {last['n']:,} in flight: "
                + "; ".join(parts)
                + f" (goal <= 1.5x, from 1k to 1M: {verdict} over the sizes run)"
            )


# --------------------------------------------------------------------------- part C


@attrs.define
class _RealTime:
    """One real-time run's clock window and figures. A slot is busy for a sample's nominal
    latency (start to start + latency) clipped to the window: time a finished sample waits for
    the loop to notice it, and time a free slot waits for an admission, count as idle."""

    slots: int
    median: float
    seconds: float
    seed: int
    warmup: float = 0.5
    t0: float = 0.0
    t1: float = 0.0
    busy: float = 0.0
    finished: int = 0
    lags: list[float] = attrs.field(factory=list)
    #: How late each reply reached its sample task (from its due time to the task running):
    #: the share of a slot's idle time that is the loop's timer, not the scheduler.
    late: list[float] = attrs.field(factory=list)
    draws: Any = None

    def start(self) -> None:
        self.draws = random.Random(self.seed)
        now = time.perf_counter()
        self.t0, self.t1 = now + self.warmup, now + self.warmup + self.seconds

    def latency(self) -> float:
        """Draw a sample's latency and book its busy time inside the window."""
        start = time.perf_counter()
        latency = self.median * math.exp(self.draws.gauss(0.0, 1.0))
        self.busy += max(0.0, min(start + latency, self.t1) - max(start, self.t0))
        return latency

    def done(self, due: float) -> None:
        now = time.perf_counter()
        if self.t0 <= now <= self.t1:
            self.finished += 1
            self.late.append(now - due)

    def lag(self, overshoot: float) -> None:
        if self.t0 <= time.perf_counter() <= self.t1:
            self.lags.append(overshoot)

    def figures(self, cpu: float) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        late = sorted(self.late) or [0.0]
        return {
            "occupancy": self.busy / (self.slots * self.seconds),
            "rate": self.finished / self.seconds,
            "cpu_us": cpu / max(1, self.finished) * 1e6,
            "lag_p95_ms": lags[int(0.95 * (len(lags) - 1))] * 1e3,
            "reply_ms": late[len(late) // 2] * 1e3,
            # CPU seconds per wall second of the window: 1.0 is one core saturated
            "core": cpu / self.seconds,
        }


_PROBE = 0.001


#: How the simulated engine delivers a reply. "timerfd" (default, both sides): as a socket's
#: readiness, a timerfd armed at the next due time ending the loop's I/O wait at once
#: (:class:`_FdReplies`, :class:`_AsyncioFdReplies`). The others are trio-side only, the asyncio
#: side then sleeping with ``asyncio.sleep``, whose timeout epoll rounds up to a millisecond:
#: "io" delivers after each I/O wait, bounded by a cancel scope's deadline (:class:`_IoReplies`;
#: the same millisecond rounding); "reactor" from one timer task that sets an event per reply
#: (a task hop between the timer and the sample that a socket reply does not have); "sleep" a
#: ``trio.sleep`` per sample (a cancel scope and a deadline-driven cancellation per sample,
#: which asyncio's ``call_later`` does not pay). Set by :func:`main`.
_rt_engine = "timerfd"


class _IoReplies(trio.abc.Instrument):
    """Replies delivered the way trio delivers a socket's readiness: right after each I/O wait
    of the run loop (``after_io_wait``, where trio's I/O manager reschedules the tasks whose
    sockets are ready), every sample whose reply is due is rescheduled, and runs in the batch
    that follows. (asyncio's side: ``asyncio.sleep``, a timer callback resolving the sample's
    future, the way a socket reader's callback would.)

    The loop's I/O wait must end no later than the next due reply: one idle task holds a cancel
    scope whose deadline is the earliest due time. A new earlier reply moves that deadline in
    place, and ``after_io_wait`` (which runs before trio expires deadlines) moves it on to the
    next due time once it delivered the due ones, so the scope never expires: no task wakes and
    no ``Cancelled`` is thrown per timer (trio's deadline expiry costs ~50 us of loop time per
    wake, the largest cost the real-time comparison found). Only the deadline heap is touched."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, list[trio.lowlevel.Task | None]]] = []
        self._n = itertools.count()
        self._scope = trio.CancelScope()

    async def wait(self, latency: float) -> None:
        due = trio.current_time() + latency
        entry: list[trio.lowlevel.Task | None] = [trio.lowlevel.current_task()]
        heapq.heappush(self._heap, (due, next(self._n), entry))
        if due < self._scope.deadline:
            self._scope.deadline = due

        def abort(_: object) -> trio.lowlevel.Abort:
            entry[0] = None  # cancelled: the reply is dropped when it comes due
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def after_io_wait(self, timeout: float) -> None:
        heap = self._heap
        if heap and heap[0][0] <= (now := trio.current_time()):
            while heap and heap[0][0] <= now:
                task = heapq.heappop(heap)[2][0]
                if task is not None:
                    trio.lowlevel.reschedule(task)
            self._scope.deadline = heap[0][0] if heap else math.inf

    async def run(self) -> None:
        trio.lowlevel.add_instrument(self)
        try:
            while True:
                # Expires only when a reply came due between this hook and trio's own clock
                # read right after it: the next I/O wait (timeout 0) delivers it.
                with self._scope:
                    await trio.sleep_forever()
                self._scope = trio.CancelScope(
                    deadline=self._heap[0][0] if self._heap else math.inf
                )
        finally:
            trio.lowlevel.remove_instrument(self)


class _FdReplies:
    """Replies that come as a socket's would (``--rt-engine timerfd``): a due reply makes a
    :class:`~_timerfd.TimerFd` readable, which ends the loop's I/O wait at once, and the task
    waiting on it reschedules every sample whose reply is due, as a reader task does with what
    its socket brought. The asyncio side's counterpart is :class:`_AsyncioFdReplies`, whose
    reader callback resolves the due samples' futures: the same hops on both loops."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, list[trio.lowlevel.Task | None]]] = []
        self._n = itertools.count()
        self._timer = TimerFd()

    async def wait(self, latency: float) -> None:
        due = time.monotonic() + latency
        entry: list[trio.lowlevel.Task | None] = [trio.lowlevel.current_task()]
        heapq.heappush(self._heap, (due, next(self._n), entry))
        if due < self._timer.armed:
            self._timer.arm(due)

        def abort(_: object) -> trio.lowlevel.Abort:
            entry[0] = None  # cancelled: the reply is dropped when it comes due
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self) -> None:
        heap, timer = self._heap, self._timer
        try:
            while True:
                await trio.lowlevel.wait_readable(timer.fd)
                timer.clear()
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    task = heapq.heappop(heap)[2][0]
                    if task is not None:
                        trio.lowlevel.reschedule(task)
                timer.arm(heap[0][0] if heap else math.inf)
        finally:
            timer.close()


class _AsyncioFdReplies:
    """:class:`_FdReplies` on asyncio: the timerfd registered with ``add_reader``, whose
    callback resolves every due reply's future, as a socket reader's callback would."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._n = itertools.count()
        self._timer = TimerFd()
        self._loop = loop
        loop.add_reader(self._timer.fd, self._fire)

    def wait(self, latency: float) -> asyncio.Future[None]:
        due = time.monotonic() + latency
        future = self._loop.create_future()
        heapq.heappush(self._heap, (due, next(self._n), future))
        if due < self._timer.armed:
            self._timer.arm(due)
        return future

    def _fire(self) -> None:
        self._timer.clear()
        heap, now = self._heap, time.monotonic()
        while heap and heap[0][0] <= now:
            future = heapq.heappop(heap)[2]
            if not future.done():
                future.set_result(None)
        self._timer.arm(heap[0][0] if heap else math.inf)

    def close(self) -> None:
        self._loop.remove_reader(self._timer.fd)
        self._timer.close()


class _Replies:
    """One task delivering every simulated reply at its time: a heap of (due, n, event)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, trio.Event]] = []
        self._n = itertools.count()
        self._changed = trio.Event()

    async def wait(self, latency: float) -> None:
        event = trio.Event()
        due = trio.current_time() + latency
        if not self._heap or due < self._heap[0][0]:
            self._changed.set()
        heapq.heappush(self._heap, (due, next(self._n), event))
        await event.wait()

    async def run(self) -> None:
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)[2].set()
            self._changed = trio.Event()
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._changed.wait()


async def _trio_real_time(rt: _RealTime) -> float:
    replies = {"io": _IoReplies, "timerfd": _FdReplies}.get(_rt_engine, _Replies)()

    async def generate(sample: Sample) -> None:
        latency = rt.latency()
        due = time.perf_counter() + latency
        if _rt_engine == "sleep":
            await trio.sleep(latency)
        else:
            await replies.wait(latency)
        sample.status = SampleStatus.COMPLETED
        rt.done(due)

    async def probe() -> None:
        while True:
            before = time.perf_counter()
            await trio.sleep(_PROBE)
            rt.lag(time.perf_counter() - before - _PROBE)

    budget = rt.slots // G
    rt.start()
    cpu0 = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        nursery.start_soon(replies.run)
        async with open_async_rollout(
            InMemorySource([_PROMPT], epochs=None),
            GroupFactory(G),
            GroupRunner(generate),
            batch_size=1,
            # Room for every group in flight (the reference's output deque is unbounded): the
            # default, two batches of one group, would stall the worker on backpressure
            # whenever the consumer is a step behind.
            buffer_capacity=budget,
            policy=SampleBackfill(),
            max_groups_in_flight=budget,
        ) as driver:
            await trio.sleep_until(trio.current_time() + rt.warmup)
            cpu0 = time.process_time()
            with trio.move_on_after(rt.seconds):
                while True:
                    await driver.next_batch()
            cpu = time.process_time() - cpu0
        nursery.cancel_scope.cancel()
    return cpu


async def _asyncio_real_time(rt: _RealTime) -> float:
    completed = ref.MilesSample.Status.COMPLETED
    counter = itertools.count().__next__
    prompt = ref.MilesSample(prompt="p", tokens=list(_PROMPT.tokens), label="x")
    replies = _AsyncioFdReplies(asyncio.get_running_loop()) if _rt_engine == "timerfd" else None

    async def generate(sample: Any) -> Any:
        latency = rt.latency()
        due = time.perf_counter() + latency
        if replies is None:
            await asyncio.sleep(latency)
        else:
            await replies.wait(latency)
        sample.status = completed
        rt.done(due)
        return sample

    async def probe() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(_PROBE)
            rt.lag(time.perf_counter() - before - _PROBE)

    rt.start()
    probe_task = asyncio.ensure_future(probe())
    cpu_at: list[float] = []

    async def timed() -> None:
        await asyncio.sleep(rt.warmup)
        cpu_at.append(time.process_time())
        await asyncio.sleep(rt.seconds)
        cpu_at.append(time.process_time())

    worker = asyncio.ensure_future(
        ref.fully_async_worker(
            _reference.SampleBackfillSubmission(G),
            lambda: ref.miles_group(prompt, G, counter),
            generate,
            group_budget=rt.slots // G,
            target_samples=1 << 62,
        )
    )
    await timed()
    for task in (worker, probe_task):
        task.cancel()
    await asyncio.gather(worker, probe_task, return_exceptions=True)
    if replies is not None:
        replies.close()
    return cpu_at[1] - cpu_at[0]


class _IoReturn(trio.abc.Instrument):
    """When trio's run loop last came back from its I/O wait."""

    at = 0.0

    def after_io_wait(self, timeout: float) -> None:
        self.at = time.perf_counter()


async def _trio_idle(seconds: float) -> tuple[list[float], list[float]]:
    """The probe alone: its lags, and the time from the loop's I/O wait returning to the
    probe running again (trio: the deadline's scope cancelled, ``Cancelled`` thrown in and
    caught by ``trio.sleep``)."""
    lags, wakes = [], []
    returned = _IoReturn()
    trio.lowlevel.add_instrument(returned)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = time.perf_counter()
        await trio.sleep(_PROBE)
        now = time.perf_counter()
        lags.append(now - before - _PROBE)
        wakes.append(now - returned.at)
    trio.lowlevel.remove_instrument(returned)
    return lags, wakes


async def _asyncio_idle(seconds: float) -> tuple[list[float], list[float]]:
    """As :func:`_trio_idle`, on asyncio (the selector's ``select`` timed: a timer callback
    resolves the sleep's future, the task runs in the next iteration)."""
    lags, wakes = [], []
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    select, returned = selector.select, [0.0]

    def timed_select(timeout: float | None = None) -> Any:
        events = select(timeout)
        returned[0] = time.perf_counter()
        return events

    selector.select = timed_select
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        before = time.perf_counter()
        await asyncio.sleep(_PROBE)
        now = time.perf_counter()
        lags.append(now - before - _PROBE)
        wakes.append(now - returned[0])
    selector.select = select
    return lags, wakes


def _idle_probe(repeat: int, seconds: float = 2.0) -> dict[str, tuple[float, float, float]]:
    """Each side's 1 ms probe on an otherwise idle loop, medians over ``repeat`` interleaved
    runs: lag p50 and p95 (ms), and the median time from the loop's I/O wait returning to the
    probe running (us). What a loop's own timer adds to every lag figure: trio wakes a sleeper
    by cancelling its deadline's scope, asyncio runs a timer callback."""
    found: dict[str, list[tuple[float, float, float]]] = {"trio-rl": [], "asyncio": []}
    for _ in range(repeat):
        for side, (lags, wakes) in (
            ("trio-rl", trio.run(_trio_idle, seconds)),
            ("asyncio", asyncio.run(_asyncio_idle(seconds))),
        ):
            ordered = sorted(lags)
            found[side].append(
                (
                    ordered[len(ordered) // 2] * 1e3,
                    ordered[int(0.95 * (len(ordered) - 1))] * 1e3,
                    statistics.median(wakes) * 1e6,
                )
            )
    return {
        side: (
            statistics.median(p[0] for p in v),
            statistics.median(p[1] for p in v),
            statistics.median(p[2] for p in v),
        )
        for side, v in found.items()
    }


def _real_time(side: str, median: float, seconds: float, slots: int, seed: int) -> dict[str, float]:
    rt = _RealTime(slots=slots, median=median, seconds=seconds, seed=seed)
    gc.collect()
    if side == "trio-rl":
        cpu = trio.run(_trio_real_time, rt)
    else:
        cpu = asyncio.run(_asyncio_real_time(rt))
    return rt.figures(cpu)


def part_c(seconds: float, slots: int, seed: int, repeat: int, scales: list[float]) -> None:
    """Real time: sample backfill against ``slots`` engine slots with lognormal latencies
    (median 20 ms x scale, sigma 1), both sides in turn; then each side's highest sample rate
    that keeps occupancy >= 0.95."""
    print(
        f"\n== C. real time: {slots} slots, lognormal latencies (median 20 ms x scale, sigma 1), "
        f"{seconds:g} s windows after 0.5 s warm-up, G = {G}, sample backfill; "
        f"engine replies: {_rt_engine}; "
        f"asyncio: {_reference_label}"
    )
    base = 0.020
    idle = _idle_probe(repeat)
    print(
        f"-- each loop's own timer: the 1 ms probe on an idle loop ({repeat} interleaved runs of "
        "2 s, medians): lag p50 / p95 trio-rl "
        f"{idle['trio-rl'][0]:.3f} / {idle['trio-rl'][1]:.3f} ms, asyncio "
        f"{idle['asyncio'][0]:.3f} / {idle['asyncio'][1]:.3f} ms; from the loop's I/O wait "
        f"returning to the sleeper running: trio-rl {idle['trio-rl'][2]:.1f} us, asyncio "
        f"{idle['asyncio'][2]:.1f} us"
    )
    print(f"-- at scale 1/10 (median 2 ms), median [min-max] of {repeat} interleaved runs")
    figures: dict[str, dict[str, list[float]]] = {"trio-rl": {}, "asyncio": {}}
    for r in range(repeat):
        for side in ("trio-rl", "asyncio"):
            for key, value in _real_time(side, base / 10, seconds, slots, seed + r).items():
                figures[side].setdefault(key, []).append(value)
    for key, label in [
        ("occupancy", "slot occupancy"),
        ("rate", "samples/s"),
        ("cpu_us", "CPU us/sample"),
        ("lag_p95_ms", "loop lag p95 ms"),
        ("reply_ms", "reply late ms"),
    ]:
        t, a = figures["trio-rl"][key], figures["asyncio"][key]
        fmt = (
            (lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
            if key in ("occupancy", "reply_ms")
            else _spread
        )
        print(f"   {label:<16} trio-rl {fmt(t):>24}   asyncio {fmt(a):>24}")
    print(
        f"-- highest sample rate with occupancy >= 0.95: latency scales tried longest first, "
        f"{repeat} interleaved runs per scale and side, median [min-max]; the search stops "
        "once both sides' median occupancy is below 0.95"
    )
    at: dict[float, dict[str, dict[str, list[float]]]] = {}
    for scale in sorted(scales, reverse=True):
        runs: dict[str, dict[str, list[float]]] = {"trio-rl": {}, "asyncio": {}}
        for r in range(repeat):
            for side in ("trio-rl", "asyncio") if r % 2 == 0 else ("asyncio", "trio-rl"):
                for key, value in _real_time(side, base * scale, seconds, slots, seed + r).items():
                    runs[side].setdefault(key, []).append(value)
        at[scale] = runs
        for side in ("trio-rl", "asyncio"):
            f = runs[side]
            occ = f["occupancy"]
            print(
                f"   scale {scale:<7.4g} {side:<8} occupancy {statistics.median(occ):.3f} "
                f"[{min(occ):.3f}-{max(occ):.3f}]  {statistics.median(f['rate']):>9,.0f} "
                f"samples/s  CPU {_spread(f['cpu_us'])} us/sample  "
                f"lag p95 {_spread(f['lag_p95_ms'])} ms  reply late "
                f"{statistics.median(f['reply_ms']):.3f} ms"
            )
        if all(statistics.median(runs[s]["occupancy"]) < 0.95 for s in runs):
            break
    best: dict[str, tuple[float, float]] = {}
    for side in ("trio-rl", "asyncio"):
        for scale in sorted(at, reverse=True):
            f = at[scale][side]
            if statistics.median(f["occupancy"]) >= 0.95:
                best[side] = (scale, statistics.median(f["rate"]))
    t = best.get("trio-rl", (0.0, 0.0))[1]
    a = best.get("asyncio", (0.0, 0.0))[1]
    ratio = t / a if a else float("nan")
    print(
        f"goal 2: highest rate at median occupancy >= 0.95: trio-rl {t:,.0f}/s, asyncio "
        f"{a:,.0f}/s, ratio {ratio:.2f}x (goal >= 1.0: "
        f"{'reached' if ratio >= 1.0 else 'not reached'}; steps of 1.25x in rate)"
    )
    if "asyncio" not in best:
        print("goal 2: the reference held 0.95 at no scale tried")
        return
    scale = best["asyncio"][0]
    f_t, f_a = at[scale]["trio-rl"], at[scale]["asyncio"]
    checks = []
    for key, label, fmt, better in (
        ("occupancy", "occupancy", "{:.3f}", lambda x, y: x >= y),
        ("cpu_us", "CPU us/sample", "{:.1f}", lambda x, y: x < y),
        ("lag_p95_ms", "loop lag p95 ms", "{:.2f}", lambda x, y: x <= y),
    ):
        mt, ma = statistics.median(f_t[key]), statistics.median(f_a[key])
        ok = better(mt, ma)
        checks.append(ok)
        print(
            f"goal 2: at the reference's highest >= 0.95 rate (scale {scale:.4g}, "
            f"{statistics.median(f_a['rate']):,.0f} samples/s): {label} trio-rl "
            + fmt.format(mt)
            + f" [{fmt.format(min(f_t[key]))}-{fmt.format(max(f_t[key]))}] vs asyncio "
            + fmt.format(ma)
            + f" [{fmt.format(min(f_a[key]))}-{fmt.format(max(f_a[key]))}]: "
            + ("reached" if ok else f"not reached (by {mt - ma:+.3g})")
        )
    print(
        f"goal 2: at that rate, each reply reached its sample a median "
        f"{statistics.median(f_t['reply_ms']):.3f} ms (trio-rl) against "
        f"{statistics.median(f_a['reply_ms']):.3f} ms (asyncio) after its due time; on an idle "
        f"loop the probe's lag p95 is {idle['trio-rl'][1]:.3f} against {idle['asyncio'][1]:.3f} "
        f"ms, and a sleeper runs {idle['trio-rl'][2]:.1f} against {idle['asyncio'][2]:.1f} us "
        "after the loop's I/O wait returns (each loop's timer alone)"
    )


def part_c_loads(
    medians_ms: list[float], seconds: float, slots: int, seed: int, repeat: int
) -> None:
    """Real time at several offered loads, both sides side by side: ``slots`` slots, lognormal
    latencies of each median (sigma 1, so the mean is median x e^0.5 and the offered load is
    slots / mean samples/s), sample backfill, interleaved runs (the side that goes first
    alternates). Printed per load: samples/s, CPU per sample, occupancy and the share of a core
    the loop used (1.0: a core saturated), median [min-max]."""
    print(
        f"\n== C2. real time at several offered loads: {slots} slots, lognormal latencies (sigma "
        f"1), {seconds:g} s windows after 0.5 s warm-up, G = {G}, sample backfill, {repeat} "
        f"interleaved runs per load and side; engine replies: {_rt_engine}; asyncio: "
        f"{_reference_label}"
    )
    header = (
        f"{'median ms':>9} {'offered/s':>10} | {'side':<8} {'samples/s':>18} "
        f"{'CPU us/sample':>20} {'occupancy':>22} {'core':>16}"
    )
    print(header)
    print("-" * len(header))
    for median_ms in medians_ms:
        median = median_ms / 1e3
        offered = slots / (median * math.exp(0.5))
        runs: dict[str, dict[str, list[float]]] = {"trio-rl": {}, "asyncio": {}}
        for r in range(repeat):
            for side in ("trio-rl", "asyncio") if r % 2 == 0 else ("asyncio", "trio-rl"):
                for key, value in _real_time(side, median, seconds, slots, seed + r).items():
                    runs[side].setdefault(key, []).append(value)
        for side in ("trio-rl", "asyncio"):
            f = runs[side]
            occ = f["occupancy"]
            print(
                f"{median_ms:>9g} {offered:>10,.0f} | {side:<8} {_spread(f['rate']):>18} "
                f"{_spread(f['cpu_us']):>20} "
                f"{statistics.median(occ):.3f} [{min(occ):.3f}-{max(occ):.3f}] "
                f"{statistics.median(f['core']):.2f} [{min(f['core']):.2f}-{max(f['core']):.2f}]"
            )
        t, a = runs["trio-rl"], runs["asyncio"]
        mt = {k: statistics.median(v) for k, v in t.items()}
        ma = {k: statistics.median(v) for k, v in a.items()}
        checks = [
            ("CPU per sample", mt["cpu_us"] <= ma["cpu_us"], f"{mt['cpu_us'] / ma['cpu_us']:.2f}x"),
            ("samples/s", mt["rate"] >= ma["rate"], f"{mt['rate'] / ma['rate']:.3f}x"),
            ("occupancy", mt["occupancy"] >= ma["occupancy"],
             f"{mt['occupancy']:.3f} vs {ma['occupancy']:.3f}"),
        ]  # fmt: skip
        saturated = " (a core saturated)" if max(mt["core"], ma["core"]) >= 0.9 else ""
        print(
            f"goal 2: offered {offered:,.0f}/s (median {median_ms:g} ms){saturated}: "
            + "; ".join(
                f"{label} {ratio}: {'reached' if ok else 'not reached'}"
                for label, ok, ratio in checks
            )
        )


def _scales(text: str) -> list[float]:
    """``auto``: 2 / 1.25**k for k = 0..12 (rate steps of 1.25x); else a comma list."""
    if text == "auto":
        return [2.0 / 1.25**k for k in range(13)]
    return [float(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the simulated hours of part A"
    )
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32, help="B, in groups (part A)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="1000,10000,100000", help="samples in flight (part B)")
    parser.add_argument(
        "--factor",
        type=float,
        default=3.0,
        help="finished samples per run / N, more than 1 (default 3: the steady window, from the "
        "N-th sample generated to the target-th, spans two waves of N)",
    )
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
    parser.add_argument(
        "--batch",
        type=float,
        default=0.0,
        help="part B driver: the consumer's batch, as a fraction of B groups, at least one "
        "(default 0: one group, as the reference's consumer drains each group at once)",
    )
    parser.add_argument(
        "--buffer",
        type=float,
        default=0.0,
        help="part B driver: buffer_capacity as a fraction of B groups, at least one (default "
        "0: one group, so the worker does not run ahead; the driver's own default is 2 batches)",
    )
    parser.add_argument(
        "--gc-threshold",
        default=None,
        help="gc.set_threshold for the whole process, e.g. 50000,20,100 (default: python's)",
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() after start-up (both sides)"
    )
    parser.add_argument(
        "--rt-engine",
        choices=["timerfd", "io", "reactor", "sleep"],
        default="timerfd",
        help="part C: replies delivered as a socket's readiness, through a timerfd, on both sides "
        "(default); or, trio side only against asyncio.sleep: after each I/O wait up to a "
        "deadline (io), by one timer task setting an event per reply, or by a trio.sleep per "
        "sample",
    )
    parser.add_argument("--rt-seconds", type=float, default=5.0, help="window per run (part C)")
    parser.add_argument(
        "--rt-loads",
        default="20,10,5,2",
        help="part C2: median latencies in ms, comma separated, each an offered load of "
        "slots / (median x e^0.5) samples/s (default 20,10,5,2: from ~40%% of a core to a core "
        "saturated on this machine); 'none' skips C2",
    )
    parser.add_argument(
        "--rt-scales",
        default="auto",
        help="latency scales the part C search tries, comma separated; 'auto' (default): "
        "2 / 1.25**k, i.e. rate steps of 1.25x from median 40 ms down",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="repetitions per row (part B) and per scale (C)"
    )
    parser.add_argument("--no-gc-off", action="store_true", help="skip the GC-off runs of part B")
    parser.add_argument(
        "--no-machinery",
        action="store_true",
        help="skip part B's machinery-only runs (the asyncio side building trio-rl's samples)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the traced-memory run per row (part B)"
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=ref.DEFAULT_REFERENCE,
        help="miles' submission_scheduler.py, loaded unmodified (default: %(default)s)",
    )
    parser.add_argument(
        "--asyncio-samples",
        choices=["miles", "trio-rl"],
        default="miles",
        help="what the asyncio side builds its groups from: miles' Sample dataclass (default) "
        "or trio-rl's GroupFactory",
    )
    args = parser.parse_args()
    global _reference, _reference_label, _asyncio_samples, _batch_fraction, _buffer_fraction
    global _rt_engine
    _rt_engine = args.rt_engine
    if args.factor <= 1:
        parser.error(
            f"--factor must be more than 1 (the steady window is N to the target), got {args.factor:g}"
        )
    _batch_fraction, _buffer_fraction = args.batch, args.buffer
    # The application's levers on the collector (both sides run under the same settings); the
    # library never touches the GC.
    if args.gc_threshold is not None:
        gc.set_threshold(*(int(x) for x in args.gc_threshold.split(",")))
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    print(f"gc thresholds {gc.get_threshold()}, frozen objects {gc.get_freeze_count()}")
    _reference, _reference_label = ref.load_scheduler(args.reference)
    _asyncio_samples = args.asyncio_samples
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}")
    print(f"asyncio side: {_reference_label}")
    if args.part in ("a", "all"):
        part_a(args.scale, args.slots, args.budget, args.seed, args.loop)
    if args.part in ("b", "all"):
        part_b(
            [int(s) for s in args.sizes.split(",")],
            args.factor,
            args.minimum,
            args.granularity.split(","),
            args.loop,
            args.repeat,
            not args.no_memory,
            not args.no_gc_off,
            machinery=not args.no_machinery and args.asyncio_samples == "miles",
        )
    if args.part in ("c", "all"):
        part_c(
            args.rt_seconds,
            args.slots,
            args.seed,
            args.repeat,
            _scales(args.rt_scales),
        )
        if args.rt_loads != "none":
            part_c_loads(
                [float(x) for x in args.rt_loads.split(",")],
                args.rt_seconds,
                args.slots,
                args.seed,
                args.repeat,
            )


if __name__ == "__main__":
    main()
