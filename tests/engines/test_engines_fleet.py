"""EngineFleet against real loopback HTTP servers (``vllm_stand_in``, one thread each):
balancing, taking a server out and back in, weight loads, deadlines and cancellation."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import trio
from vllm_stand_in import StandIn, serve

from operations_waits import documented
from trio_rl.engines import (
    AbortSignal,
    EngineConfigError,
    EngineFleet,
    EngineTimeoutError,
    EngineTransportError,
    GenerateRequest,
    SamplingParams,
    open_engine_fleet,
)
from trio_rl.errors import InvalidArgumentError

FAST = {"probe_interval": 0.05, "probe_timeout": 0.5, "start_timeout": 5.0}


@contextmanager
def servers(n: int) -> Iterator[list[tuple[StandIn, str]]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve()) for _ in range(n)]


def req(i: int, key: str | None = None, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        prompt_tokens=(100 + i, 7),
        params=SamplingParams(max_tokens=8, seed=i),
        routing_key=key,
        request_id=f"r{i}",
        **kw,
    )


def completions(state: StandIn) -> list[dict[str, Any]]:
    return [body for _, path, body in state.requests if path == "/v1/completions"]


def paths(state: StandIn) -> list[str]:
    return [path for _, path, _ in state.requests if path != "/health"]


async def test_a_group_s_samples_go_to_one_server_and_groups_spread() -> None:
    with servers(2) as ss:
        for state, _ in ss:
            state.step_delay = 0.01
            state.lengths = [3]
        async with open_engine_fleet([u for _, u in ss], **FAST) as fleet:
            async with trio.open_nursery() as nursery:
                for g in range(6):
                    for i in range(4):
                        nursery.start_soon(fleet.generate, req(g * 10 + i, key=f"group-{g}"))
            stats = fleet.statistics()
    assert stats["requests"] == 24
    assert stats["retried"] == 0
    where: dict[str, set[int]] = {}
    for n, (state, _) in enumerate(ss):
        for (_, path, _), headers in zip(state.requests, state.headers, strict=True):
            if path == "/v1/completions":
                where.setdefault(headers["x-smg-routing-key"], set()).add(n)
    assert len(where) == 6
    assert all(len(on) == 1 for on in where.values())  # a group on one server ...
    # ... and groups spread (a group goes to the server with fewer requests in flight when its
    # first sample arrives)
    assert set(Counter(next(iter(on)) for on in where.values())) == {0, 1}


async def test_least_loaded_balancing_without_keys() -> None:
    with servers(2) as ss:
        ss[0][0].step_delay = 5.0  # the first server is slow: its request stays in flight
        ss[0][0].lengths = [3]
        async with (
            open_engine_fleet([u for _, u in ss], **FAST) as fleet,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(fleet.generate, req(0))
            await trio.sleep(0.05)
            for i in range(1, 6):
                await fleet.generate(req(i))  # the other server is always less loaded
            nursery.cancel_scope.cancel()
    assert len(completions(ss[0][0])) == 1
    assert len(completions(ss[1][0])) == 5


async def test_a_dead_server_is_taken_out_and_its_requests_retried_elsewhere() -> None:
    with serve() as (alive, alive_url):
        dead_stack = ExitStack()
        dead, dead_url = dead_stack.enter_context(serve())
        async with open_engine_fleet([dead_url, alive_url], **FAST) as fleet:
            dead_stack.close()  # the server goes away: its port refuses connections
            results = [await fleet.generate(req(i, key=f"k{i}")) for i in range(6)]
            assert all(r.finish_reason == "stop" for r in results)
            stats = fleet.statistics()
            status = {s.url: s for s in fleet.servers()}
            assert fleet.live() == [alive_url]
    assert stats["taken_out"] == 1
    assert stats["retried"] >= 1
    # every failed attempt was the dead server's and was retried (a request on a connection
    # the live server had closed is sent again by that server's engine: no failure)
    assert stats["retried"] == status[dead_url].failures
    assert status[alive_url].failures == 0
    assert stats["failed"] == 0
    assert status[dead_url].state == "out"
    assert len(completions(alive)) == 6
    assert completions(dead) == []


async def test_a_request_on_a_connection_the_server_closed_stays_on_that_server() -> None:
    with servers(2) as ss:
        async with open_engine_fleet([u for _, u in ss], **FAST) as fleet:
            await fleet.generate(req(0, key="g"))  # the key's server from now on
            (home,) = [s for s, _ in ss if completions(s)]
            # the server closes the pooled connection under the next request, as uvicorn
            # does with an idle keep-alive connection
            home.drop_next = 1
            again = await fleet.generate(req(1, key="g"))
            stats = fleet.statistics()
            status = fleet.servers()
            live = fleet.live()
            events = [(e.kind, e.detail) for e in fleet.events()]
    assert again.finish_reason == "stop"
    assert (stats["retried"], stats["taken_out"], stats["failed"]) == (0, 0, 0), events
    assert all(s.failures == 0 for s in status)
    assert len(live) == 2
    # the first request, the dropped one and the same request sent again: all on one server
    assert [b["prompt"] for b in completions(home)] == [[100, 7], [101, 7], [101, 7]]
    assert sum(len(completions(s)) for s, _ in ss) == 3


async def test_a_hanging_server_is_taken_out_by_the_probes_and_its_requests_move() -> None:
    with servers(2) as ss:
        (slow, slow_url), (_, fast_url) = ss
        async with open_engine_fleet([slow_url, fast_url], **FAST) as fleet:
            slow.delay = 3.0  # every answer, /health too, now takes 3 s: it stopped answering
            slow.lengths = [3]
            with trio.fail_after(2.5):  # well before the slow server would answer
                first = await fleet.generate(req(0))  # least loaded: the slow server first
            assert first.finish_reason == "stop"
            stats = fleet.statistics()
            events = [(e.url, e.kind) for e in fleet.events()]
            slow.delay = 0.0
    assert stats["retried"] == 1
    assert stats["taken_out"] == 1
    assert (slow_url, "out") in events
    assert "health probes in a row failed" in fleet.events()[0].detail


async def test_a_server_comes_back_only_after_loading_the_current_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with servers(2) as ss:
        (a, a_url), (_, b_url) = ss
        async with open_engine_fleet([a_url, b_url], **FAST) as fleet:
            await fleet.load_weights("/weights/v1", 1)
            a.delay = 3.0
            await fleet.wait_live([b_url], timeout=10)
            await fleet.load_weights("/weights/v2", 2)  # a is out: only b loads
            before = len(a.requests)
            a.delay = 0.0
            await fleet.wait_live([a_url, b_url], timeout=10)
            after = [(path, body) for _, path, body in a.requests[before:] if path != "/health"]
            await fleet.generate(req(1, key="x"))
            events = [(e.url, e.kind, e.version) for e in fleet.events()]
    reload = (
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": "/weights/v2"}},
    )
    assert after[:2] == [reload, ("/reset_prefix_cache", None)]
    assert events.index((a_url, "loaded", 2)) < events.index((a_url, "in", 2))
    assert fleet.version.value == 2
    # the probes' take-out and take-in, each said once, as docs/operations.md quotes them
    lines = [r.getMessage() for r in caplog.records if a_url in r.getMessage()]
    assert lines == [
        f"inference server {a_url} taken out: 2 health probes in a row failed",
        f"inference server {a_url} taken back in (weights of version 2)",
    ]
    documented("the fleet's probes", lines[0])
    documented("the fleet's probes", lines[1], 2)


async def test_a_new_version_counts_once_every_live_server_loaded_it() -> None:
    with servers(2) as ss:
        (a, a_url), (b, b_url) = ss
        b.delay = 0.3  # b reloads slowly
        async with open_engine_fleet(
            [a_url, b_url], probe_timeout=2.0, probe_interval=0.05
        ) as fleet:
            seen: list[int] = []

            async def watch() -> None:
                while True:
                    seen.append(fleet.version.value)
                    await trio.sleep(0.02)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.sleep(0.05)
                async with trio.open_nursery() as loading:
                    loading.start_soon(fleet.load_weights, "/w/7", 7)
                    await trio.sleep(0.3)  # a has loaded, b not yet
                    assert fleet.version.value == 0
                assert fleet.version.value == 7
                nursery.cancel_scope.cancel()
            stats = fleet.statistics()
    for state in (a, b):
        assert paths(state)[-2:] == ["/collective_rpc", "/reset_prefix_cache"]
    assert stats["weight_loads"] == 1
    assert seen[0] == 0


async def test_a_completion_is_stamped_with_the_version_current_when_it_was_sent() -> None:
    with servers(1) as ss:
        ((a, url),) = ss
        a.step_delay, a.lengths = 0.2, [3]
        async with open_engine_fleet([url], **FAST) as fleet:
            got: list[int] = []

            async def one() -> None:
                got.append((await fleet.generate(req(0))).policy_version)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                await trio.sleep(0.1)
                await fleet.load_weights("/w/1", 1)
            assert got == [0]  # sent before version 1 counted
            assert (await fleet.generate(req(1))).policy_version == 1


async def test_a_server_failing_its_reload_is_taken_out_and_the_version_counts() -> None:
    with servers(2) as ss:
        (a, a_url), (_, b_url) = ss
        a.override["/collective_rpc"] = (503, b"engine dead")
        async with open_engine_fleet([a_url, b_url], **{**FAST, "probe_interval": 10.0}) as fleet:
            await fleet.load_weights("/w/3", 3)
            assert fleet.version.value == 3
            assert fleet.live() == [b_url]


async def test_a_refused_reload_raises_and_the_version_stays() -> None:
    with servers(1) as ss:
        ((a, url),) = ss
        a.override["/collective_rpc"] = (400, b"no such directory")
        async with open_engine_fleet([url], **FAST) as fleet:
            with pytest.raises(Exception, match="no such directory"):
                await fleet.load_weights("/w/3", 3)
            assert fleet.version.value == 0


async def test_no_live_server_fails_the_request_after_its_wait() -> None:
    with ExitStack() as stack:
        _, url = stack.enter_context(serve())
        async with open_engine_fleet([url], wait_for_server=0.3, **FAST) as fleet:
            stack.close()
            with trio.fail_after(5), pytest.raises(EngineTransportError, match="no server"):
                await fleet.generate(req(0))
            with pytest.raises(EngineTransportError, match="no live server loaded"):
                await fleet.load_weights("/w/1", 1)
            assert fleet.statistics()["failed"] == 1


async def test_an_abort_while_waiting_for_a_server_returns_an_empty_abort() -> None:
    with ExitStack() as stack:
        _, url = stack.enter_context(serve())
        async with open_engine_fleet([url], wait_for_server=30, **FAST) as fleet:
            stack.close()
            await fleet.wait_live([], timeout=5)  # the probes take the server out
            signal = AbortSignal()
            got = []
            async with trio.open_nursery() as nursery:

                async def one() -> None:
                    got.append(await fleet.generate(req(1, abort=signal)))

                nursery.start_soon(one)
                await trio.sleep(0.1)
                signal.set()
            assert got[0].finish_reason == "abort"
            assert got[0].tokens == []


async def test_an_unreachable_server_at_start_is_named() -> None:
    with serve() as (_, url):
        dead = "http://127.0.0.1:9"
        with trio.fail_after(10), pytest.raises(EngineTimeoutError, match=r"127\.0\.0\.1:9/health"):
            async with open_engine_fleet([url, dead], start_timeout=0.5):
                pass


async def test_servers_that_disagree_on_the_model_are_refused() -> None:
    with servers(2) as ss:
        ss[1][0].model = "another"
        with pytest.raises(EngineConfigError, match="disagree on the model"):
            async with open_engine_fleet([u for _, u in ss], **FAST):
                pass
        ss[1][0].model = "stand-in"
        with pytest.raises(EngineConfigError, match="not the model 'mine'"):
            async with open_engine_fleet([u for _, u in ss], model="mine", **FAST):
                pass


async def test_cancelling_a_request_leaves_nothing_in_flight() -> None:
    with servers(1) as ss:
        ((a, url),) = ss
        a.step_delay, a.lengths = 1.0, [5]
        async with open_engine_fleet([url], **FAST) as fleet:
            with trio.move_on_after(0.2) as scope:
                await fleet.generate(req(0))
            assert scope.cancelled_caught
            assert fleet.servers()[0].in_flight == 0
            assert fleet.live() == [url]  # a cancelled request is not a server failure


async def test_a_cancelled_load_leaves_the_version() -> None:
    with servers(1) as ss:
        ((a, url),) = ss
        a.delay = 1.0
        async with open_engine_fleet([url], probe_timeout=5.0, probe_interval=0.05) as fleet:
            with trio.move_on_after(0.2):
                await fleet.load_weights("/w/1", 1)
            assert fleet.version.value == 0
            a.delay = 0.0


async def test_outside_its_block_the_fleet_is_closed() -> None:
    with servers(1) as ss:
        async with open_engine_fleet([ss[0][1]], **FAST) as fleet:
            pass
        with pytest.raises(trio.ClosedResourceError):
            await fleet.generate(req(0))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        EngineFleet(["ftp://x"])
    with pytest.raises(InvalidArgumentError):
        EngineFleet(["http://x"], probe_interval=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_fleet_starts_with_min_servers_and_takes_in_the_missing_one() -> None:
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"
    with servers(2) as ss:
        urls = [ss[0][1], late_url, ss[1][1]]
        with trio.fail_after(20):
            async with open_engine_fleet(urls, min_servers=2, **FAST) as fleet:
                assert fleet.live() == [ss[0][1], ss[1][1]]
                assert [s.state for s in fleet.servers()] == ["live", "out", "live"]
                await fleet.load_weights("/weights/v1", 1)
                for i in range(4):
                    await fleet.generate(req(i))
                with serve(port) as (late, _):
                    await fleet.wait_live(urls, timeout=10)
                    for i in range(4, 10):
                        await fleet.generate(req(i))
                    assert completions(late)
                    reload = (
                        "/collective_rpc",
                        {"method": "reload_weights", "kwargs": {"weights_path": "/weights/v1"}},
                    )
                    assert [(p, b) for _, p, b in late.requests if p != "/health"][:3] == [
                        ("/v1/models", None),
                        reload,
                        ("/reset_prefix_cache", None),
                    ]
                events = [(e.url, e.kind) for e in fleet.events()]
    assert events.index((late_url, "out")) < events.index((late_url, "in"))
    assert fleet.servers()[1].taken_in == 1


async def test_a_late_server_serving_another_model_stays_out() -> None:
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"
    with servers(1) as ss:
        with trio.fail_after(20):
            async with open_engine_fleet([ss[0][1], late_url], min_servers=1, **FAST) as fleet:
                other = StandIn()
                other.model = "another"
                with serve(port, other):
                    with trio.fail_after(10):
                        while not any(e.kind == "refused" for e in fleet.events()):  # noqa: ASYNC110 - events are a log, not a signal
                            await trio.sleep(0.05)
                    await trio.sleep(0.3)  # more probes: it must stay out
                    assert fleet.live() == [ss[0][1]]
                    assert not completions(other)
                refused = [e for e in fleet.events() if e.kind == "refused"]
    assert len(refused) == 1  # reported once, not at every probe
    assert refused[0].url == late_url
    assert "another" in refused[0].detail


async def test_too_few_servers_at_start_fail_naming_the_missing_ones() -> None:
    missing = f"http://127.0.0.1:{free_port()}"
    with servers(2) as ss:
        urls = [ss[0][1], missing, ss[1][1]]
        with (
            trio.fail_after(10),
            pytest.raises(EngineTimeoutError, match=rf"missing: \['{missing}'\]"),
        ):
            async with open_engine_fleet(urls, min_servers=3, start_timeout=0.5):
                pass


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_min_servers_outside_one_to_the_number_of_urls_is_refused(bad: int) -> None:
    with pytest.raises(EngineConfigError, match=r"min_servers .* 1\.\.3"):
        EngineFleet(["http://a", "http://b", "http://c"], min_servers=bad)
