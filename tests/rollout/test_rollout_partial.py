"""Partial rollouts in the sync driver: aborted leftovers keep their work and continue.

Reference: miles' sync driver aborts the engines once it has T groups; the engines return what
they generated so far, the partial groups (stamped with the rollout they started in) and any
group that finished during the abort go back to the buffer, and the next step continues them.
"""

from __future__ import annotations

import trio
import trio.testing
from rollout_helpers import prompts, source

from trio_rl.engines import LogNormalTokens, SamplingParams, SimulatedEngine
from trio_rl.rollout import (
    GroupFactory,
    GroupRunner,
    InMemorySource,
    SyncRolloutDriver,
    engine_generate,
)
from trio_rl.rollout._group import current_abort
from trio_rl.samples import Group, Sample, SampleStatus

G = 2


def simulated_driver(
    engine: SimulatedEngine, src: InMemorySource, **kwargs: object
) -> SyncRolloutDriver:
    runner = GroupRunner(engine_generate(engine, SamplingParams(max_tokens=100_000)))
    return SyncRolloutDriver(
        src,
        GroupFactory(group_size=G, seed=7),
        runner,
        partial_rollouts=True,
        **kwargs,  # type: ignore[arg-type]
    )


async def test_aborted_leftovers_keep_their_tokens_and_continue_next_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # wide length spread: by the time two groups finish, the others are part-way through
    engine = SimulatedEngine(LogNormalTokens(median=300, sigma=1.5), slots=64, seed=3)
    driver = simulated_driver(engine, source(100), groups_per_admission=8)
    first = await driver.generate(2, policy_version=0)
    stats = first.statistics
    assert stats.partial >= 1
    assert stats.cancelled == 0
    assert stats.recycled == 0
    held = {g.group_id: g for g in driver.held_groups()}
    assert len(held) == stats.partial + stats.surplus
    partial_samples = [
        s for g in held.values() for s in g.samples if s.status is SampleStatus.ABORTED
    ]
    with_tokens = [s for s in partial_samples if s.completion_tokens]
    assert with_tokens, "an abort mid-decode returns the tokens generated so far"
    kept = {
        s.index: (list(s.completion_tokens), list(s.logprobs), list(s.policy_versions))
        for s in with_tokens
    }
    for s in with_tokens:
        assert s.metadata["start_rollout_id"] == 0
        assert s.policy_versions == [0]
        assert len(s.logprobs) == len(s.loss_mask) == len(s.completion_tokens)

    engine.set_policy_version(1)
    finished: dict[int, Sample] = {}
    groups_back: dict[str, Group] = {}
    for _call in range(10):
        batch = await driver.generate(4, policy_version=1)
        for group in batch.groups:
            groups_back[group.group_id] = group
            finished.update((s.index, s) for s in group.samples if s.index in kept)
        if len(finished) == len(kept):
            break
    assert set(finished) == set(kept)
    for index, (tokens, logprobs, versions) in kept.items():
        sample = finished[index]
        assert sample.status.is_finished
        # the partial span is kept as it was; the continuation follows it on the new version
        assert sample.completion_tokens[: len(tokens)] == tokens
        assert sample.logprobs[: len(logprobs)] == logprobs
        assert len(sample.completion_tokens) > len(tokens)
        assert sample.policy_versions[: len(versions)] == versions
        assert sample.policy_versions[-1] == 1
        assert len(sample.logprobs) == len(sample.loss_mask) == len(sample.completion_tokens)
    for group_id in held:
        if group_id in groups_back:
            assert groups_back[group_id].policy_version_at_start == 0  # stamped at its start


async def test_continuation_requests_carry_prompt_plus_partial_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = SimulatedEngine(LogNormalTokens(median=300, sigma=1.5), slots=64, seed=3)
    seen: list[tuple[int, tuple[int, ...], int]] = []
    inner = engine_generate(engine, SamplingParams(max_tokens=100_000))

    async def recording(sample: Sample) -> None:
        before = len(sample.completion_tokens)
        if before:
            seen.append(
                (sample.index, sample.prompt_tokens + tuple(sample.completion_tokens), before)
            )
        await inner(sample)

    driver = SyncRolloutDriver(
        source(100),
        GroupFactory(group_size=G, seed=7),
        GroupRunner(recording),
        partial_rollouts=True,
        groups_per_admission=8,
    )
    await driver.generate(2)
    partial = {
        s.index: s.prompt_tokens + tuple(s.completion_tokens)
        for g in driver.held_groups()
        for s in g.samples
        if s.completion_tokens and s.status is SampleStatus.ABORTED
    }
    assert partial
    await driver.generate(2)
    continued = {index: prefix for index, prefix, _ in seen}
    assert continued == partial


