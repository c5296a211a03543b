"""Bad engine settings are refused when the object is built, in one line naming the field."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from trio_rl.engines import (
    GenerateRequest,
    LogNormalSeconds,
    OpenAICompatibleEngine,
    ParetoSeconds,
    SamplingParams,
    SimulatedEngine,
    VLLMEngine,
)
from trio_rl.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_tokens", 0, "SamplingParams.max_tokens must be an int >= 1, got 0"),
        ("max_tokens", -5, "SamplingParams.max_tokens must be an int >= 1, got -5"),
        ("max_tokens", 2.5, "SamplingParams.max_tokens must be an int >= 1"),
        ("temperature", -0.1, "SamplingParams.temperature must be finite and >= 0"),
        ("temperature", math.nan, "SamplingParams.temperature"),
        ("top_p", 0.0, r"SamplingParams.top_p must be in \(0, 1\]"),
        ("top_p", 1.5, "SamplingParams.top_p"),
        ("seed", "0", "SamplingParams.seed must be an int or None"),
    ],
)
def test_bad_sampling_params_are_refused(field: str, value: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seconds_per_token", 0.0),  # was a ZeroDivisionError / instant run
        ("seconds_per_token", math.inf),
        ("time_scale", 0.0),
        ("time_scale", -1.0),
        ("time_scale", math.nan),
        ("slots", True),
        ("seed", 1.5),
    ],
)
def test_bad_engine_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=f"SimulatedEngine.{field} must be"):
        SimulatedEngine(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "first", "build"),
    [
        # (mypy refuses these calls too: the ignores are the point)
        (SimulatedEngine, "distribution", lambda: SimulatedEngine("long-cot", 8)),  # type: ignore[call-arg]
        (VLLMEngine, "base_url", lambda: VLLMEngine("http://x", "m")),  # type: ignore[call-arg]
        (OpenAICompatibleEngine, "base_urls", lambda: OpenAICompatibleEngine("http://x", "m")),  # type: ignore[call-arg]
    ],
)
def test_engine_constructors_are_keyword_only_after_the_first(
    cls: type, first: str, build: Callable[[], object]
) -> None:
    # many settings, adjacent floats among them (timeout, backoff, ...): only by name
    params = list(inspect.signature(cls).parameters.values())
    assert (params[0].name, params[0].kind) == (first, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert {p.kind for p in params[1:]} == {inspect.Parameter.KEYWORD_ONLY}
    with pytest.raises(TypeError, match="positional argument"):
        build()


def test_the_first_engine_parameter_stays_positional() -> None:
    tokens = LogNormalSeconds(median=2.0)
    assert SimulatedEngine(tokens, slots=2).distribution is tokens
    assert VLLMEngine("http://127.0.0.1:1/", model="m").base_url == "http://127.0.0.1:1"
    assert OpenAICompatibleEngine("http://127.0.0.1:1", model="m").base_urls == (
        "http://127.0.0.1:1",
    )


def test_engine_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"LogNormalSeconds.median must be finite and > 0"):
        LogNormalSeconds(median=-1.0)


@pytest.mark.parametrize("name", ["swe", "heavy-tail"])
def test_time_scale_shrinks_wall_time_distributions(name: str) -> None:
    """``swe`` and ``heavy-tail`` durations are real seconds; ``time_scale`` scales them too."""

    async def elapsed(scale: float) -> tuple[float, list[int]]:
        engine = SimulatedEngine(name, slots=64, seed=3, time_scale=scale)
        lengths: list[int] = []

        async def one(i: int) -> None:
            request = GenerateRequest((i, 1), SamplingParams(max_tokens=4096), sample_index=i)
            lengths.append(len((await engine.generate(request)).tokens))

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
        return trio.current_time() - start, sorted(lengths)

    def run(scale: float) -> tuple[float, list[int]]:
        return trio.run(elapsed, scale, clock=trio.testing.MockClock(autojump_threshold=0))

    slow, slow_lengths = run(1.0)
    fast, fast_lengths = run(1e-4)
    assert slow > 600  # about an hour of simulated agent time
    assert fast == pytest.approx(slow * 1e-4)
    assert fast_lengths == slow_lengths  # only time is scaled, not what is generated


def test_heavy_tail_kill_time_is_scaled() -> None:
    async def main() -> float:
        engine = SimulatedEngine(ParetoSeconds(hang_probability=1.0), time_scale=0.001)
        start = trio.current_time()
        completion = await engine.generate(GenerateRequest((1,), sample_index=0))
        assert completion.finish_reason == "abort"
        return trio.current_time() - start

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert took == pytest.approx(3.6)
