"""Publication benchmark: event-loop lag while a big train batch is finalized and shipped.

A 5 ms heartbeat task measures how late each wake-up is while one batch of TrainingSamples is
finalized (pack, cohort metrics, MessagePack encoding, file writes to a filesystem transport,
deferred memory release) two ways, side by side in one run:

- ``inline``: every step called synchronously from the trio task, as an asyncio orchestrator
  without ``to_thread`` would;
- ``publisher``: ``trio_rl.publish.open_publisher`` (worker threads, one shared limiter, the
  file sender on the same limiter, the release deferred to a worker).

Both variants ship the same samples and write byte-identical files. The encoder packs one
micro-batch at a time (msgpack C calls hold the GIL for a whole call, so the loop gets the GIL
back between micro-batches, not during one).

Run: ``python benchmarks/bench_publish.py`` (``--samples``, ``--tokens``, ``--ranks``,
``--seq-len`` for bigger or smaller runs; ``--switch-ms`` to change the interpreter's GIL
switch interval).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from trio_rl.publish import Packer, cohort_stats, open_publisher, pack_samples, release_containers
from trio_rl.samples import Group, Prompt, Sample, SampleStatus
from trio_rl.train import SinkConfig, TrainSink
from trio_rl.transport import FileSender
from trio_rl.wire import encode

HEARTBEAT = 0.005


def _packer(ranks: int, seq_len: int) -> Packer:
    return functools.partial(pack_samples, seq_len=seq_len, num_ranks=ranks)


def build_sink(samples: int, tokens: int) -> TrainSink:
    sink = TrainSink(SinkConfig(batch_size=samples, max_off_policy_steps=None))
    prompt_len = tokens // 4
    index = 0
    for g in range(samples // 8):
        prompt = Prompt(key=f"p{g}", tokens=list(range(prompt_len)))
        members = []
        for i in range(8):
            completion = tokens - prompt_len - (i * 7) % 64
            members.append(
                Sample(
                    index=index,
                    group_index=g,
                    prompt_tokens=prompt.tokens,
                    completion_tokens=[(index + k) % 50_000 for k in range(completion)],
                    logprobs=[-0.1 - (k % 13) / 100 for k in range(completion)],
                    loss_mask=[True] * completion,
                    reward=float(i % 2),
                    status=SampleStatus.COMPLETED,
                    policy_versions=[0],
                )
            )
            index += 1
        sink.add_group(Group(group_id=f"g{g}", prompt=prompt, samples=members))
    return sink


class Heartbeat:
    def __init__(self) -> None:
        self.beats: list[tuple[float, float]] = []  # (went to sleep, woke up)

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await trio.sleep(HEARTBEAT)
            self.beats.append((before, time.perf_counter()))

    def summary(self, start: float, end: float) -> tuple[int, float, float, float]:
        """Lag of every beat that overlapped the publication window ``[start, end]``."""
        lags = sorted(
            woke - slept - HEARTBEAT for slept, woke in self.beats if woke >= start and slept <= end
        )
        lags = lags or [0.0]
        p95 = lags[min(len(lags) - 1, int(0.95 * len(lags)))]
        return len(lags), statistics.median_low(lags), p95, lags[-1]


def publish_inline(sink: TrainSink, directory: Path, ranks: int, seq_len: int) -> None:
    """Everything on the calling thread (the event loop)."""
    detached = sink.detach_batch()
    samples = list(detached.samples)
    grid = _packer(ranks, seq_len)(samples)
    cohort_stats(samples, detached.step)
    payloads = [encode(rank) for rank in grid]
    sender = FileSender(directory, world_size=ranks, fsync=False)
    sender._write_step(detached.step, payloads)  # the sender's own blocking writer
    sink.settle_batch(detached)
    release_containers([samples, detached.samples, payloads, *grid, grid])


async def measure(variant: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    sink = build_sink(args.samples, args.tokens)
    directory = root / variant
    beat = Heartbeat()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat.run)
        await trio.sleep(0.05)
        start = time.perf_counter()
        if variant == "inline":
            publish_inline(sink, directory, args.ranks, args.seq_len)
            await trio.sleep(0)
        else:
            limiter = trio.CapacityLimiter(4)
            async with (
                FileSender(
                    directory, world_size=args.ranks, fsync=False, limiter=limiter
                ) as sender,
                open_publisher(
                    sink, sender, pack=_packer(args.ranks, args.seq_len), limiter=limiter
                ) as pub,
            ):
                record = await pub.publish()
                assert record is not None
        end = time.perf_counter()
        await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    wall = end - start
    beats, p50, p95, worst = beat.summary(start, end)
    size = sum(f.stat().st_size for f in directory.rglob("*.bin"))
    return {"wall": wall, "beats": beats, "p50": p50, "p95": p95, "max": worst, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument(
        "--switch-ms", type=float, default=None, help="sys.setswitchinterval, in ms (default 5)"
    )
    args = parser.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1000)
    root = Path(tempfile.mkdtemp(prefix="bench_publish_"))
    try:
        print(
            f"batch: {args.samples} samples x ~{args.tokens} tokens, {args.ranks} ranks, "
            f"seq_len {args.seq_len}; heartbeat {HEARTBEAT * 1000:.0f} ms; "
            f"switchinterval {sys.getswitchinterval() * 1000:.0f} ms"
        )
        results = {v: trio.run(measure, v, args, root) for v in ("inline", "publisher")}
        same = all(
            (root / "inline" / p.relative_to(root / "publisher")).read_bytes() == p.read_bytes()
            for p in (root / "publisher").rglob("*.bin")
        )
        print(f"{'variant':<10} {'wall s':>8} {'beats':>6} {'lag p50':>10} {'p95':>10} {'max':>10}")
        for variant, r in results.items():
            print(
                f"{variant:<10} {r['wall']:8.2f} {r['beats']:6.0f} {r['p50'] * 1e3:8.1f}ms "
                f"{r['p95'] * 1e3:8.1f}ms {r['max'] * 1e3:8.1f}ms"
            )
        print(f"payload {results['inline']['bytes'] / 2**20:.1f} MiB; files identical: {same}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
