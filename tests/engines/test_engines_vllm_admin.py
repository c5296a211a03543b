"""VLLMAdmin and VLLMEngine against a real loopback HTTP server that stands in for vLLM
(``vllm_stand_in``); the streamed answers and aborts are in ``test_engines_vllm_stream``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio
from vllm_stand_in import EOS, StandIn, serve

from operations_waits import documented
from trio_rl.engines import (
    AbortSignal,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
    GenerateRequest,
    SamplingParams,
)
from trio_rl.engines._vllm import VLLMAdmin, open_vllm_engine
from trio_rl.errors import InvalidArgumentError


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    with serve() as server:
        yield server


async def test_reload_weights_and_reset_post_what_vllm_reads(
    stand_in: tuple[StandIn, str], tmp_path: Any
) -> None:
    state, url = stand_in
    with trio.fail_after(10):
        async with VLLMAdmin(url + "/") as admin:
            assert await admin.healthy()
            await admin.reload_weights(tmp_path / "step_3")
            await admin.reset_prefix_cache()
    assert state.requests == [
        ("GET", "/health", None),
        (
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "step_3")}},
        ),
        ("POST", "/reset_prefix_cache", None),
    ]


async def test_collective_rpc_returns_results_and_rejects_bad_json(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    state.override["/collective_rpc"] = (200, b'{"results": [null, "ok"]}')
    with trio.fail_after(10):
        async with VLLMAdmin(url) as admin:
            assert await admin.collective_rpc("reload_weights", {}) == [None, "ok"]
            state.override["/collective_rpc"] = (200, b"{not json")
            with pytest.raises(EngineResponseError, match=r"collective_rpc.*not JSON"):
                await admin.collective_rpc("reload_weights", {})


async def test_admin_errors_name_the_url(stand_in: tuple[StandIn, str]) -> None:
    state, url = stand_in
    with trio.fail_after(10):
        async with VLLMAdmin(url) as admin:
            state.override["/collective_rpc"] = (404, b'{"detail": "Not Found"}')
            with pytest.raises(
                EngineRequestError, match="collective_rpc refused with HTTP 404"
            ) as e:
                await admin.reload_weights("/nowhere")
            assert e.value.status_code == 404
            state.override["/reset_prefix_cache"] = (500, b"boom")
            with pytest.raises(EngineTransportError, match=r"reset_prefix_cache: HTTP 500: boom"):
                await admin.reset_prefix_cache()
            state.override["/health"] = (503, b"")
            assert not await admin.healthy()
            with pytest.raises(EngineTimeoutError, match="/health did not answer 200 within"):
                await admin.wait_healthy(0.3, poll_interval=0.05)


async def test_a_dropped_connection_is_retried_once(stand_in: tuple[StandIn, str]) -> None:
    state, url = stand_in
    with trio.fail_after(10):
        async with VLLMAdmin(url) as admin:
            state.drop_next = 1
            await admin.reload_weights("/w/step_1")
            assert [p for _, p, _ in state.requests] == ["/collective_rpc"] * 2
            state.drop_next = 2
            with pytest.raises(EngineTransportError, match="RemoteProtocolError") as info:
                await admin.reset_prefix_cache()
    assert [p for _, p, _ in state.requests][2:] == ["/reset_prefix_cache"] * 2
    documented("vLLM admin calls", str(info.value))


async def test_admin_call_times_out_at_its_deadline(stand_in: tuple[StandIn, str]) -> None:
    state, url = stand_in
    state.delay = 2.0
    with trio.fail_after(10):
        async with VLLMAdmin(url, timeout=0.2) as admin:
            start = trio.current_time()
            with pytest.raises(
                EngineTimeoutError, match=r"/collective_rpc did not answer within 0.2s"
            ):
                await admin.reload_weights("/w")
            assert trio.current_time() - start < 1.5


async def test_admin_unreachable_and_closed() -> None:
    with trio.fail_after(10):
        admin = VLLMAdmin("http://127.0.0.1:9", timeout=5)
        with pytest.raises(trio.ClosedResourceError):
            await admin.reset_prefix_cache()
        async with admin:
            with pytest.raises(EngineTransportError, match=r"127\.0\.0\.1:9/collective_rpc"):
                await admin.reload_weights("/w")
    with pytest.raises(InvalidArgumentError, match=r"VLLMAdmin\.base_url"):
        VLLMAdmin("localhost:8000")


def _group(prompt: tuple[int, ...], seeds: list[int]) -> list[GenerateRequest]:
    return [
        GenerateRequest(prompt, SamplingParams(max_tokens=4, seed=s), request_id=f"r{s}")
        for s in seeds
    ]


async def _generate_all(engine: Any, requests: list[GenerateRequest]) -> list[Any]:
    out: list[Any] = [None] * len(requests)
    async with trio.open_nursery() as nursery:
        for i, r in enumerate(requests):

            async def one(i: int = i, r: GenerateRequest = r) -> None:
                out[i] = await engine.generate(r)

            nursery.start_soon(one)
    return out


async def test_a_group_is_one_request_with_n_and_choices_map_by_index(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    state.reverse_choices = True
    with trio.fail_after(10):
        async with open_vllm_engine(url, model="tiny", gather_window=0.05) as engine:
            # seeds 10-13 are one run, 20 and 22 are two more
            completions = await _generate_all(engine, _group((5, 6), [12, 10, 22, 13, 11, 20]))
    posts = [body for _, path, body in state.requests if path == "/v1/completions"]
    assert sorted((b["seed"], b["n"]) for b in posts) == [(10, 4), (20, 1), (22, 1)]
    assert all(b["prompt"] == [5, 6] and b["model"] == "tiny" for b in posts)
    # each sample gets the tokens of its own seed, whatever order the choices came in
    assert [c.tokens for c in completions] == [[s, EOS] for s in [12, 10, 22, 13, 11, 20]]
    assert completions[0].logprobs == [-0.5 - 2, -0.25]
    assert engine.statistics()["http_requests"] == 3


async def test_load_weights_reloads_then_resets_then_moves_the_version(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0) as engine:
            (before,) = await _generate_all(engine, _group((5,), [1]))
            await engine.load_weights("/w/step_7", 7)
            (after,) = await _generate_all(engine, _group((5,), [1]))
            with pytest.raises(ValueError, match="cannot go back from 7 to 3"):
                await engine.load_weights("/w/step_3", 3)
            # a refused reload leaves the version where it was
            state.override["/collective_rpc"] = (400, b"bad path")
            with pytest.raises(EngineRequestError):
                await engine.load_weights("/w/step_8", 8)
            assert engine.policy_version == 7
    assert (before.policy_version, after.policy_version) == (0, 7)
    paths = [path for _, path, _ in state.requests]
    assert paths[1:3] == ["/collective_rpc", "/reset_prefix_cache"]


async def test_bad_completion_bodies_fail_every_sample_of_the_request(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    with trio.fail_after(10):
        async with open_vllm_engine(
            url, gather_window=0.05, max_attempts=2, backoff=0, stream=False
        ) as engine:
            state.override["/v1/completions"] = (200, json.dumps({"choices": []}).encode())
            with pytest.raises(ExceptionGroup) as e:
                await _generate_all(engine, _group((5,), [1, 2]))
            assert all(
                isinstance(x, EngineResponseError) and "expected 2 choices, got 0" in str(x)
                for x in e.value.exceptions
            )
            state.override["/v1/completions"] = (502, b"")
            with pytest.raises(EngineTransportError, match="failed after 2 attempts: HTTP 502"):
                await engine.generate(_group((5,), [1])[0])


async def test_generate_outside_the_engine_block_raises() -> None:
    async with open_vllm_engine("http://127.0.0.1:9") as engine:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await engine.generate(_group((5,), [1])[0])


async def test_cancelling_every_sample_closes_the_http_request(
    stand_in: tuple[StandIn, str],
) -> None:
    state, url = stand_in
    state.delay = 3.0
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0) as engine:
            with trio.move_on_after(0.3):
                await _generate_all(engine, _group((5,), [1, 2]))
            assert state.requests, "the request never reached the server"
            # the batch task drops its HTTP request (vLLM aborts on disconnect) long before
            # the 3 s answer
            nursery = engine._batcher.nursery
            assert nursery is not None
            with trio.fail_after(1):
                while nursery.child_tasks:  # noqa: ASYNC110 - no event marks a task's end
                    await trio.sleep(0.01)


async def test_a_request_after_its_batch_was_abandoned_starts_a_new_one(
    stand_in: tuple[StandIn, str],
) -> None:
    _, url = stand_in
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0.2) as engine:
            (first, second) = _group((5,), [1, 2])
            with trio.move_on_after(0.05):
                await engine.generate(first)
            # same prompt and settings while the abandoned batch would still be gathering
            completion = await engine.generate(second)
    assert completion.tokens == [2, EOS]


@pytest.mark.parametrize("stream", [True, False])
async def test_abort_returns_at_once_and_closes_the_request_once_every_sample_left(
    stand_in: tuple[StandIn, str], stream: bool
) -> None:
    """An abort before any answer (here the server answers after 0.5 s) returns an empty
    ``abort`` completion at once; its siblings still get theirs; when every sample of the HTTP
    request was aborted the request is closed (vLLM aborts on disconnect)."""
    state, url = stand_in
    state.delay = 0.5
    one_signal, all_signal = AbortSignal(), AbortSignal()
    with trio.fail_after(10):
        async with open_vllm_engine(url, gather_window=0, stream=stream) as engine:
            first, second = _group((5,), [1, 2])
            requests = [attrs.evolve(first, abort=one_signal), second]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_set_after, one_signal, 0.1)
                start = trio.current_time()
                out = await _generate_all(engine, requests)
            assert out[0].finish_reason == "abort"
            assert out[0].tokens == []
            assert out[1].finish_reason != "abort"
            assert out[1].tokens
            # every sample aborted: the batch task ends long before the 3 s answer
            state.delay = 3.0
            group = [attrs.evolve(r, abort=all_signal) for r in _group((6,), [1, 2])]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_set_after, all_signal, 0.1)
                start = trio.current_time()
                out = await _generate_all(engine, group)
            assert [c.finish_reason for c in out] == ["abort", "abort"]
            assert trio.current_time() - start < 2
            nursery_ = engine._batcher.nursery
            assert nursery_ is not None
            with trio.fail_after(1):
                while nursery_.child_tasks:  # noqa: ASYNC110 - no event marks a task's end
                    await trio.sleep(0.01)


async def _set_after(signal: AbortSignal, delay: float) -> None:
    await trio.sleep(delay)
    signal.set()
