"""Aborts at the engines (miles' ``abort_all``), against real loopback HTTP servers that record
what they receive: SGLang's ``/abort_request`` (one request, or all of them) and vLLM's abort
on disconnect; the sync driver aborts its leftovers at the engines when its batch is full."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from vllm_stand_in import StandIn, serve

from trio_rl.config import LearnRunConfig, load
from trio_rl.engines import (
    FLEET,
    AbortsAll,
    EngineFleet,
    EngineSetup,
    GenerateRequest,
    OpenAICompatibleEngine,
    SamplingParams,
    open_engine_fleet,
)
from trio_rl.rollout import (
    GroupFactory,
    GroupRunner,
    InMemorySource,
    SyncRolloutDriver,
    engine_generate,
)
from trio_rl.samples import Prompt

FAST = {"probe_interval": 0.05, "probe_timeout": 0.5, "start_timeout": 5.0}
SGLANG = "/abort_request"


@contextmanager
def servers(n: int) -> Iterator[list[tuple[StandIn, str]]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve()) for _ in range(n)]


def aborts(state: StandIn) -> list[Any]:
    return [body for _, path, body in state.requests if path == SGLANG]


@pytest.mark.parametrize("abort_path", [SGLANG, None])
async def test_an_engine_aborts_all_at_each_of_its_servers(abort_path: str | None) -> None:
    with servers(2) as ss:
        async with OpenAICompatibleEngine([u for _, u in ss], abort_path=abort_path) as engine:
            assert isinstance(engine, AbortsAll)
            with trio.fail_after(10):
                await engine.abort_all()
    for state, _ in ss:
        assert aborts(state) == ([{"abort_all": True}] if abort_path else [])


@pytest.mark.parametrize("abort_path", [SGLANG, None])
async def test_a_fleet_aborts_all_at_its_live_servers(abort_path: str | None) -> None:
    with servers(3) as ss:
        urls = [u for _, u in ss]
        async with open_engine_fleet(urls, abort_path=abort_path, **FAST) as fleet:
            assert isinstance(fleet, AbortsAll)
            fleet.take_out(urls[2], "the test takes it out")
            with trio.fail_after(10):
                await fleet.abort_all()
    live, out = [s for s, _ in ss[:2]], ss[2][0]
    assert [aborts(s) for s in live] == [[{"abort_all": True}] if abort_path else []] * 2
    assert aborts(out) == []


@pytest.mark.parametrize("abort_path", [SGLANG, None])
async def test_the_sync_driver_aborts_its_leftovers_at_the_engines(abort_path: str | None) -> None:
    """Two groups of two start (over-sampling); group 0 lands on server A, which answers, and
    group 1 on server B, whose streams stall after one token. Once group 0 fills the batch the
    driver aborts the leftovers at the engines: SGLang gets ``abort_all`` (before the
    leftovers' own aborts, by request id), vLLM sees both of group 1's requests disconnect."""
    with servers(2) as ss:
        (a, url_a), (b, url_b) = ss
        b.stall = {0: 1}  # one token, then nothing until the client leaves
        a.delay = 0.3  # group 1's requests are out well before group 0 is back
        async with open_engine_fleet([url_a, url_b], abort_path=abort_path, **FAST) as fleet:
            driver = SyncRolloutDriver(
                InMemorySource([Prompt(key=f"p{i}", tokens=(5, i)) for i in range(4)]),
                GroupFactory(2, routing_keys="group"),  # a group's samples on one server
                GroupRunner(engine_generate(fleet), sample_reward=lambda s: 1.0),
                groups_per_admission=2,
                engine_abort=fleet,
            )
            with trio.fail_after(20):
                batch = await driver.generate(1)
                assert isinstance(fleet, EngineFleet)
                sent_to_b = len(_rids(b))
                # every request of the leftover group that reached B was closed (the server
                # notices a closed connection within its 20 ms poll)
                for _ in range(1000):
                    if b.disconnects >= sent_to_b:
                        break
                    await trio.sleep(0.01)
    assert len(batch.groups) == 1  # the group on A (trio picks which group starts first)
    assert batch.statistics.cancelled == 1
    assert 1 <= sent_to_b <= 2
    assert b.disconnects == sent_to_b
    sent = aborts(b)
    if abort_path is None:
        assert sent == []
        assert aborts(a) == []
    else:
        # the engine-wide abort first, at every live server; then each leftover's own abort
        assert sent[0] == {"abort_all": True}
        assert sorted(map(str, sent[1:])) == sorted(str({"rid": r}) for r in _rids(b))
        assert aborts(a) == [{"abort_all": True}]


def _rids(state: StandIn) -> list[str]:
    return [body["rid"] for _, path, body in state.requests if path == "/v1/completions"]


@pytest.mark.parametrize("key", ['abort_path = "/abort_request"\n', ""])
async def test_the_fleet_of_a_toml_config_aborts_where_its_inference_section_says(
    tmp_path: Path, key: str
) -> None:
    """``[inference] abort_path`` (unset: vLLM) reaches the fleet the run opens from its
    configuration: a cancelled request's abort and ``abort_all`` at the recording servers."""
    with servers(2) as ss:
        for state, _ in ss:
            state.stall = {0: 1}
        toml = tmp_path / "run.toml"
        urls = ", ".join(f'"{u}"' for _, u in ss)
        toml.write_text(f"[inference]\nurls = [{urls}]\nstart_timeout = 5.0\n{key}")
        config, _ = load(LearnRunConfig, [toml])
        fleet_config = config.inference.fleet_config()
        assert fleet_config.abort_path == ("/abort_request" if key else None)
        assert config.inference.kind is FLEET
        async with FLEET.open(EngineSetup(tmp_path), fleet_config) as fleet:
            assert isinstance(fleet, EngineFleet)
            with trio.fail_after(20):
                with trio.move_on_after(0.5):  # cancelled while it streams
                    await fleet.generate(
                        GenerateRequest(
                            prompt_tokens=(5, 6),
                            params=SamplingParams(max_tokens=8),
                            request_id="r1",
                        )
                    )
                await fleet.abort_all()
                for _ in range(1000):  # the server notices the closed connection (20 ms poll)
                    if sum(state.disconnects for state, _ in ss):
                        break
                    await trio.sleep(0.01)
        sent = [aborts(state) for state, _ in ss]
    if key:
        assert sorted(map(str, sent)) == sorted(
            [str([{"rid": "r1"}, {"abort_all": True}]), str([{"abort_all": True}])]
        )
    else:
        assert sent == [[], []]
    assert sum(state.disconnects for state, _ in ss) == 1  # the cancelled request's
