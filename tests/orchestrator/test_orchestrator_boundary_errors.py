"""At the public ``async with`` boundaries a single failure comes out as itself, not wrapped in
the exception group of the component's nurseries (the cancelled siblings are not failures)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.errors import TransportIOError, collapse_single
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt, Sample
from trio_rl.transport import FileSender


def _reward(sample: Sample) -> float:
    return float(sample.index % 4)


async def test_a_transport_failure_leaves_open_orchestrator_as_itself(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    sender = FileSender(blocker / "run", 1)  # every batch write lands below a regular file
    config = OrchestratorConfig(
        batch_groups=1, group_size=2, max_async_level=1000, sampling=SamplingParams(max_tokens=8)
    )
    engine = SimulatedEngine(distribution="long-cot", slots=4, seed=1, seconds_per_token=1e-7)
    source = InMemorySource([Prompt(key=f"k{i}", tokens=(i, 1)) for i in range(4)])
    with trio.fail_after(60):
        with pytest.raises(TransportIOError) as info:
            async with (
                sender,
                open_orchestrator(
                    engine, source, sender, config=config, sample_reward=_reward
                ) as orch,
            ):
                await orch.run(3)
    assert not isinstance(info.value, BaseExceptionGroup)
    assert str(blocker) in str(info.value)


async def test_the_body_s_own_error_leaves_the_block_as_itself(tmp_path: Path) -> None:
    sender = FileSender(tmp_path, 1)
    engine = SimulatedEngine(distribution="long-cot", slots=4, seed=1, seconds_per_token=1e-7)
    source = InMemorySource([Prompt(key="k", tokens=(1,))])
    with trio.fail_after(60), pytest.raises(KeyError, match="mine"):
        async with sender, open_orchestrator(engine, source, sender, sample_reward=_reward):
            raise KeyError("mine")


def test_collapse_single_keeps_two_real_failures_a_group() -> None:
    with pytest.raises(BaseExceptionGroup) as info, collapse_single():
        raise BaseExceptionGroup("two", [ValueError("a"), OSError("b")])
    assert len(info.value.exceptions) == 2


def test_collapse_single_unwraps_one_failure_among_nested_groups_and_keeps_its_cause() -> None:
    cause = OSError("disk")
    failure = TransportIOError("write failed", "/x")
    failure.__cause__ = cause
    with pytest.raises(TransportIOError) as info, collapse_single():
        raise ExceptionGroup("outer", [ExceptionGroup("inner", [failure])])
    assert info.value is failure
    assert info.value.__cause__ is cause
