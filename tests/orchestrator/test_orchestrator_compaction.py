"""A checkpoint compaction that failed and was not reported by a write (fewer failures than
``COMPACTION_ATTEMPTS``) is raised when the run is left; a run that fails otherwise raises its
own failure, the compaction's only logged with it."""

from __future__ import annotations

import logging
import os
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from test_orchestrator import _config, _engine, _prompts, _reward

from trio_rl.errors import CheckpointCompactionError
from trio_rl.orchestrator import Orchestrator, open_orchestrator
from trio_rl.rollout import InMemorySource
from trio_rl.sink import CheckpointConfig, read_checkpoint
from trio_rl.transport import MemorySender


def _blocked(directory: Path) -> None:
    """Every compaction of this process fails: its temporary path is a directory."""
    for s in range(64):
        (directory / f"step_{s:08d}.ckpt.{os.getpid()}.compact").mkdir(parents=True)


def _opened(sender: MemorySender, ckpt: Path) -> AbstractAsyncContextManager[Orchestrator]:
    """An orchestrator checkpointing into ``ckpt``, compacting after every delta."""
    return open_orchestrator(
        _engine(),
        InMemorySource(_prompts(60)),
        sender,
        config=_config(checkpoint=CheckpointConfig(max_chain=1)),
        checkpoint_dir=ckpt,
        sample_reward=_reward,
    )


async def test_leaving_a_run_raises_a_compaction_failure_not_reported_yet(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    _blocked(ckpt)
    async with MemorySender(1) as sender:
        with pytest.raises(CheckpointCompactionError) as info:
            async with _opened(sender, ckpt) as orch:
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

    async def run_and_fail() -> None:
        async with (
            MemorySender(1) as sender,
            _opened(sender, ckpt) as orch,
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
