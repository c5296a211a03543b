"""Resume at every point of the ship/version cycle completes: no hang in the ship gate, and every
(step, rank) the trainer reads keeps its content and is read exactly once."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.orchestrator import Orchestrator, OrchestratorConfig, open_orchestrator
from trio_rl.publish import Shipment
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt, Sample
from trio_rl.transport import FileReceiver, FileSender, Payload

RANKS = 2
STEPS = 5
POINTS = ["before_send", "after_send", "in_monitor", "after_version"]


class _Kill(Exception):
    pass


class _Sender(FileSender):
    """A real file sender that 'dies' before or after the write of one step."""

    point: str | None = None
    at_step = -1

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        if self.point == "before_send" and step == self.at_step:
            raise _Kill
        await super().send(step, payloads)
        if self.point == "after_send" and step == self.at_step:
            raise _Kill


def _reward(sample: Sample) -> float:
    return float(sample.index % 4)


async def _trainer(
    orch: Orchestrator, out: Path, trained: dict[tuple[int, int], str], kill: Any
) -> None:
    # A durable trainer: `trained` survives the 'crash'; it resumes after its last step.
    starts = [max([s for s, r in trained if r == rank], default=0) + 1 for rank in range(RANKS)]
    if min(starts) - 1 > orch.policy_version:
        orch.set_policy_version(min(starts) - 1)
    receivers = [
        FileReceiver(out, r, start_step=starts[r], max_poll_interval=0.01) for r in range(RANKS)
    ]
    for step in range(min(starts), STEPS + 1):
        for rank, rx in enumerate(receivers):
            if step < starts[rank]:
                continue
            got = await rx.receive()
            key = (step, rank)
            assert key not in trained, f"{key} read twice"
            trained[key] = hashlib.sha256(bytes(got.data)).hexdigest()
        orch.set_policy_version(step)
        kill("after_version", step)


async def _one_run(
    out: Path,
    trained: dict[tuple[int, int], str],
    seen: dict[tuple[int, int], str],
    point: str | None,
    at_step: int,
) -> bool:
    def kill(where: str, step: int) -> None:
        if where == point and step == at_step:
            raise _Kill

    def monitor(shipment: Shipment) -> None:
        kill("in_monitor", shipment.record.step)

    config = OrchestratorConfig(
        batch_groups=2, group_size=4, seed=3, sampling=SamplingParams(max_tokens=32)
    )
    engine = SimulatedEngine(distribution="long-cot", slots=16, seed=3, seconds_per_token=1e-7)
    source = InMemorySource([Prompt(key=f"p{i}", tokens=(i, 1, 2)) for i in range(64)])
    sender = _Sender(out, RANKS, fsync=False)
    sender.point, sender.at_step = point, at_step
    try:
        async with (
            sender,
            open_orchestrator(
                engine,
                source,
                sender,
                config=config,
                checkpoint_dir=out / "ckpt",
                sample_reward=_reward,
                monitor=monitor,
            ) as orch,
        ):
            orch.gate_warn_after = 0.5
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_trainer, orch, out, trained, kill)
                await orch.run(STEPS - orch.step + 1)
    except BaseExceptionGroup as group:
        if group.subgroup(_Kill) is None:
            raise
        return False
    except _Kill:
        return False
    finally:
        for path in (out / "batches").glob("step_*/rank_*.bin"):
            key = (int(path.parent.name[5:]), int(path.stem[5:]))
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert seen.setdefault(key, digest) == digest, f"{key} changed on disk"
    return True


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("at_step", range(1, STEPS))
async def test_resume_at_every_point_completes(tmp_path: Path, point: str, at_step: int) -> None:
    trained: dict[tuple[int, int], str] = {}
    seen: dict[tuple[int, int], str] = {}
    with trio.fail_after(8):
        assert not await _one_run(tmp_path, trained, seen, point, at_step)
        assert await _one_run(tmp_path, trained, seen, None, -1)
    assert sorted(trained) == [(s, r) for s in range(1, STEPS + 1) for r in range(RANKS)]
    for key, digest in trained.items():
        assert seen.get(key, digest) == digest, f"{key}: the trainer read other bytes"
    assert not list((tmp_path / "ckpt").glob("outbox_step_*.bin"))
