"""Records and record rewards: the JSONL reader names the bad line, a reward is imported from
the working directory, and `RecordReward` runs a plain reward in a worker thread under the
run's limiter or in killable worker processes of its own (`open_record_reward`), awaits an
async one, fails only the sample of a reward that raises or hangs, and stops the block once a
failure budget of samples failed in a row."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_rl.errors import RewardFailuresError
from trio_rl.rollout import (
    CreditScheduler,
    DataSourceError,
    GroupRunner,
    GroupStatus,
    RecordReward,
    RolloutConfigError,
    SampleBackfill,
    import_reward,
    open_record_reward,
    read_records,
    run_reporting,
)
from trio_rl.samples import Group, Prompt, Sample, SampleStatus


def _sample(label: Any, tokens: list[int], index: int = 0) -> Sample:
    s = Sample(index=index, group_index=0, prompt_tokens=(1,), label=label)
    s.completion_tokens.extend(tokens)
    s.logprobs.extend([0.0] * len(tokens))
    s.loss_mask.extend([True] * len(tokens))
    s.status = SampleStatus.COMPLETED
    return s


def _decode(tokens: Any) -> str:
    return "".join(chr(ord("a") + t) for t in tokens)


def test_records_are_read_with_every_field(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"prompt": "x", "answer": 1})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "id": "q2"})
        + "\n"
    )
    assert read_records(path) == [
        {"prompt": "x", "answer": 1},
        {"messages": [{"role": "user", "content": "hi"}], "id": "q2"},
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x",', ":2: not valid JSON: Expecting property name"),
        ("[1, 2]", ":2: expected a JSON object, got list"),
        ('{"answer": 3}', ':2: a record needs "prompt" (text) or "messages" (a chat)'),
        ('{"prompt": 3}', ':2: "prompt" must be a string'),
        ('{"messages": [{"role": "user"}]}', ':2: "messages" must be a non-empty list'),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DataSourceError) as caught:
        read_records(path)
    assert str(caught.value).startswith(f"{path}{message}"), str(caught.value)


def test_an_empty_or_missing_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataSourceError, match="no records"):
        read_records(tmp_path / "empty.jsonl")
    with pytest.raises(DataSourceError, match="cannot read"):
        read_records(tmp_path / "missing.jsonl")


def test_a_reward_is_imported_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_reward_mod.py").write_text("def score(record, completion):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    fn = import_reward("my_reward_mod:score")
    assert fn({}, "") == 0.5
    assert str(tmp_path) not in __import__("sys").path  # the path is not left behind
    with pytest.raises(RolloutConfigError, match="cannot import module 'no_such_mod'"):
        import_reward("no_such_mod:score")
    with pytest.raises(RolloutConfigError, match="has no 'nope'"):
        import_reward("my_reward_mod:nope")
    with pytest.raises(RolloutConfigError, match=r'expected "package.module:name"'):
        import_reward("my_reward_mod")


async def test_a_plain_reward_runs_in_a_worker_thread_under_the_limiter() -> None:
    limiter = trio.CapacityLimiter(2)
    seen: list[tuple[Mapping[str, Any], str, bool, int]] = []

    def score(record: Mapping[str, Any], completion: str) -> float:
        on_loop = threading.current_thread() is threading.main_thread()
        seen.append((record, completion, on_loop, limiter.borrowed_tokens))
        return 0.25

    reward = RecordReward(score, _decode, limiter=limiter)
    sample = _sample({"prompt": "p", "answer": "ab"}, [0, 1])
    assert await reward(sample) == 0.25
    assert seen == [({"prompt": "p", "answer": "ab"}, "ab", False, 1)]
    assert sample.status is SampleStatus.COMPLETED
    assert reward.failed == 0


async def test_an_async_reward_is_awaited_on_the_loop() -> None:
    async def score(record: Mapping[str, Any], completion: str) -> float:
        await trio.lowlevel.checkpoint()
        assert threading.current_thread() is threading.main_thread()
        return float(len(completion))

    reward = RecordReward(score, _decode)
    assert await reward(_sample({"prompt": "p"}, [0, 1, 2])) == 3.0


async def test_a_reward_that_raises_fails_its_sample_only_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def score(record: Mapping[str, Any], completion: str) -> float:
        if record.get("bad"):
            raise KeyError("answer")
        if record.get("nan"):
            return float("nan")
        return 1.0

    reward = RecordReward(score, _decode, name="reward t:score", log_first=2)
    good = _sample({"prompt": "p"}, [0])
    bad = [_sample({"prompt": "p", "bad": True}, [0], index=i) for i in (1, 2, 3)]
    nan = _sample({"prompt": "p", "nan": True}, [0], index=4)
    assert await reward(good) == 1.0
    for s in [*bad, nan]:
        assert await reward(s) == 0.0
        assert s.status is SampleStatus.FAILED
    assert good.status is SampleStatus.COMPLETED
    assert reward.failed == 4
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # the first two, then only counted
    assert messages[0].startswith(
        'reward t:score failed sample 1 on record {"prompt": "p", "bad": true}: '
        "KeyError: 'answer'; the sample is failed"
    )
    assert messages[1].endswith("further failures are only counted")


async def test_a_slow_reward_times_out_and_fails_its_sample() -> None:
    release = threading.Event()

    def slow(record: Mapping[str, Any], completion: str) -> float:
        release.wait(30)
        return 1.0

    reward = RecordReward(slow, _decode, timeout=0.2)
    sample = _sample({"prompt": "p"}, [0])
    try:
        assert await reward(sample) == 0.0
    finally:
        release.set()
    assert sample.status is SampleStatus.FAILED
    assert reward.failed == 1


async def test_cancellation_propagates_through_an_async_reward() -> None:
    async def forever(record: Mapping[str, Any], completion: str) -> float:
        await trio.sleep_forever()
        raise AssertionError

    reward = RecordReward(forever, _decode, timeout=None)
    sample = _sample({"prompt": "p"}, [0])
    with trio.move_on_after(0.05) as scope:
        await reward(sample)
    assert scope.cancelled_caught
    assert sample.status is SampleStatus.COMPLETED
    assert reward.failed == 0


USER_REWARDS = """
import time

