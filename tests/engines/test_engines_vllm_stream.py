"""VLLMEngine's streamed ``n`` request against a real loopback HTTP server (``vllm_stand_in``):
the choices of one request arrive as server-sent events, one choice per event, routed to their
samples by ``index``; an aborted sample keeps what its choice streamed, its siblings go on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import trio
from vllm_stand_in import StandIn, serve

from trio_rl.engines import (
    AbortSignal,
    Completion,
    EngineResponseError,
    EngineTimeoutError,
    GenerateRequest,
    SamplingParams,
)
from trio_rl.engines._vllm import open_vllm_engine


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    with serve() as server:
        yield server


def _group(seeds: list[int], max_tokens: int = 4) -> list[GenerateRequest]:
    return [
        GenerateRequest((5, 6), SamplingParams(max_tokens=max_tokens, seed=s), request_id=f"r{s}")
        for s in seeds
    ]


async def _generate_all(
    engine: Any, requests: list[GenerateRequest], finished_at: list[float] | None = None
) -> list[Any]:
    out: list[Any] = [None] * len(requests)
    async with trio.open_nursery() as nursery:
        for i, r in enumerate(requests):

            async def one(i: int = i, r: GenerateRequest = r) -> None:
                out[i] = await engine.generate(r)
                if finished_at is not None:
                    finished_at[i] = trio.current_time()

            nursery.start_soon(one)
    return out


async def _until(condition: Callable[[], bool]) -> None:
    # the server's threads change its state: poll (the callers bound it with fail_after)
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def _idle(engine: Any) -> None:
    """Until the engine's batch tasks have all ended (its HTTP requests are closed)."""
    nursery = engine._batcher.nursery
    assert nursery is not None
    await _until(lambda: not nursery.child_tasks)


def _expected(state: StandIn, seed: int, n: int, i: int, max_tokens: int) -> Completion:
    tokens, logprobs, finish = state.choice({"seed": seed, "n": n, "max_tokens": max_tokens}, i)
    return Completion(tokens, logprobs, finish, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("reverse", [False, True])
async def test_a_streamed_n_choice_completion_equals_the_non_streamed_one(
    stand_in: tuple[StandIn, str], reverse: bool
) -> None:
    state, url = stand_in
    state.lengths, state.reverse_choices = [3, 5, 2, 4], reverse
    results = {}
    with trio.fail_after(10):
        for stream in (True, False):
            async with open_vllm_engine(url, gather_window=0.05, stream=stream) as engine:
                results[stream] = await _generate_all(engine, _group([12, 10, 13, 11]))
    assert results[True] == results[False]
    # seed 10 + i is choice i: choice 1 (5 tokens) is cut at max_tokens=4
    assert results[True] == [_expected(state, 10, 4, i, 4) for i in (2, 0, 3, 1)]
    assert [c.finish_reason for c in results[True]] == ["stop", "stop", "stop", "length"]
    posts = [body for _, path, body in state.requests if path == "/v1/completions"]
    assert [(b["stream"], b["n"], b["seed"]) for b in posts] == [(True, 4, 10), (False, 4, 10)]
    assert len(state.sent) == 3 + 4 + 2 + 4


async def test_a_choice_that_finishes_is_released_before_its_siblings(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    state.lengths, state.step_delay = [2, 10], 0.05
    finished_at = [0.0, 0.0]
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.05) as engine:
            out = await _generate_all(engine, _group([0, 1], max_tokens=16), finished_at)
    assert out == [_expected(state, 0, 2, i, 16) for i in (0, 1)]
    assert finished_at[1] - finished_at[0] > 0.2  # eight more steps of 0.05 s


async def test_an_abort_mid_stream_keeps_its_choice_tokens_and_the_siblings_go_on(
    stand_in: tuple[StandIn, str],
) -> None:
    """Sample 0 is aborted after its choice streamed 3 tokens (then the server decodes on
    without sending): it returns exactly those 3 at once; samples 1 and 2 of the same request
    keep streaming to their full completions; then the request is closed."""
    state, url = stand_in
    state.lengths, state.stall, state.step_delay = [20, 10, 12], {0: 3}, 0.05
    signal = AbortSignal()
    requests = _group([0, 1, 2], max_tokens=30)
    requests[0] = attrs.evolve(requests[0], abort=signal)
    finished_at = [0.0, 0.0, 0.0]
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.05) as engine:
            async with trio.open_nursery() as nursery:

                async def abort_after_three() -> None:
                    await _until(lambda: sum(i == 0 for i, _ in state.sent) == 3)
                    await trio.sleep(0.1)  # the client has read them by now
                    signal.set()

                nursery.start_soon(abort_after_three)
                out = await _generate_all(engine, requests, finished_at)
            # the siblings were the last to go: the engine closes the request, whose aborted
            # choice the server was still decoding
            await _until(lambda: state.disconnects == 1)
            await _idle(engine)
    partial = out[0]
    assert partial.tokens == [t for i, t in state.sent if i == 0] == [0, 1000, 2000]
    full = _expected(state, 0, 3, 0, 30)
    assert partial.logprobs == full.logprobs[:3]
    assert (partial.finish_reason, partial.policy_version) == ("abort", 0)
    assert out[1:] == [_expected(state, 0, 3, i, 30) for i in (1, 2)]
    assert finished_at[1] - finished_at[0] > 0.1  # the abort did not wait for the siblings
    assert len([p for _, p, _ in state.requests if p == "/v1/completions"]) == 1


