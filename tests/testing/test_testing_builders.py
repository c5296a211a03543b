"""The shared test builders (tests/builders.py) build what the layers' tests rely on."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from builders import PROMPT, make_group, make_sample, pending_group, scripted_engine
from trio_rl.engines import SamplingParams
from trio_rl.rollout import GroupFailed, engine_generate, run_group
from trio_rl.samples import SampleStatus


def test_make_group_is_finished_and_unique() -> None:
    a = make_group([1.0, 0.0, 0.5], group_id="a", version=2, completion=3, prompt_len=2, env="m")
    b = make_group()
    assert a.group_id == "a"
    assert b.group_id != a.group_id
    assert [s.reward for s in a.samples] == [1.0, 0.0, 0.5]
    assert all(s.status is SampleStatus.COMPLETED for s in a.samples)
    assert all(s.prompt_tokens == (1, 2) and s.env_name == "m" for s in a.samples)
    assert all(len(s.completion_tokens) == len(s.logprobs) == 3 for s in a.samples)
    assert a.policy_version_at_start == 2
    assert all(s.policy_versions == [2] for s in a.samples)
    indices = [s.index for s in a.samples + b.samples]
    assert len(set(indices)) == len(indices)


def test_make_group_statuses_and_sample_reward() -> None:
    group = make_group([1.0, 0.0], statuses=[SampleStatus.COMPLETED, SampleStatus.ABORTED])
    assert [s.status for s in group.samples] == [SampleStatus.COMPLETED, SampleStatus.ABORTED]
    assert make_sample(0, 1.0, status=SampleStatus.PENDING).reward is None


def test_pending_group() -> None:
    group = pending_group(3, seed=42, routing_keys=True)
    assert group.prompt is PROMPT
    assert [s.status for s in group.samples] == [SampleStatus.PENDING] * 3
    assert [s.seed for s in group.samples] == [42, 43, 44]
    assert all(s.routing_key for s in group.samples)


async def test_scripted_engine_finish_reasons_versions_and_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = scripted_engine({42: "stop", 43: "length", 44: "abort"}, delay=2, version=7)
    group = pending_group(3, seed=42, routing_keys=True)
    keys = sorted(str(s.routing_key) for s in group.samples)
    start = trio.current_time()
    await run_group(group, engine_generate(engine, SamplingParams(max_tokens=9), timeout=10))
    assert trio.current_time() - start == pytest.approx(2)
    assert [s.status for s in group.samples] == [
        SampleStatus.COMPLETED,
        SampleStatus.TRUNCATED,
        SampleStatus.ABORTED,
    ]
    assert sorted(r.params.seed or 0 for r in engine.requests) == [42, 43, 44]
    assert sorted(str(r.routing_key) for r in engine.requests) == keys
    assert all(s.policy_versions == [7] and len(s.completion_tokens) == 2 for s in group.samples)


async def test_scripted_engine_delay_meets_a_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(GroupFailed) as info:
        await run_group(pending_group(1), engine_generate(scripted_engine(delay=100), timeout=5))
    assert isinstance(info.value.__cause__, trio.TooSlowError)