def score(record, completion):
    if record.get("hang"):
        time.sleep(3600)
    return float(len(completion))

def misspelled(record, completion):
    return float(record["answr"] == completion)
"""


@pytest.fixture
def rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A user's reward module on sys.path (worker processes import it again)."""
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return __import__(name)


async def test_a_hung_reward_is_killed_and_fails_its_sample_only(rewards: Any) -> None:
    async with open_record_reward(
        rewards.score, _decode, workers=2, call_timeout=0.5, name="reward u:score"
    ) as reward:
        hung = _sample({"id": "r3", "hang": True}, [0])
        fine = [_sample({"id": f"r{i}"}, [0, 1], index=i) for i in range(1, 4)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reward, hung)
            for s in fine:  # served by the other worker meanwhile
                assert await reward(s) == 2.0
        assert hung.status is SampleStatus.FAILED
        assert reward.failed == 1
        assert reward.pool is not None
        assert len(reward.pool.processes) <= 2


async def test_a_reward_failing_a_budget_of_samples_in_a_row_stops_the_block(
    rewards: Any,
) -> None:
    seen: list[RecordReward] = []

    async def score_until_stopped() -> None:
        async with open_record_reward(
            rewards.misspelled, _decode, workers=1, failure_budget=3, name="reward u:misspelled"
        ) as reward:
            seen.append(reward)
            for i in range(10):
                await reward(_sample({"id": f"r{i}", "answer": "a"}, [0]))
            raise AssertionError("the budget did not stop the block")

    with pytest.raises(RewardFailuresError) as caught:
        await score_until_stopped()
    (reward,) = seen
    assert reward.failed == 3
    message = str(caught.value)
    assert message.startswith(
        "reward u:misspelled failed on 3 samples in a row (the failure budget: 3); the first: "
        "KeyError: 'answr' (user_rewards_"
    )
    assert message.endswith(" in misspelled) on record id 'r0'; nothing can train: fix the reward")


