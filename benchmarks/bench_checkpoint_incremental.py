"""Incremental checkpoints: loop pause, bytes and wall time per checkpoint at a steady queue.

For each queue size N (samples of ``--tokens`` tokens, built as in ``bench_checkpoint.py``), a
steady state: every step ``--arrivals`` new samples are queued and a batch of as many ships, so
the queue stays at N; after each step the orchestrator's checkpoint runs (snapshot on the loop,
write in a worker thread). Side by side in one run:

* ``full``: ``CheckpointManager`` as before, a full checkpoint every step (``--full-steps``);
* ``incremental``: ``CheckpointManager(incremental=True)``: the first checkpoint is the full
  base (reported on its own line), then a delta per step (``--steps``);
* ``compaction``: the same incremental manager rewriting its newest delta as a full file in
  the background while the steps go on (loop pause measured while it runs).

A 5 ms heartbeat task records its lateness during each checkpoint (p95 / max over all steps).

    python benchmarks/bench_checkpoint_incremental.py --sizes 10000,100000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

sys.path.insert(0, str(Path(__file__).parent))
from bench_checkpoint import HEARTBEAT, build_sink, heartbeat, pct
from trio_rl.sink import CheckpointManager, TrainingSample, TrainSink


def arrive(sink: TrainSink, template: list[TrainingSample], k: int, version: int) -> None:
    """``k`` new samples queued (shared token lists, new objects), counted as dispatched."""
    sink._tally.dispatched(k)
    for j in range(k):
        a = sink._next_arrival
        sink._next_arrival += 1
        ts = attrs.evolve(template[j % len(template)], arrival=a, policy_version=version)
        sink.queue.enqueue(ts)


async def run_steps(
    sink: TrainSink, mgr: CheckpointManager, steps: int, arrivals: int, template: list
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"lags": [], "snap": [], "wall": [], "bytes": []}
    for _ in range(steps):
        arrive(sink, template, arrivals, version=10**6 + sink.step)
        await sink.take_batch()
        lags: list[float] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat, lags, stop)
            await trio.sleep(0.02)
            lags.clear()
            t0 = time.perf_counter()
            snap = mgr.snapshot(sink)
            out["snap"].append(time.perf_counter() - t0)
            await mgr.save(snap)
            out["wall"].append(time.perf_counter() - t0)
            await trio.sleep(2 * HEARTBEAT)
            stop.set()
        out["lags"].extend(lags)
        out["bytes"].append(mgr.written_bytes[-1])
    return out


def line(name: str, n: int, r: dict[str, list[float]]) -> str:
    lags = r["lags"]
    return (
        f"{n:>8} {name:>12} {len(r['wall']):>5} {statistics.median(r['bytes']) / 1e6:>10.2f} "
        f"{1e3 * max(r['snap']):>12.2f} {statistics.median(r['wall']):>9.3f} "
        f"{max(r['wall']):>9.3f} {1e3 * pct(lags, 0.5):>8.1f} {1e3 * pct(lags, 0.95):>8.1f} "
        f"{1e3 * max(lags, default=0.0):>8.1f}"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10000", help="comma-separated queue sizes")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--arrivals", type=int, default=256, help="samples arriving per step")
    ap.add_argument("--steps", type=int, default=20, help="incremental steps per size")
    ap.add_argument("--full-steps", type=int, default=1, help="full-checkpoint steps per size")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-inc-"))
    print(
        f"checkpoints at a steady queue: {args.arrivals} samples arrive and {args.arrivals} ship "
        f"per step, {args.tokens} tokens/sample, dir {base}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'queued':>8} {'mode':>12} {'steps':>5} {'MB/ckpt':>10} {'snap max ms':>12} "
        f"{'wall p50':>9} {'wall max':>9} {'lag p50':>8} {'lag p95':>8} {'lag max':>8}"
    )
    goals = []
    compaction_lags: dict[int, list[float]] = {}
    for n in (int(s) for s in args.sizes.split(",")):
        sink = build_sink(n, args.tokens)
        sink.queue.config = attrs.evolve(sink.config, batch_size=args.arrivals)
        sink.config = sink.queue.config
        template = sink.queued_samples()[:8]
        limiter = trio.CapacityLimiter(4)
        full_dir, inc_dir = base / f"full-{n}", base / f"inc-{n}"
        full = CheckpointManager(full_dir, keep=1, limiter=limiter)
        r = await run_steps(sink, full, args.full_steps, args.arrivals, template)
        print(line("full", n, r), flush=True)
        shutil.rmtree(full_dir, ignore_errors=True)
        # incremental: the base (a full checkpoint), then deltas; no compaction meanwhile
        inc = CheckpointManager(inc_dir, keep=1, limiter=limiter, incremental=True)
        inc.compact_ratio = 1e12
        r = await run_steps(sink, inc, 1, args.arrivals, template)
        print(line("incr. base", n, r), flush=True)
        r = await run_steps(sink, inc, args.steps, args.arrivals, template)
        print(line("incr. delta", n, r), flush=True)
        goals.append((n, r))
        # a compaction in the background while steps go on
        inc.compact_ratio = 1e-12
        t0 = time.perf_counter()
        before = inc.compactions
        r = await run_steps(sink, inc, 1, args.arrivals, template)
        inc.compact_ratio = 1e12
        while inc.compactions == before and inc._chain.compaction.thread is not None:
            if not inc._chain.compaction.thread.is_alive():
                break
            r2 = await run_steps(sink, inc, 1, args.arrivals, template)
            for k in r:
                r[k].extend(r2[k])
        took = time.perf_counter() - t0
        print(line("compaction", n, r) + f"   (compaction done in {took:.1f} s)", flush=True)
        compaction_lags[n] = r["lags"]
        inc.close()
        shutil.rmtree(inc_dir, ignore_errors=True)
        del sink
    for n, r in goals:
        # the deltas' steps and the steps taken while a compaction ran, together
        lags = r["lags"] + compaction_lags.get(n, [])
        p95, worst = 1e3 * pct(lags, 0.95), 1e3 * max(lags)
        print(
            f"goal 4: {n:,} queued, incremental (deltas, and steps during a compaction): lag "
            f"p95 {p95:.1f} ms (goal <= 20: {'reached' if p95 <= 20 else 'not reached'}), max "
            f"{worst:.1f} ms (goal <= 50: {'reached' if worst <= 50 else 'not reached'}); "
            f"{statistics.median(r['bytes']) / 1e6:.1f} MB and "
            f"{statistics.median(r['wall']):.2f} s per checkpoint for {args.arrivals} arrivals"
        )
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    trio.run(main)
