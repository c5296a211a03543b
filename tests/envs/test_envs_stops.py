"""Budgets and stop reasons: every episode ends with exactly one, counted; a tool that raises
or never returns costs its episode, never the run, and leaves no task behind."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from envs_helpers import CODEC, EOS, RecordingEngine, ScriptedPolicy

from trio_rl.engines import Completion, EngineTransportError, GenerateRequest, SamplingParams
from trio_rl.envs import (
    EPISODE_KEY,
    CompactCalls,
    EnvConfig,
    Episode,
    EpisodeRunner,
    StopReason,
    ToolCall,
    ToolEnv,
)
from trio_rl.samples import Sample, SampleStatus


def zero(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
    return 1.0


def always_call(prompt: str) -> str:
    return "?1"


def sample_of(prompt: str = "1=") -> Sample:
    return Sample(0, 0, CODEC.encode(prompt), label={"prompt": prompt}, seed=1)


#: whether `play` opens the runner (its task then serves every deadline); each test runs both ways
_SERVED = {"on": False}


@pytest.fixture(autouse=True, params=["trio's deadlines", "the runner's deadline server"])
def _deadlines(request: pytest.FixtureRequest) -> None:
    _SERVED["on"] = request.param != "trio's deadlines"


async def play(runner: EpisodeRunner) -> Sample:
    sample = sample_of()
    with trio.fail_after(10):
        if _SERVED["on"]:
            async with runner:
                await runner(sample)
        else:
            await runner(sample)
    return sample


def stop_of(sample: Sample) -> StopReason:
    reason: StopReason = sample.metadata[EPISODE_KEY]["stop"]
    return reason


def only(runner: EpisodeRunner, reason: StopReason) -> None:
    assert runner.stats.episodes == 1
    assert runner.stats.stops[reason] == 1


async def test_max_turns_of_the_config_ends_the_episode_truncated() -> None:
    env = ToolEnv([lambda key: "a"], zero, syntax=CompactCalls())
    runner = EpisodeRunner(
        ScriptedPolicy(always_call),
        env,
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(max_turns=3),
    )
    sample = await play(runner)
    assert stop_of(sample) == "max_turns"
    assert sample.status is SampleStatus.TRUNCATED
    assert sample.reward == 0.0
    assert sample.metadata[EPISODE_KEY]["turns"] == 3
    assert runner.stats.tool_calls == 3
    only(runner, "max_turns")


async def test_max_turns_of_the_tool_env_ends_it_too() -> None:
    env = ToolEnv([lambda key: "a"], zero, max_turns=2, syntax=CompactCalls())
    runner = EpisodeRunner(ScriptedPolicy(always_call), env, CODEC, SamplingParams(max_tokens=3))
    sample = await play(runner)
    assert stop_of(sample) == "max_turns"
    assert sample.metadata[EPISODE_KEY]["turns"] == 2


async def test_the_token_budget_covers_the_prompt_and_every_turn() -> None:
    env = ToolEnv([lambda key: "abcd"], zero, syntax=CompactCalls())
    # prompt 2 + call 3 + reply 5 = 10 of 11: the answer turn has one token of room
    runner = EpisodeRunner(
        ScriptedPolicy(lambda p: "?1" if p == "1=" else "abcd"),
        env,
        CODEC,
        SamplingParams(max_tokens=8),
        max_len=11,
    )
    sample = await play(runner)
    assert stop_of(sample) == "budget"
    assert sample.num_tokens == 11
    assert sample.loss_mask[-1] is True  # the token sampled in the room left is kept
    assert sample.status is SampleStatus.TRUNCATED
    only(runner, "budget")


async def test_an_observation_that_does_not_fit_stops_the_episode_on_budget() -> None:
    env = ToolEnv([lambda key: "abcdefgh"], zero, syntax=CompactCalls())
    runner = EpisodeRunner(
        ScriptedPolicy(always_call), env, CODEC, SamplingParams(max_tokens=3), max_len=8
    )
    sample = await play(runner)
    assert stop_of(sample) == "budget"
    assert sample.num_tokens == 5  # the reply was not appended


async def test_a_tool_that_never_returns_ends_its_episode_as_tool_timeout() -> None:
    async def hang(key: str) -> str:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    env = ToolEnv([hang], zero, syntax=CompactCalls())
    runner = EpisodeRunner(
        ScriptedPolicy(always_call),
        env,
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(tool_timeout=0.05),
    )
    async with trio.open_nursery() as nursery:
        sample = await play(runner)
        # nothing of the episode runs on: the only task here is the test's own
        assert nursery.child_tasks == frozenset()
    assert stop_of(sample) == "tool_timeout"
    assert sample.status is SampleStatus.FAILED
    only(runner, "tool_timeout")


async def test_a_sync_tool_past_its_timeout_is_abandoned_in_its_thread() -> None:
    release = threading.Event()
    limiter = trio.CapacityLimiter(1)

    def block(key: str) -> str:
        release.wait(10)
        return "late"

    env = ToolEnv([block], zero, tool_timeout=0.05, syntax=CompactCalls())
    runner = EpisodeRunner(
        ScriptedPolicy(always_call), env, CODEC, SamplingParams(max_tokens=3), limiter=limiter
    )
    try:
        sample = await play(runner)
    finally:
        release.set()
    assert stop_of(sample) == "tool_timeout"
    # the tool ran under the run's limiter (its one token was borrowed)
    assert limiter.total_tokens == 1


# a tool call's scope inside the episode's (episode_timeout) or with none around it
BOTH_SCOPES = pytest.mark.parametrize("episode_timeout", [600.0, None])


def calls_then_answers(prompt: str) -> str:
    return "?1" if prompt == "1=" else "a"


@BOTH_SCOPES
async def test_an_async_tool_past_its_timeout_ends_the_episode_before_its_next_turn(
    episode_timeout: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    async def slow(key: str) -> str:
        await trio.sleep(60)
        return "late"

    engine = RecordingEngine(ScriptedPolicy(calls_then_answers))
    env = ToolEnv([slow], zero, tool_timeout=5.0, syntax=CompactCalls())
    runner = EpisodeRunner(
        engine, env, CODEC, SamplingParams(max_tokens=3), EnvConfig(episode_timeout=episode_timeout)
    )
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        sample = await play(runner)
        assert trio.current_time() - start == pytest.approx(5.0)
        assert nursery.child_tasks == frozenset()  # nothing of the episode runs on
    assert stop_of(sample) == "tool_timeout"
    assert sample.status is SampleStatus.FAILED
    assert len(engine.requests) == 1  # the turn after the call never ran
    assert sample.metadata[EPISODE_KEY]["turns"] == 1
    only(runner, "tool_timeout")


@BOTH_SCOPES
async def test_a_tool_that_swallows_its_cancellation_ends_its_episode_all_the_same(
    episode_timeout: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    swallowed = []

    async def stubborn(key: str) -> str:
        try:
            await trio.sleep(60)
        except trio.Cancelled:
            swallowed.append(trio.current_time())
        return "late"

    engine = RecordingEngine(ScriptedPolicy(calls_then_answers))
    env = ToolEnv([stubborn], zero, tool_timeout=5.0, syntax=CompactCalls())
    runner = EpisodeRunner(
        engine, env, CODEC, SamplingParams(max_tokens=3), EnvConfig(episode_timeout=episode_timeout)
    )
    sample = await play(runner)
    assert len(swallowed) == 1
    assert stop_of(sample) == "tool_timeout"
    assert len(engine.requests) == 1  # its result was not shown to the policy
    assert sample.num_tokens == len(CODEC.encode("1=?1")) + 1  # prompt, call, eos
    only(runner, "tool_timeout")


@BOTH_SCOPES
async def test_a_sync_tool_past_its_timeout_ends_the_episode_and_is_left_to_its_thread(
    episode_timeout: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    release = threading.Event()

    def block(key: str) -> str:
        release.wait(10)
        return "late"

    engine = RecordingEngine(ScriptedPolicy(calls_then_answers))
    env = ToolEnv([block], zero, tool_timeout=5.0, syntax=CompactCalls())
    runner = EpisodeRunner(
        engine, env, CODEC, SamplingParams(max_tokens=3), EnvConfig(episode_timeout=episode_timeout)
    )
    try:
        sample = await play(runner)
    finally:
        release.set()
    assert stop_of(sample) == "tool_timeout"
    assert len(engine.requests) == 1


async def test_the_episode_timeout_is_told_apart_from_a_longer_tool_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(key: str) -> str:
        await trio.sleep(60)
        return "late"

    # the episode's deadline (8 s) falls inside the call, before the call's own (10 s)
    runner = EpisodeRunner(
        ScriptedPolicy(calls_then_answers, delay=1.0),
        ToolEnv([slow], zero, tool_timeout=10.0, syntax=CompactCalls()),
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(episode_timeout=8.0),
    )
    start = trio.current_time()
    sample = await play(runner)
    assert trio.current_time() - start == pytest.approx(8.0)
    assert stop_of(sample) == "episode_timeout"
    assert sample.status is SampleStatus.TRUNCATED
    only(runner, "episode_timeout")


async def test_a_tool_call_in_time_gives_the_episode_its_own_deadline_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def quick(key: str) -> str:
        await trio.sleep(0.5)
        return "b"

    async def one(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
        return 1.0  # on the loop: a worker thread would let the mock clock jump

    # turns of 4 s each, past the 2 s of a tool call: only a call is held to those
    runner = EpisodeRunner(
        ScriptedPolicy(calls_then_answers, delay=4.0),
        ToolEnv([quick], one, tool_timeout=2.0, syntax=CompactCalls()),
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(episode_timeout=9.0),
    )
    sample = await play(runner)
    assert stop_of(sample) == "done"
    assert sample.reward == 1.0
    assert sample.metadata[EPISODE_KEY]["turns"] == 2


@BOTH_SCOPES
async def test_a_tool_raising_its_own_too_slow_error_is_a_tool_timeout(
    episode_timeout: float | None,
) -> None:
    async def gives_up(key: str) -> str:
        raise trio.TooSlowError

    runner = EpisodeRunner(
        ScriptedPolicy(calls_then_answers),
        ToolEnv([gives_up], zero, syntax=CompactCalls()),
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(episode_timeout=episode_timeout),
    )
    assert stop_of(await play(runner)) == "tool_timeout"


async def test_a_tool_that_raises_costs_its_episode_only() -> None:
    def broken(key: str) -> str:
        raise KeyError(key)

    env = ToolEnv([broken], zero, syntax=CompactCalls())
    runner = EpisodeRunner(ScriptedPolicy(always_call), env, CODEC, SamplingParams(max_tokens=3))
    sample = await play(runner)
    assert stop_of(sample) == "error"
    assert sample.status is SampleStatus.FAILED
    assert sample.reward == 0.0
    # and the next episode runs as usual
    runner.env = ToolEnv([lambda key: "a"], zero, syntax=CompactCalls())
    runner.config = EnvConfig(max_turns=2)
    assert stop_of(await play(runner)) == "max_turns"


async def test_an_environment_that_raises_ends_as_error() -> None:
    async def env(episode: Episode, record: Mapping[str, Any]) -> float:
        await episode.generate()
        raise RuntimeError("a bug in the environment")

    runner = EpisodeRunner(ScriptedPolicy(lambda p: "a"), env, CODEC)
    sample = await play(runner)
    assert stop_of(sample) == "error"
    assert sample.status is SampleStatus.FAILED


async def test_an_episode_past_its_timeout_ends_as_episode_timeout() -> None:
    runner = EpisodeRunner(
        ScriptedPolicy(always_call, delay=0.03),
        ToolEnv([lambda key: "a"], zero, syntax=CompactCalls()),
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(episode_timeout=0.1),
    )
    sample = await play(runner)
    assert stop_of(sample) == "episode_timeout"
    assert sample.status is SampleStatus.TRUNCATED
    only(runner, "episode_timeout")


async def test_stop_ends_the_episode_with_its_reason_and_reward_and_stays_stopped() -> None:
    async def env(episode: Episode, record: Mapping[str, Any]) -> float:
        await episode.generate()
        try:
            episode.stop("done", reward=0.75)
        except Exception:
            pass  # an environment that swallows the stop cannot go on
        await episode.generate()
        return 0.1

    runner = EpisodeRunner(ScriptedPolicy(lambda p: "a"), env, CODEC)
    sample = await play(runner)
    assert stop_of(sample) == "done"
    assert sample.reward == 0.75
    assert sample.metadata[EPISODE_KEY]["turns"] == 1


async def test_a_malformed_call_is_shown_to_the_policy_and_costs_a_turn() -> None:
    def add(a: str, b: str) -> str:
        return a + b

    replies = iter(["?b", "a"])
    env = ToolEnv([add], lambda r, a, c: float(a == "a"), syntax=CompactCalls())
    runner = EpisodeRunner(
        ScriptedPolicy(lambda p: next(replies)), env, CODEC, SamplingParams(max_tokens=3)
    )
    sample = await play(runner)
    assert stop_of(sample) == "done"
    assert sample.reward == 1.0
    assert runner.stats.tool_calls == 0  # the call did not bind: shown as an error, not run


@attrs.define(eq=False)
class DiesOnce:
    """A server that drops the connection of its ``dies_at``-th request (and of the ``times - 1``
    requests after it)."""

    inner: ScriptedPolicy
    dies_at: int
    times: int = 1
    seen: int = 0

    async def generate(self, request: GenerateRequest) -> Completion:
        self.seen += 1
        if self.dies_at <= self.seen < self.dies_at + self.times:
            raise EngineTransportError("connection reset")
        return await self.inner.generate(request)


async def test_a_turn_whose_server_died_is_sent_again_with_the_whole_prefix_counted() -> None:
    engine = RecordingEngine(DiesOnce(ScriptedPolicy(lambda p: "?1" if p == "1=" else "a"), 2))
    env = ToolEnv([lambda key: "b"], lambda r, a, c: 1.0, syntax=CompactCalls())
    runner = EpisodeRunner(engine, env, CODEC, SamplingParams(max_tokens=3))
    sample = await play(runner)
    assert stop_of(sample) == "done"
    assert runner.stats.turn_retries == 1
    # the retry re-sent exactly the failed request's prefix, under the same routing key
    assert engine.requests[1].prompt_tokens == engine.requests[2].prompt_tokens
    assert engine.requests[1].routing_key == engine.requests[2].routing_key
    assert sample.completion_tokens[-2:] == [CODEC.encode("a")[0], EOS]


@pytest.mark.parametrize("deaths", [2, 3])
async def test_a_turn_is_sent_again_up_to_its_retries_each_counted(deaths: int) -> None:
    engine = RecordingEngine(
        DiesOnce(ScriptedPolicy(lambda p: "?1" if p == "1=" else "a"), 2, times=deaths)
    )
    env = ToolEnv([lambda key: "b"], lambda r, a, c: 1.0, syntax=CompactCalls())
    runner = EpisodeRunner(
        engine, env, CODEC, SamplingParams(max_tokens=3), EnvConfig(turn_retries=2)
    )
    if deaths > 2:
        with pytest.raises(EngineTransportError):
            await play(runner)
    else:
        assert stop_of(await play(runner)) == "done"
    assert runner.stats.turn_retries == 2
    tries = engine.requests[1:4]
    # each try of the second turn: its whole prefix again, numbered by the try
    assert [r.request_id.rsplit("-", 2)[1:] for r in tries] == [["1", "0"], ["1", "1"], ["1", "2"]]
    assert len({r.prompt_tokens for r in tries}) == 1
    assert len(engine.requests) == 4  # no try past the retries


async def test_a_server_that_stays_dead_fails_the_turn_past_its_retries() -> None:
    engine = DiesOnce(ScriptedPolicy(always_call), 1)
    runner = EpisodeRunner(
        engine,
        ToolEnv([lambda key: "b"], zero, syntax=CompactCalls()),
        CODEC,
        config=EnvConfig(turn_retries=0),
    )
    with pytest.raises(EngineTransportError):
        await play(runner)
    assert runner.stats.episodes == 0  # the group fails: no stop reason of the episode's own


async def test_each_stop_reason_is_counted_once_per_episode() -> None:
    runner = EpisodeRunner(
        ScriptedPolicy(always_call),
        ToolEnv([lambda key: "a"], zero, syntax=CompactCalls()),
        CODEC,
        SamplingParams(max_tokens=3),
        EnvConfig(max_turns=2),
    )
    for _ in range(5):
        await play(runner)
    record = runner.stats.record()
    assert record["episodes/stop/max_turns"] == 5
    assert record["episodes/ended"] == 5
    assert sum(v for k, v in record.items() if k.startswith("episodes/stop/")) == 5


@attrs.define(eq=False)
class NotedCalls:
    """``?`` then the arguments, one character each, call ``add``; errors are written down."""

    errors: list[str] = attrs.field(factory=list)

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall("add", tuple(text[1:]))] if text.startswith("?") else []

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        episode.observe(result + "=")

    def show_error(self, episode: Episode, message: str) -> None:
        self.errors.append(message)
        episode.observe("=")


async def test_a_calls_fit_is_told_alike_every_time_in_every_episode() -> None:
    def add(a: str, b: str) -> str:
        return a + b

    syntax = NotedCalls()
    env = ToolEnv([add], zero, syntax=syntax)  # one environment for both episodes
    replies = iter(["?a", "?ab", "?a", "?abc", "h"] * 2)
    runner = EpisodeRunner(
        ScriptedPolicy(lambda p: next(replies)),
        env,
        CODEC,
        SamplingParams(max_tokens=4),
        config=EnvConfig(max_turns=8),
    )
    for _ in range(2):
        sample = await play(runner)
        assert stop_of(sample) == "done"
    missing = "add: missing a required argument: 'b'"
    many = "add: too many positional arguments"
    assert syntax.errors == [missing, missing, many] * 2
    assert runner.stats.tool_calls == 2  # only the call that fits ran, once an episode
