"""One policy-version cell: created by whoever opens the pipeline, shared by every reader."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from builders import WatchedCell, scripted_engine
from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.errors import PolicyVersionError
from trio_rl.learn import watch_weights
from trio_rl.learn._weights import publish_weights
from trio_rl.orchestrator import OrchestratorConfig, open_orchestrator
from trio_rl.policy import PolicyVersionCell
from trio_rl.rollout import InMemorySource
from trio_rl.samples import Prompt, Sample
from trio_rl.sink import SinkConfig
from trio_rl.transport import MemorySender


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(key=f"k{i}", tokens=(i, 1, 7)) for i in range(n)]


def _reward(sample: Sample) -> float:
    return float(sample.index % 2)  # distinct within a group: nothing is pruned


def _config() -> OrchestratorConfig:
    return OrchestratorConfig(
        batch_groups=2,
        group_size=2,
        max_async_level=0,
        sink=SinkConfig(batch_size=4, max_off_policy_steps=None),
        sampling=SamplingParams(max_tokens=16),
        seed=1,
    )


async def test_the_cell_only_grows_and_wakes_waiters_at_their_floor() -> None:
    cell = PolicyVersionCell(2)
    woke: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []
    cell.on_advance(lambda old, new: seen.append((old, new)))

    async def waiter(floor: int) -> None:
        woke.append((floor, await cell.wait_at_least(floor)))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, 3)
            nursery.start_soon(waiter, 5)
            await trio.testing.wait_all_tasks_blocked()
            assert cell.advance(3) is True
            assert cell.advance(3) is False  # the same version is a no-op
            await trio.testing.wait_all_tasks_blocked()
            assert woke == [(3, 3)]
            cell.advance(6)
    assert woke == [(3, 3), (5, 6)]
    assert seen == [(2, 3), (3, 6)]
    with pytest.raises(PolicyVersionError, match="cannot go back from 6 to 4"):
        cell.advance(4)
    with pytest.raises(PolicyVersionError):
        PolicyVersionCell(-1)
    assert cell.value == 6
    assert await cell.wait_at_least(1) == 6


async def test_orchestrator_driver_and_engine_share_one_cell() -> None:
    engine = SimulatedEngine(distribution="long-cot", slots=8, seed=3, seconds_per_token=1e-7)
    sender = MemorySender(1)
    with trio.fail_after(20):
        async with open_orchestrator(
            engine,
            InMemorySource(_prompts(40)),
            sender,
            config=_config(),
            sample_reward=_reward,
            version=engine.version,
        ) as orch:
            assert orch.version is engine.version
            assert orch.driver.version is engine.version
            await orch.run(1)
            # The trainer's report reaches the engine and the driver with no hook in between.
            orch.set_policy_version(4)
            assert engine.policy_version == 4
            assert orch.driver.policy_version == 4
            # An engine-side advance is the run's version too (one cell, not four copies).
            engine.set_policy_version(5)
            assert orch.policy_version == 5
            with pytest.raises(ValueError, match="cannot go back"):
                orch.driver.set_policy_version(3)
            await orch.run(1)
            assert orch.step == 3


async def test_the_ship_gate_waits_on_the_cell(mock_clock: trio.testing.MockClock) -> None:
    # Virtual time that moves only when told: the gate is seen parked on the cell, not slept for.
    cell = WatchedCell()
    async with open_orchestrator(
        scripted_engine(delay=0.0, version=0),
        InMemorySource(_prompts(40)),
        MemorySender(1),
        config=_config(),
        sample_reward=_reward,
        version=cell,
    ) as orch:
        assert orch.version is cell
        await orch.run(1)
        async with trio.open_nursery() as nursery:
            await cell.start_held(nursery, functools.partial(orch.run, 1))
            assert cell.floors == [1]
            assert orch.step == 2, "batch 2 waits for version 1"
            orch.version.advance(1)  # advancing the shared cell opens the gate
        assert orch.step == 3
    assert trio.current_time() == 0.0  # nothing slept


class _Loader:
    def __init__(self) -> None:
        self.loaded: list[int] = []

    async def load_weights(self, path: str | os.PathLike[str], version: int) -> None:
        self.loaded.append(version)


async def test_the_weight_watcher_advances_the_shared_cell(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    cell = PolicyVersionCell(0)
    loader = _Loader()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(watch_weights, root, [loader], cell, poll_interval=0.005)
            )
            publish_weights(root, 2, {"w": torch.zeros(2)})
            assert await cell.wait_at_least(2) == 2
            nursery.cancel_scope.cancel()
    assert loader.loaded == [2]
