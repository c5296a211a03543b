"""Bad rollout settings are refused at once; a run that only fails ends with one clear error;
a seeded simulated run is reproducible."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple, Unpack

import pytest
import trio
import trio.testing
from rollout_helpers import prompts

from trio_rl.engines import SamplingParams, SimulatedEngine, SimulatedEngineError
from trio_rl.errors import InvalidArgumentError
from trio_rl.rollout import (
    DriverFailedError,
    FailureBudgetExceededError,
    FailurePolicy,
    GroupFactory,
    GroupFailedError,
    GroupGranularity,
    GroupRunner,
    InMemorySource,
    SyncRolloutDriver,
    engine_generate,
    open_async_rollout,
)

T = TypeVar("T")
Args = TypeVarTuple("Args")


def _run(fn: Callable[[Unpack[Args]], Awaitable[T]], *args: *Args) -> T:
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FailurePolicy("explode"), "FailurePolicy.action must be one of"),  # type: ignore[arg-type]
        (lambda: FailurePolicy(max_retries=-1), "FailurePolicy.max_retries must be an int >= 0"),
        (lambda: FailurePolicy(max_consecutive_failures=0), "max_consecutive_failures"),
        (lambda: GroupFactory(0), "GroupFactory.group_size must be an int >= 1, got 0"),
        (lambda: GroupFactory(2, seed=1.5), "GroupFactory.seed must be an int or None"),  # type: ignore[arg-type]
        (lambda: InMemorySource(prompts(2), epochs=0), "InMemorySource.epochs must be an int"),
        (
            lambda: GroupRunner(engine_generate(SimulatedEngine()), sample_timeout=0),
            "sample_timeout",
        ),
        (lambda: engine_generate(SimulatedEngine(), timeout=-1.0), "engine_generate.timeout"),
    ],
)
def test_bad_settings_are_refused(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError, match=match):
        make()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "open_async_rollout.batch_size must be an int >= 1, got 0"),
        ({"batch_size": 2, "buffer_capacity": 0}, "open_async_rollout.buffer_capacity"),
        ({"batch_size": 2, "max_staleness": -1}, "open_async_rollout.max_staleness"),
        ({"batch_size": 2, "stale": "keep"}, "open_async_rollout.stale must be one of"),
        ({"batch_size": 2, "max_groups_in_flight": 0}, "max_groups_in_flight"),
    ],
)
def test_bad_async_driver_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    async def main() -> None:
        runner = GroupRunner(engine_generate(SimulatedEngine()))
        with pytest.raises(InvalidArgumentError, match=match):
            async with open_async_rollout(
                InMemorySource(prompts(4)),
                GroupFactory(2),
                runner,
                **kwargs,  # type: ignore[arg-type]
            ):
                pass  # pragma: no cover

    _run(main)


def test_sync_driver_settings_are_refused() -> None:
    runner = GroupRunner(engine_generate(SimulatedEngine()))
    with pytest.raises(InvalidArgumentError, match=r"SyncRolloutDriver\.max_failures"):
        SyncRolloutDriver(InMemorySource(prompts(2)), GroupFactory(2), runner, max_failures=-1)


@pytest.mark.parametrize("action", ["skip", "retry"])
def test_an_always_failing_engine_ends_the_async_run(
    action: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request fails: the run ends after the budget with one error, not a flood."""
    engine = SimulatedEngine(slots=8, failure_rate=1.0)

    async def main() -> int:
        async with open_async_rollout(
            InMemorySource(prompts(5), epochs=None),
            GroupFactory(2, seed=0),
            GroupRunner(engine_generate(engine)),
            batch_size=2,
            on_failure=FailurePolicy(action, max_consecutive_failures=20),  # type: ignore[arg-type]
        ) as driver:
            with trio.fail_after(3600), pytest.raises(DriverFailedError) as info:
                await driver.next_batch()
            budget = info.value.__cause__
            assert isinstance(budget, FailureBudgetExceededError)
            assert "20 group attempts in a row failed" in str(budget)
            assert isinstance(budget.__cause__, GroupFailedError)
            assert isinstance(budget.__cause__.__cause__, SimulatedEngineError)
            with pytest.raises(DriverFailedError):  # and again on every later call
                await driver.next_batch()
        return engine.statistics().requests_failed

    with caplog.at_level(logging.WARNING, logger="trio_rl.rollout"):
        failed = _run(main)
    assert 20 <= failed <= 20 + 2  # the budget, plus groups still running when it ran out
    assert len(caplog.records) <= 20 + 1  # one line per failed attempt, one for the worker


