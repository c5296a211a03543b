"""The priority lane: an eval shares the training driver's credits, goes first, never trains."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from evals_helpers import Recording, held_out, success_reward

from trio_rl.engines import SamplingParams, SimulatedEngine
from trio_rl.evals import EvalRunner
from trio_rl.rollout import (
    CreditView,
    GroupFactory,
    GroupGranularity,
    GroupRunner,
    InMemorySource,
    PriorityLane,
    RolloutConfigError,
    SampleBackfill,
    SubmissionPolicy,
    engine_generate,
    open_async_rollout,
)
from trio_rl.samples import Prompt

B, G, K = 4, 4, 4


def training_source(n: int) -> InMemorySource:
    return InMemorySource([Prompt(key=f"t{i}", tokens=(3, i)) for i in range(n)])


@pytest.mark.parametrize("policy", [SampleBackfill(), GroupGranularity()], ids=["sample", "group"])
async def test_an_eval_goes_first_within_the_drivers_budget_and_never_reaches_training(
    autojump_clock: trio.testing.MockClock, policy: SubmissionPolicy
) -> None:
    engine = Recording(SimulatedEngine(seed=1, slots=1024))
    params = SamplingParams(max_tokens=8)
    lane = PriorityLane()
    taken: list[str] = []
    async with open_async_rollout(
        training_source(10_000),
        GroupFactory(G, seed=0),
        GroupRunner(engine_generate(engine, params)),
        batch_size=2,
        policy=policy,
        max_groups_in_flight=B,
        buffer_capacity=10_000,
    ) as driver:
        with lane.attach(driver.scheduler, B):
            await trio.sleep(5.0)  # training is under way: its budget is in use
            assert engine.in_flight > 0
            runner = EvalRunner(
                generate=engine_generate(engine, params),
                reward=success_reward(0.5),
                k=K,
                lane=lane,
            )
            result = await runner.run(held_out(30), step=0)
            stats = lane.statistics()
        for _ in range(20):
            taken.extend(g.prompt.key for g in await driver.next_batch())
    assert result.status == "done"
    assert result.prompts == 30
    assert result.samples == 30 * K
    assert (stats.held, stats.groups, stats.waiting, stats.granted) == (0, 0, 0, 30)
    # the engines never saw more than the budget: B x G credits, shared
    assert engine.peak <= B * G
    # first: from the eval's first request to its last, no training request started
    # (only groups admitted before it, at its first instant)
    eval_times = [t for t, lane_name in engine.starts if lane_name == "eval"]
    first, last = eval_times[0], eval_times[-1]
    assert not [t for t, name in engine.starts if name == "train" and first < t < last]
    assert stats.refused > 0  # the driver asked while the eval waited, and was told no
    # never trained on: every group the consumer took is a training prompt
    assert taken
    assert all(key.startswith("t") for key in taken)


async def test_a_detached_lane_is_a_plain_limit_and_a_cancelled_request_holds_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lane = PriorityLane(limit=8)
    await lane.acquire(8)
    with trio.move_on_after(1.0):
        await lane.acquire(4)  # waits: the limit is held
    assert lane.statistics().waiting == 0
    assert lane.held == 8
    lane.release(8)
    await lane.acquire(20)  # nothing else holds credits: any size fits
    lane.release(20)
    assert (lane.held, lane.groups) == (0, 0)


async def test_a_lane_is_attached_to_one_scheduler_at_a_time() -> None:
    async with open_async_rollout(
        training_source(1),
        GroupFactory(G),
        GroupRunner(engine_generate(SimulatedEngine())),
        batch_size=1,
    ) as driver:
        lane, other = PriorityLane(), PriorityLane()
        with (
            lane.attach(driver.scheduler),
            pytest.raises(RolloutConfigError, match="one scheduler at a time"),
        ):
            other.attach(driver.scheduler).__enter__()
        assert isinstance(driver.scheduler.policy, SampleBackfill)  # the lane's wrapper is gone


def test_the_lane_counts_its_credits_in_the_drivers_view() -> None:
    lane = PriorityLane()
    view = CreditView(in_flight=4, pending_groups=1, group_size=4, budget=2)
    assert lane.decide(view) == view  # nothing held: unchanged
    lane.held, lane.groups = 4, 1
    seen = lane.decide(view)
    assert seen is not None
    assert (seen.in_flight, seen.pending_groups) == (8, 2)
    assert not SampleBackfill().admits(seen)


async def test_an_eval_gets_credits_while_the_driver_is_paused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A paused driver makes no decision; the lane looks at its ledger itself."""
    engine = Recording(SimulatedEngine(seed=2, slots=1024))
    params = SamplingParams(max_tokens=8)
    lane = PriorityLane(recheck=0.5)
    async with open_async_rollout(
        training_source(10_000),
        GroupFactory(G, seed=0),
        GroupRunner(engine_generate(engine, params)),
        batch_size=2,
        max_groups_in_flight=B,
        buffer_capacity=10_000,
    ) as driver:
        with lane.attach(driver.scheduler, B):
            await trio.sleep(5.0)
            async with driver.paused():
                runner = EvalRunner(
                    generate=engine_generate(engine, params), reward=lambda s: 1.0, k=K, lane=lane
                )
                result = await runner.run(held_out(12), step=0, deadline=600.0)
    assert result.status == "done"
    assert result.prompts == 12
    assert engine.peak <= B * G
