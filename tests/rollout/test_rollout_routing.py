"""Routing keys survive recycle and retry (miles' ``reset_for_retry`` keeps them): a group that
runs again goes back to the engines that cache its prefixes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from rollout_helpers import Puppet, prompts

from trio_rl.rollout import (
    FailurePolicy,
    GroupFactory,
    GroupRunner,
    InMemorySource,
    JsonlSource,
    SyncRolloutDriver,
    open_async_rollout,
)
from trio_rl.rollout._sync import recycled_prompt
from trio_rl.samples import Group, Sample, SampleStatus

G = 3


@attrs.frozen
class _Recording(GroupRunner):
    """A group runner that records every group (attempt) it runs, in order."""

    runs: list[Group] = attrs.field(factory=list)

    async def run(
        self, group: Group, on_sample_done: Callable[[Sample], None] | None = None
    ) -> Group:
        self.runs.append(group)
        return await super().run(group, on_sample_done)


async def test_a_recycled_straggler_keeps_its_routing_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[Group] = []
    delays = {"p0": 1, "p1": 1000}

    async def generate(sample: Sample) -> None:
        await trio.sleep(delays[sample.metadata["prompt_key"]])
        sample.status = SampleStatus.COMPLETED

    src = InMemorySource(prompts(10))
    driver = SyncRolloutDriver(
        src,
        GroupFactory(group_size=G, routing_keys=True),
        _Recording(generate, runs=seen),
        partial_rollouts=True,
        groups_per_admission=2,
        abort_timeout=5,
    )
    first = await driver.generate(1)
    assert first.statistics.recycled == 1  # p1 ignored the abort: cancelled, prompt recycled
    straggler = next(g for g in seen if g.prompt.key == "p1")
    delays.update(p1=1, p2=2)
    second = await driver.generate(1)
    (again,) = second.groups
    assert again.prompt.key == "p1"
    assert again.group_id != straggler.group_id  # a fresh group ...
    assert [s.routing_key for s in again.samples] == [s.routing_key for s in straggler.samples]
    assert all(s.routing_key for s in again.samples)  # ... on the same engines


async def test_accepted_groups_given_back_on_error_keep_their_routing_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    puppet = Puppet(auto_delay=1)
    puppet.hold(*range(G, 2 * G))

    def picky(group: Group) -> str | None:
        if group.group_index == 1:
            raise ValueError("filter bug")
        return None

    src = InMemorySource(prompts(10))
    factory = GroupFactory(group_size=G, routing_keys=True)
    driver = SyncRolloutDriver(
        src, factory, GroupRunner(puppet), groups_per_admission=2, dynamic_filter=picky
    )

    async def run() -> None:
        with pytest.raises(ValueError, match="filter bug"):
            await driver.generate(2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.sleep(5)
        by_index = sorted(puppet.started, key=lambda s: s.index)
        keys0 = [s.routing_key for s in by_index if s.group_index == 0]
        puppet.finish(*range(G, 2 * G))
    prompt = src.take()
    assert prompt.key == "p0"
    assert all(keys0)
    assert [s.routing_key for s in factory.make(prompt).samples] == keys0


async def test_a_retried_group_keeps_its_routing_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts: dict[int, list[str | None]] = {}

    async def flaky(sample: Sample) -> None:
        attempts.setdefault(sample.index, []).append(sample.routing_key)
        await trio.sleep(1)
        if len(attempts[sample.index]) == 1 and sample.index == 0:
            raise OSError("engine hiccup")
        sample.status = SampleStatus.COMPLETED

    async with open_async_rollout(
        InMemorySource(prompts(1)),
        GroupFactory(group_size=G, routing_keys=True),
        GroupRunner(flaky),
        batch_size=1,
        on_failure=FailurePolicy(action="retry", max_retries=1),
    ) as driver:
        with trio.fail_after(100):
            batch = await driver.next_batch()
    (retried,) = batch
    assert len(attempts[0]) == 2
    for sample in retried.samples:
        assert sample.routing_key is not None
        assert set(attempts[sample.index]) == {sample.routing_key}


def test_routing_keys_ride_the_recycled_prompt_through_a_saved_source(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"key": "a", "tokens": [1, 2]}\n{"key": "b", "tokens": [3]}\n')
    src = JsonlSource(path)
    factory = GroupFactory(group_size=2, routing_keys=True)
    group = factory.make(src.take())
    src.recycle(recycled_prompt(group))
    restored = JsonlSource(path)
    restored.load_state(src.state())
    again = factory.make(restored.take())
    assert [s.routing_key for s in again.samples] == [s.routing_key for s in group.samples]
    # without keys to keep, the prompt goes back unchanged
    plain = GroupFactory(group_size=2).make(restored.take())
    assert recycled_prompt(plain) is plain.prompt


async def test_the_async_driver_recycles_an_aborted_group_with_its_routing_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runs: list[Group] = []

    async def generate(sample: Sample) -> None:
        await trio.sleep(1)
        first_attempt = len(runs) == 1
        sample.completion_tokens.append(5)
        sample.loss_mask.append(True)
        sample.policy_versions.append(0)
        aborted = first_attempt and sample.index % G == 1
        sample.status = SampleStatus.ABORTED if aborted else SampleStatus.COMPLETED

    async with open_async_rollout(
        InMemorySource(prompts(1)),
        GroupFactory(group_size=G, routing_keys=True),
        _Recording(generate, runs=runs),
        batch_size=1,
        aborted="recycle",
    ) as driver:
        with trio.fail_after(100):
            (again,) = await driver.next_batch()
        assert driver.statistics().aborted_recycled == 1
    first, second = runs
    assert first.has_aborted
    assert not again.has_aborted
    assert again is second
    assert again.group_id != first.group_id
    assert again.prompt.key == first.prompt.key
    assert all(s.routing_key for s in first.samples)
    assert [s.routing_key for s in again.samples] == [s.routing_key for s in first.samples]


async def test_the_async_driver_recycles_a_stale_group_with_its_routing_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    runs: list[Group] = []
    version = [0]

    async def generate(sample: Sample) -> None:
        await trio.sleep(1)
        sample.completion_tokens.append(5)
        sample.loss_mask.append(True)
        sample.policy_versions.append(version[0])
        sample.status = SampleStatus.COMPLETED

    async with open_async_rollout(
        InMemorySource(prompts(1)),
        GroupFactory(group_size=G, routing_keys=True),
        _Recording(generate, runs=runs),
        batch_size=1,
        max_staleness=0,
        stale="recycle",
    ) as driver:
        await trio.sleep(10)  # the version-0 group has finished and waits in the buffer
        assert len(driver.buffered_groups()) == 1
        version[0] = 1
        driver.set_policy_version(1)
        with trio.fail_after(100):
            (again,) = await driver.next_batch()
        assert driver.statistics().stale_recycled == 1
    first, second = runs
    assert again is second
    assert again.group_id != first.group_id
    assert again.prompt.key == first.prompt.key
    assert again.staleness(1) == 0
    assert all(s.routing_key for s in first.samples)
    assert [s.routing_key for s in again.samples] == [s.routing_key for s in first.samples]