async def test_aborting_every_sample_returns_each_its_own_tokens_and_closes_the_request(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    state.lengths, state.stall, state.step_delay = [20, 20], {0: 2, 1: 4}, 0.02
    signal = AbortSignal()
    requests = [attrs.evolve(r, abort=signal) for r in _group([7, 8], max_tokens=30)]
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.05) as engine:
            async with trio.open_nursery() as nursery:

                async def abort_when_stalled() -> None:
                    await _until(lambda: len(state.sent) == 6)
                    await trio.sleep(0.1)
                    signal.set()

                nursery.start_soon(abort_when_stalled)
                out = await _generate_all(engine, requests)
            await _until(lambda: state.disconnects == 1)
            await _idle(engine)
    assert [c.finish_reason for c in out] == ["abort", "abort"]
    assert out[0].tokens == [7, 1007]
    assert out[1].tokens == [8, 1008, 2008, 3008]
    assert out[1].logprobs == _expected(state, 7, 2, 1, 30).logprobs[:4]


async def test_a_stream_cut_mid_way_is_retried_and_a_released_choice_keeps_its_completion(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    # events: c0 t0, c1 t0, c0 EOS (released), c1 t1, then the cut
    state.lengths, state.cut_after = [2, 6], 4
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.05, max_attempts=2, backoff=0) as e:
            out = await _generate_all(e, _group([0, 1], max_tokens=16))
    # choice 1's two tokens of the cut attempt are not kept: no token twice
    assert out == [_expected(state, 0, 2, i, 16) for i in (0, 1)]
    assert len(state.requests) == 2


async def test_the_deadline_holds_mid_stream(stand_in: tuple[StandIn, str]) -> None:
    state, url = stand_in
    state.lengths, state.stall = [5], {0: 1}
    with trio.fail_after(10):
        async with open_vllm_engine(url, timeout=0.3) as engine:
            with pytest.raises(EngineTimeoutError, match=r"'r0', n=1\) did not finish within 0.3s"):
                await engine.generate(_group([0])[0])
            await _until(lambda: state.disconnects == 1)


def _event(index: int | None, token: Any, finish: str | None = None) -> str:
    choice: dict[str, Any] = {
        "text": "",
        "logprobs": {"tokens": [token], "token_logprobs": [-1.0]},
        "finish_reason": finish,
    }
    if index is not None:
        choice["index"] = index
    return json.dumps({"choices": [choice]})


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            _sse(_event(0, "token_id:5"), _event(1, "token_id:6"), "{oops"),
            r"event 2: event data is not valid JSON",
        ),
        (
            _sse(_event(0, "token_id:5"), _event(2, "token_id:6")),
            r"event 1: field 'choices\[0\].index' = 2 is missing or not in 0..1",
        ),
        (
            _sse(_event(None, "token_id:5")),
            r"event 0: field 'choices\[0\].index' = None is missing",
        ),
        (
            _sse(_event(0, "token_id:5"), '{"error": {"message": "engine dead"}}'),
            r"event 1: the server sent an error in the stream: .*engine dead",
        ),
        (
            _sse(_event(0, "token_id:5", "stop"), _event(0, "token_id:6")),
            r"event 1: choice 0 goes on after its finish",
        ),
        (
            _sse(_event(1, "hi")),
            r"event 0: field 'choices\[0\].logprobs.tokens\[0\]' = 'hi'",
        ),
        (
            _sse(_event(0, "token_id:5", "stop"), _event(1, "token_id:6"), "[DONE]"),
            r"the stream ended without a finish reason for choices \[1\]",
        ),
    ],
)
async def test_a_bad_stream_fails_every_sample_with_an_error_naming_the_event(
    stand_in: tuple[StandIn, str], raw: bytes, match: str
) -> None:
    state, url = stand_in
    state.raw_stream = raw
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.05) as engine:
            outcomes: list[BaseException | Completion] = []

            async def one(r: GenerateRequest) -> None:
                try:
                    outcomes.append(await engine.generate(r))
                except EngineResponseError as exc:
                    outcomes.append(exc)

            async with trio.open_nursery() as nursery:
                for r in _group([0, 1]):
                    nursery.start_soon(one, r)
    errors = [o for o in outcomes if isinstance(o, EngineResponseError)]
    # a choice released before the bad event keeps its completion; every other sample fails
    assert errors
    assert len(errors) + sum(isinstance(o, Completion) for o in outcomes) == 2
    for e in errors:
        assert f"{url}/v1/completions (request 'r0', n=2)" in str(e)
        with pytest.raises(EngineResponseError, match=match):
            raise e
    assert len(state.requests) == 1  # a malformed stream is not retried