async def test_group_finishing_during_the_abort_is_kept_not_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Group 0 fills the batch; group 1 ignores the abort and finishes in the window; group 2
    stops. Both are kept, and the next call returns group 1 and continues group 2."""
    starts: dict[int, int] = {}

    async def generate(sample: Sample) -> None:
        starts[sample.index] = starts.get(sample.index, 0) + 1
        if sample.group_index == 0:
            await trio.sleep(1)
        elif sample.group_index == 1:
            await trio.sleep(5)  # ignores the abort: finishes during the window
        else:
            abort = current_abort()
            assert abort is not None
            with abort.scope() as stop:
                await trio.sleep(100 if not sample.completion_tokens else 1)
            if stop.cancelled_caught:
                sample.completion_tokens.append(1)
                sample.logprobs.append(-1.0)
                sample.loss_mask.append(True)
                sample.policy_versions.append(0)
                sample.status = SampleStatus.ABORTED
                return
        sample.completion_tokens.append(2)
        sample.logprobs.append(-2.0)
        sample.loss_mask.append(True)
        sample.policy_versions.append(0)
        sample.status = SampleStatus.COMPLETED

    src = source(10)
    driver = SyncRolloutDriver(
        src,
        GroupFactory(group_size=G),
        GroupRunner(generate),
        partial_rollouts=True,
        groups_per_admission=3,
    )
    first = await driver.generate(1)
    assert [g.group_index for g in first.groups] == [0]
    assert first.statistics.surplus == 1
    assert first.statistics.partial == 1
    assert first.statistics.cancelled == 0
    assert [g.group_index for g in driver.held_groups()] == [1, 2]

    # a call cancelled part-way takes nothing away from what is kept
    with trio.move_on_after(0.5):
        await driver.generate(2)
    assert [g.group_index for g in driver.held_groups()] == [1, 2]
    held2 = driver.held_groups()[1]
    assert [s.status for s in held2.samples] == [SampleStatus.ABORTED] * G
    assert [s.completion_tokens for s in held2.samples] == [[1], [1]]

    second = await driver.generate(2)
    assert [g.group_index for g in second.groups] == [1, 2]
    assert second.statistics.carried_in == 1
    # one admission of O=3: the partial group first (continued), then two new prompts
    assert second.statistics.submitted == 3
    group2 = second.groups[1]
    assert [s.completion_tokens for s in group2.samples] == [[1, 2], [1, 2]]
    assert all(starts[s.index] == 3 for s in group2.samples)  # the cancelled call started it too
    assert src.take().key == "p7"  # no prompt went back to the source


async def test_surplus_of_the_main_loop_is_kept_for_the_next_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def generate(sample: Sample) -> None:
        await trio.sleep(1)
        sample.completion_tokens.append(1)
        sample.logprobs.append(-1.0)
        sample.loss_mask.append(True)
        sample.policy_versions.append(0)
        sample.status = SampleStatus.COMPLETED

    driver = SyncRolloutDriver(
        source(10),
        GroupFactory(group_size=G),
        GroupRunner(generate),
        partial_rollouts=True,
        groups_per_admission=3,
    )
    first = await driver.generate(1)
    assert first.statistics.surplus == 2  # three finished in one wakeup
    second = await driver.generate(2)
    got = [g.group_index for g in (*first.groups, *second.groups)]
    assert sorted(got) == [0, 1, 2]
    assert second.statistics.carried_in == 2
    assert second.statistics.submitted == 0
    assert not driver.held_groups()


async def test_a_generate_function_that_ignores_the_abort_is_cancelled_after_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def generate(sample: Sample) -> None:
        await trio.sleep(1 if sample.group_index == 0 else 1000)
        sample.status = SampleStatus.COMPLETED

    src = InMemorySource(prompts(10))
    driver = SyncRolloutDriver(
        src,
        GroupFactory(group_size=G),
        GroupRunner(generate),
        partial_rollouts=True,
        groups_per_admission=2,
        abort_timeout=10,
    )
    start = trio.current_time()
    batch = await driver.generate(1)
    assert trio.current_time() - start == 11  # 1 s of work, then the 10 s abort window
    assert batch.statistics.cancelled == 1
    assert batch.statistics.recycled == 1
    assert src.take().key == "p1"
