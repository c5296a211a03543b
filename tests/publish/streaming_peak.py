"""Measures the publisher's peak traced memory over one multi-rank step, in a fresh process.

Run as ``PYTHONPATH=tests python tests/publish/streaming_peak.py <directory> <durable: 0|1>``
(tests/ for the shared builders); prints one JSON object. A subprocess, so threads and caches
left by other tests cannot add to the measured peak.
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from builders import make_sink
from trio_rl.publish import SinkCheckpointer, open_publisher
from trio_rl.sink import CheckpointManager, TrainingSample
from trio_rl.transport import FileSender
from trio_rl.wire import MicroBatch, encode

WORLD, PER_RANK, TOKENS = 4, 4, 20_000

Packer = Callable[[Sequence[TrainingSample]], list[list[MicroBatch]]]


def micro_batch(rank: int, index: int) -> MicroBatch:
    base = rank * 100 + index
    return MicroBatch(
        input_ids=[base + i for i in range(TOKENS)],
        loss_mask=[i % 2 == 0 for i in range(TOKENS)],
        advantages=[float(base) / 7] * TOKENS,
        inference_logprobs=[-0.5 - i / TOKENS for i in range(TOKENS)],
        position_ids=list(range(TOKENS)),
        sequence_lengths=[TOKENS],
        temperatures=[1.0] * TOKENS,
        env_names=[f"env-{rank}"],
        seq_lens=[TOKENS],
    )


def fixed(grid: list[list[MicroBatch]]) -> Packer:
    # The grid is built before measuring: what is measured is encoding and writing.
    return lambda samples: grid


async def measure(directory: Path, durable: bool) -> dict[str, object]:
    grid = [[micro_batch(r, i) for i in range(PER_RANK)] for r in range(WORLD)]
    expected = [encode(ranks) for ranks in grid]  # (the release empties the grid once shipped)
    sink = make_sink(2, groups=1)
    checkpointer = (
        SinkCheckpointer(CheckpointManager(directory / "ckpt", keep=2), sink) if durable else None
    )
    async with (
        FileSender(directory, world_size=WORLD, fsync=False) as sender,
        open_publisher(sink, sender, pack=fixed(grid), checkpointer=checkpointer) as pub,
    ):
        gc.collect()
        tracemalloc.start()
        try:
            record = await pub.publish()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert record is not None
    return {
        "peak": peak,
        "rank_bytes": [len(p) for p in expected],
        "payload_bytes": record.payload_bytes,
        "files_match": all(
            (directory / "batches" / "step_1" / f"rank_{r}.bin").read_bytes() == expected[r]
            for r in range(WORLD)
        ),
    }


if __name__ == "__main__":
    print(json.dumps(trio.run(measure, Path(sys.argv[1]), sys.argv[2] == "1")))
