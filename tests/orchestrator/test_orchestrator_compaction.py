"""A checkpoint compaction that failed and was not reported by a write (fewer failures than
``COMPACTION_ATTEMPTS``) is raised when the run is left; a run that fails otherwise raises its
own failure, the compaction's only logged with it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from test_orchestrator import _config, _engine, _prompts, _reward

from trio_rl.errors import CheckpointCompactionError
from trio_rl.orchestrator import open_orchestrator
from trio_rl.rollout import InMemorySource
from trio_rl.train import CheckpointConfig, read_checkpoint
from trio_rl.transport import MemorySender


def _blocked(directory: Path) -> None:
    """Every compaction of this process fails: its temporary path is a directory."""
    for s in range(64):
        (directory / f"step_{s:08d}.ckpt.{os.getpid()}.compact").mkdir(parents=True)


async def test_leaving_a_run_raises_a_compaction_failure_not_reported_yet(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    _blocked(ckpt)
    config = _config(checkpoint=CheckpointConfig(max_chain=1))
    async with MemorySender(1) as sender:
        with pytest.raises(CheckpointCompactionError) as info:
            async with open_orchestrator(
                _engine(),
                InMemorySource(_prompts(60)),
                sender,
                config=config,
                checkpoint_dir=ckpt,
                sample_reward=_reward,
            ) as orch:
                await orch.run(2)
    assert isinstance(info.value.__cause__, IsADirectoryError)
    assert Path(info.value.path).parent == ckpt
    newest = sorted(ckpt.glob("step_*.ckpt"))[-1]
    assert read_checkpoint(newest).step == 2  # every step written is readable


async def test_a_run_that_fails_raises_its_own_failure_and_logs_the_compaction(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    _blocked(ckpt)
    config = _config(checkpoint=CheckpointConfig(max_chain=1))

    async def run_and_fail() -> None:
        async with (
            MemorySender(1) as sender,
            open_orchestrator(
                _engine(),
                InMemorySource(_prompts(60)),
                sender,
                config=config,
                checkpoint_dir=ckpt,
                sample_reward=_reward,
            ) as orch,
        ):
            await orch.run(2)
            raise KeyError("the run's own failure")

    with (
        caplog.at_level(logging.ERROR, logger="trio_rl.orchestrator"),
        pytest.raises(KeyError, match="the run's own failure"),
    ):
        await run_and_fail()
    assert "closing the checkpoint manager failed too" in caplog.text
    assert "compacting this delta into a full file failed" in caplog.text
