"""A checkpoint that loads but whose run state (source cursor, factory state, policy version)
is malformed is refused with a `CheckpointError` naming the file and the field, never a raw
`AttributeError` or `ValueError` from deep inside the resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trio_rl.engines import SimulatedEngine
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt
from trio_rl.sink import CheckpointError, CheckpointManager, SinkConfig, TrainSink
from trio_rl.transport import MemorySender

PROMPTS = [Prompt(key="k", tokens=(1, 2))]
GOOD = {
    "source": InMemorySource(PROMPTS).state(),
    "factory": {"next_sample_index": 0, "next_group_index": 0},
}


@pytest.mark.parametrize(
    ("cursor", "progress", "field"),
    [
        ([1, 2], {"policy_version": 0}, "cursor"),
        ({**GOOD, "source": "here"}, {"policy_version": 0}, "cursor.source"),
        (
            {**GOOD, "factory": {"next_sample_index": -3, "next_group_index": 0}},
            {},
            "cursor.factory",
        ),
        (GOOD, {"policy_version": "7"}, "progress.policy_version"),
        (GOOD, {"policy_version": -1}, "progress.policy_version"),
    ],
)
async def test_malformed_run_state_is_a_checkpoint_error(
    tmp_path: Path, cursor: Any, progress: Any, field: str
) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    sink = TrainSink(SinkConfig(batch_size=8))
    path = manager.write(manager.snapshot(sink, step=0, cursor=cursor, progress=progress))

    source = InMemorySource(PROMPTS)
    config = OrchestratorConfig(batch_groups=2, group_size=4)
    with pytest.raises(CheckpointError) as info:
        async with open_orchestrator(
            SimulatedEngine(seconds_per_token=1e-6),
            source,
            MemorySender(1),
            config=config,
            checkpoint_dir=tmp_path / "ckpt",
        ):
            pass  # pragma: no cover - the resume refuses first
    message = str(info.value)
    assert str(path) in message
    assert f"{field}:" in message