async def test_a_success_restarts_the_count_of_failures_in_a_row() -> None:
    def flaky(record: Mapping[str, Any], completion: str) -> float:
        if record["ok"]:
            return 1.0
        raise ValueError("no")

    async with open_record_reward(flaky, _decode, mode="thread", failure_budget=3) as reward:
        for ok in (False, False, True, False, False, True, False, False):
            await reward(_sample({"ok": ok}, [0]))
        assert reward.failed == 6
        assert reward.failed_in_a_row == 2
        assert not reward.budget_spent.is_set()


def _hanging_group(size: int) -> Group:
    """A group whose record makes the reward hang."""
    record = {"id": "r3", "hang": True}
    samples = [
        Sample(index=i, group_index=0, prompt_tokens=(1,), label=record) for i in range(size)
    ]
    return Group(group_id="g", prompt=Prompt(key="g", tokens=(1,), label=record), samples=samples)


async def _generate(sample: Sample) -> None:
    sample.completion_tokens.extend([0, 1])
    sample.logprobs.extend([0.0, 0.0])
    sample.loss_mask.extend([True, True])
    sample.status = SampleStatus.COMPLETED


async def test_a_reward_call_in_a_worker_holds_no_credit_one_waiting_for_a_worker_does(
    rewards: Any,
) -> None:
    # Two samples of a record the reward hangs on, one worker: the call that has the worker
    # gave its sample's credit back when it started (it may hang until its timeout: the
    # rollout budget goes on without it); the call waiting for the busy worker keeps its own
    # (a saturated pool holds the rollout back). The group stays pending until it ends, and
    # every credit comes back exactly once.
    scheduler = CreditScheduler(SampleBackfill(), group_size=2)
    group = _hanging_group(2)
    async with open_record_reward(rewards.score, _decode, workers=1, call_timeout=None) as reward:
        assert reward.pool is not None
        runner = GroupRunner(_generate, sample_reward=reward)
        scheduler.submitted(group.group_id, credits=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_reporting, runner, group, scheduler)
            with trio.fail_after(60):
                while reward.pool.running < 1:  # noqa: ASYNC110 - the pool signals no event
                    await trio.sleep(0.01)
            assert scheduler.poll() == []
            assert scheduler.ledger.in_flight == 1
            assert scheduler.ledger.pending() == {"g": 1}
            nursery.cancel_scope.cancel()
    (outcome,) = scheduler.poll()
    assert outcome.status is GroupStatus.CANCELLED
    assert scheduler.ledger.in_flight == 0
    assert scheduler.ledger.pending_groups == 0
    assert scheduler.ledger.opened == scheduler.ledger.returned == 2
    scheduler.ledger.check()


async def test_a_reward_that_never_says_it_started_holds_its_credit_until_it_returns() -> None:
    # an async reward runs on the loop: its sample holds its credit while it runs
    scheduler = CreditScheduler(SampleBackfill(), group_size=2)
    group = _hanging_group(2)
    release = trio.Event()
    scoring = 0

    async def score(record: Mapping[str, Any], completion: str) -> float:
        nonlocal scoring
        scoring += 1
        await release.wait()
        return 1.0

    reward = RecordReward(score, _decode)
    runner = GroupRunner(_generate, sample_reward=reward)
    scheduler.submitted(group.group_id, credits=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_reporting, runner, group, scheduler)
        with trio.fail_after(10):
            while scoring < 2:  # noqa: ASYNC110 - the reward's own count
                await trio.sleep(0.01)
        scheduler.poll()
        assert scheduler.ledger.in_flight == 2
        release.set()
    (outcome,) = scheduler.poll()
    assert outcome.status is GroupStatus.COMPLETED
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert scheduler.ledger.opened == scheduler.ledger.returned == 2
    scheduler.ledger.check()