def test_a_run_with_sporadic_failures_is_not_ended_by_the_budget() -> None:
    engine = SimulatedEngine(slots=16, failure_rate=0.05, seed=1)

    async def main() -> int:
        async with open_async_rollout(
            InMemorySource(prompts(50), epochs=None),
            GroupFactory(2, seed=0),
            GroupRunner(engine_generate(engine)),
            batch_size=4,
            on_failure=FailurePolicy("skip", max_consecutive_failures=5),
        ) as driver:
            for _ in range(30):
                assert len(await driver.next_batch()) == 4
        return engine.statistics().requests_failed

    logging.disable(logging.ERROR)
    try:
        failed = _run(main)
    finally:
        logging.disable(logging.NOTSET)
    assert failed > 5  # more failures in total than the budget


def test_an_always_failing_engine_ends_a_sync_batch_by_default() -> None:
    engine = SimulatedEngine(slots=8, failure_rate=1.0)
    driver = SyncRolloutDriver(
        InMemorySource(prompts(5), epochs=None),
        GroupFactory(2),
        GroupRunner(engine_generate(engine)),
    )

    async def main() -> None:
        with trio.fail_after(3600), pytest.raises(FailureBudgetExceededError) as info:
            await driver.generate(2)
        assert "max_failures=100" in str(info.value)
        assert isinstance(info.value.__cause__, GroupFailedError)

    logging.disable(logging.ERROR)
    try:
        _run(main)
    finally:
        logging.disable(logging.NOTSET)


# ------------------------------------------------------------------ determinism


# One step's groups: (prompt key, first sample index, each sample's completion tokens).
Batch = list[tuple[str, int, list[tuple[int, ...]]]]


def _seeded_run(slots: int) -> tuple[list[Batch], int, int, float]:
    """Five steps' batches, requests started and done, the virtual time at the end."""

    async def main() -> tuple[list[Batch], int, int, float]:
        engine = SimulatedEngine("long-cot", slots=slots, seed=0)
        batches: list[Batch] = []
        async with open_async_rollout(
            InMemorySource(prompts(3), epochs=None),  # prompts repeat while in flight
            GroupFactory(4, seed=0),
            GroupRunner(engine_generate(engine, SamplingParams(max_tokens=6000))),
            batch_size=4,
            max_groups_in_flight=6,
            policy=GroupGranularity(),  # see docs/engines.md on SampleBackfill wake-ups
        ) as driver:
            for step in range(5):
                batch = await driver.next_batch()
                batches.append(
                    [
                        (
                            g.prompt.key,
                            g.first_index,
                            [tuple(x.completion_tokens) for x in g.samples],
                        )
                        for g in batch
                    ]
                )
                driver.set_policy_version(step + 1)
        stats = engine.statistics()
        return batches, stats.requests_started, stats.requests_done, trio.current_time()

    return _run(main)


def test_what_a_sample_gets_does_not_depend_on_scheduling() -> None:
    """Each sample's draws are keyed by its index: the same group (by first sample index)
    gets the same tokens in every run, even with prompts repeating while in flight and trio
    running the tasks of one scheduling batch in a deliberately varying order."""
    contents: dict[int, object] = {}
    for _ in range(6):
        batches, started, *_ = _seeded_run(slots=100)
        assert started > 0
        for batch in batches:
            for key, first, tokens in batch:
                assert contents.setdefault(first, (key, tokens)) == (key, tokens)
