"""When a finite source runs dry, the trainer ranks' iteration ends instead of waiting forever."""

from __future__ import annotations

from pathlib import Path

import trio

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt, Sample
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender, ZmqSender, free_port_pair


def _reward(sample: Sample) -> float:
    return float(sample.index % 4)


async def _run(sender: FileSender | ZmqSender, receivers: list[BatchReceiver]) -> None:
    got: dict[int, list[int]] = {r: [] for r in range(len(receivers))}

    async def rank(r: int, receiver: BatchReceiver) -> None:
        async with receiver as batches:
            async for step, _ in batches:
                got[r].append(step)

    config = OrchestratorConfig(
        batch_groups=2, group_size=4, max_async_level=1000, sampling=SamplingParams(max_tokens=16)
    )
    engine = SimulatedEngine(distribution="long-cot", slots=8, seed=1, seconds_per_token=1e-7)
    source = InMemorySource([Prompt(key=f"k{i}", tokens=(i, 1)) for i in range(7)])
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for r, receiver in enumerate(receivers):
                nursery.start_soon(rank, r, receiver)
            async with sender, open_orchestrator(engine, source, sender, config=config,
                                                 sample_reward=_reward) as orch:  # fmt: skip
                summary = await orch.run(100)
    assert summary.exhausted
    steps = list(range(1, summary.last_step + 1))
    assert steps == [1, 2, 3, 4]  # 7 groups of a batch of 2: the last batch is shorter
    assert got == {r: steps for r in range(len(receivers))}


async def test_file_receivers_stop_at_the_end_of_the_stream(tmp_path: Path) -> None:
    receivers = [
        BatchReceiver(FileReceiver(tmp_path, r, start_step=1, max_poll_interval=0.01))
        for r in range(2)
    ]
    await _run(FileSender(tmp_path, 2, fsync=False), receivers)


async def test_zmq_receivers_stop_at_the_end_of_the_stream() -> None:
    port = free_port_pair()
    receivers = [BatchReceiver.zmq(r, port=port, start_step=1) for r in range(2)]
    await _run(ZmqSender(2, port=port), receivers)
