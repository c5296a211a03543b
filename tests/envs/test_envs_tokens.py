"""Every token of an episode accounted for: the sample is the episode's exact token sequence,
the loss mask is True exactly on sampled tokens, logprobs are aligned (0 where masked), and
every engine request's prompt is a token prefix of the final sample."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import trio
from envs_helpers import CODEC, EOS, RecordingEngine, ScriptedPolicy

from trio_rl.engines import SamplingParams
from trio_rl.envs import (
    EPISODE_KEY,
    CompactCalls,
    EnvConfig,
    Episode,
    EpisodeRunner,
    ToolCall,
    ToolEnv,
    single_turn,
)
from trio_rl.errors import EnvConfigError
from trio_rl.rollout import GroupRunner, run_group
from trio_rl.samples import Group, Prompt, Sample, SampleStatus


def lookup_reply(prompt: str) -> str:
    # prompt "3=" -> call "?3"; after the reply "fa=" -> answer "fa"
    if prompt.endswith("=") and "?" not in prompt:
        return "?" + prompt[0]
    return prompt.split("=")[-2][-2:] if prompt.count("=") >= 2 else ""


def lookup_env(table: Mapping[str, str]) -> ToolEnv:
    def lookup(key: str) -> str:
        return table.get(key, "")

    def reward(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
        return 1.0 if answer == table[record["key"]] else 0.0

    return ToolEnv([lookup], reward, syntax=CompactCalls())


def sample_of(prompt: str, index: int = 0, key: str = "3") -> Sample:
    return Sample(index, 0, CODEC.encode(prompt), label={"prompt": prompt, "key": key}, seed=7)


async def test_the_sample_is_the_episodes_exact_tokens_with_the_exact_mask() -> None:
    engine = RecordingEngine(ScriptedPolicy(lookup_reply, version=4))
    runner = EpisodeRunner(
        engine, lookup_env({"3": "fa"}), CODEC, SamplingParams(max_tokens=4), max_len=32
    )
    sample = sample_of("3=")
    with trio.fail_after(10):
        await runner(sample)
    call, reply, answer = (
        [*CODEC.encode("?3"), EOS],
        CODEC.encode("fa="),
        [*CODEC.encode("fa"), EOS],
    )
    assert sample.completion_tokens == [*call, *reply, *answer]
    assert sample.loss_mask == [True] * 3 + [False] * 3 + [True] * 3
    assert sample.logprobs == [-0.01, -0.02, -0.03, 0.0, 0.0, 0.0, -0.01, -0.02, -0.03]
    assert sample.status is SampleStatus.COMPLETED
    assert sample.reward == 1.0
    assert sample.policy_versions == [4, 4]
    assert sample.metadata[EPISODE_KEY] == {
        "turns": 2,
        "stop": "done",
        "spans": [[0, 3, 4], [6, 9, 4]],
    }
    final = sample.prompt_tokens + tuple(sample.completion_tokens)
    assert len(engine.requests) == 2
    for request in engine.requests:
        assert final[: len(request.prompt_tokens)] == request.prompt_tokens
    # the second request is the first's prompt plus everything appended since, no re-encoding
    assert engine.requests[1].prompt_tokens == sample.prompt_tokens + tuple(call) + reply
    # every turn of the episode is routed alike
    assert len({r.routing_key for r in engine.requests}) == 1
    assert runner.stats.stops["done"] == 1
    assert runner.stats.tool_calls == 1


async def test_a_single_turn_run_is_an_environment_with_one_generate() -> None:
    engine = RecordingEngine(ScriptedPolicy(lambda p: "ab"))
    runner = EpisodeRunner(
        engine,
        single_turn(lambda record, text: float(text == "ab")),
        CODEC,
        SamplingParams(max_tokens=5),
    )
    sample = sample_of("3=")
    await runner(sample)
    assert sample.completion_tokens == [*CODEC.encode("ab"), EOS]
    assert sample.loss_mask == [True] * 3
    assert sample.reward == 1.0
    assert sample.status is SampleStatus.COMPLETED
    # the request is the single-turn one: the prompt and the sample's seed
    assert engine.requests[0].prompt_tokens == sample.prompt_tokens
    assert engine.requests[0].params.seed == 7


async def test_one_credit_per_episode_through_the_group_runner() -> None:
    runner = EpisodeRunner(
        ScriptedPolicy(lookup_reply), lookup_env({"3": "fa"}), CODEC, SamplingParams(max_tokens=4)
    )
    samples = [sample_of("3=", index=i) for i in range(4)]
    group = Group("g", Prompt("p", CODEC.encode("3=")), samples)
    done: list[int] = []
    await run_group(
        group, GroupRunner(runner).generate, on_sample_done=lambda s: done.append(s.index)
    )
    assert sorted(done) == [0, 1, 2, 3]  # one report (one credit) per episode, not per turn
    assert all(s.reward == 1.0 for s in samples)
    assert runner.stats.turns == 8
    assert runner.stats.episodes == 4


async def test_observed_tokens_are_never_re_encoded_and_generate_returns_only_the_turn() -> None:
    seen: list[str] = []

    async def play(episode: Episode, record: Mapping[str, Any]) -> float:
        seen.append(await episode.generate())
        episode.observe("h=")
        episode.observe_tokens([EOS])
        seen.append(await episode.generate(max_tokens=2))
        return 0.5

    sample = sample_of("1=")
    runner = EpisodeRunner(
        ScriptedPolicy(lambda p: "abc"), play, CODEC, SamplingParams(max_tokens=8)
    )
    await runner(sample)
    assert seen == ["abc", "ab"]
    assert sample.loss_mask == [True] * 4 + [False] * 3 + [True] * 2
    assert sample.status is SampleStatus.COMPLETED
    assert sample.reward == 0.5


async def test_generate_refuses_a_bad_max_tokens_as_an_error_of_the_episode() -> None:
    async def play(episode: Episode, record: Mapping[str, Any]) -> float:
        with pytest.raises(EnvConfigError, match="max_tokens must be >= 1"):
            await episode.generate(max_tokens=0)
        return 1.0

    sample = sample_of("1=")
    await EpisodeRunner(ScriptedPolicy(lambda p: "a"), play, CODEC)(sample)
    assert sample.reward == 1.0


def test_the_config_refuses_bad_values_naming_them() -> None:
    with pytest.raises(ValueError, match=r"EnvConfig\.max_turns must be an int >= 1"):
        EnvConfig(max_turns=0)
    with pytest.raises(ValueError, match=r"EnvConfig\.on_mismatch must be one of"):
        EnvConfig(on_mismatch="ignore")  # type: ignore[arg-type]
