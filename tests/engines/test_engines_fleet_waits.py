"""The fleet's waits and retries (docs/operations.md, "Waits and retries") against real
loopback servers (``vllm_stand_in``): a request with no live server says so once per 10 s for
all the requests waiting and fails at ``wait_for_server``; a request whose servers fail is
tried on at most ``max_attempts`` servers, each taken out with a WARNING. The clock is virtual
and moves only when a test moves it: the servers answer in real time, the waits do not."""

from __future__ import annotations

import logging
from contextlib import ExitStack

import pytest
import trio
import trio.testing
from test_engines_fleet import req
from vllm_stand_in import serve

from operations_waits import documented
from trio_rl.engines import EngineTransportError, open_engine_fleet

#: no probes while a test runs (it moves the clock by less): only requests take servers out
QUIET = {"probe_interval": 3600.0, "start_timeout": 5.0, "timeout": 1000.0}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_requests_with_no_live_server_say_so_every_10_s_and_fail_at_wait_for_server(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with ExitStack() as stack:
        _, url = stack.enter_context(serve())
        async with open_engine_fleet([url], wait_for_server=25.0, **QUIET) as fleet:
            stack.close()
            fleet.take_out(url, "its process exited")
            failed: dict[str, str] = {}
            cancelled: list[bool] = []

            async def one(i: int) -> None:
                with pytest.raises(EngineTransportError) as info:
                    await fleet.generate(req(i))
                failed[f"r{i}"] = str(info.value)

            async def given_up_at_12_s() -> None:
                with trio.move_on_after(12) as scope:
                    await fleet.generate(req(9))
                cancelled.append(scope.cancelled_caught)

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
                nursery.start_soon(given_up_at_12_s)
                for jump in (10.0, 2.0, 8.0, 4.9):
                    await trio.testing.wait_all_tasks_blocked()
                    mock_clock.jump(jump)
                await trio.testing.wait_all_tasks_blocked()
                assert failed == {}, "given up before wait_for_server"
                mock_clock.jump(0.1)
            assert trio.current_time() - start == pytest.approx(25)
            stats = fleet.statistics()
    assert cancelled == [True]  # the cancelled wait ended at 12 s, without an error
    assert sorted(failed) == ["r0", "r1", "r2"]
    assert failed["r0"] == f"request 'r0': no server of ['{url}'] was live for 25.0s"
    assert stats["failed"] == 3
    lines = [line for line in _warnings(caplog) if "still waiting" in line]
    # one line per 10 s for the four requests waiting, with the time left
    assert lines == [
        f"still waiting for a live inference server (none of ['{url}'] is live; requests "
        f"wait) after {after} s, giving up in {left} s"
        for after, left in ((10, 15), (20, 5))
    ]
    documented("a request with no server live", lines[0])


async def test_a_request_is_tried_on_at_most_max_attempts_servers_each_failing_taken_out(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with serve() as (_, c), ExitStack() as dead:
        (_, a), (_, b) = (dead.enter_context(serve()) for _ in range(2))
        async with open_engine_fleet([a, b, c], max_attempts=2, **QUIET) as fleet:
            dead.close()  # a and b go away: their ports refuse connections
            # least loaded, in order: a, then b; two servers tried, c never
            with pytest.raises(EngineTransportError) as info:
                await fleet.generate(req(0))
            taken_out = _warnings(caplog)
            live = fleet.live()
            again = await fleet.generate(req(1))  # c is left, and takes the next one
            stats = fleet.statistics()
    message = str(info.value)
    assert message.startswith("request 'r0' failed on 2 servers: ")
    assert a in message
    assert b in message
    assert c not in message
    assert live == [c]
    assert again.finish_reason == "stop"
    assert (stats["failed"], stats["retried"], stats["taken_out"]) == (1, 1, 2)
    assert [line.split(" taken out: ")[0] for line in taken_out] == [
        f"inference server {a}",
        f"inference server {b}",
    ]
    documented("a request whose server fails", taken_out[0])
    documented("a request whose server fails", message, 1)
