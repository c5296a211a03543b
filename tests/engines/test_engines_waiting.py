"""Waiting for a server is never silent: the first failed attempt is logged at once with why,
then every 10 s with the time left; attempts back off; the deadline names the last reason; a
process that exits ends the wait; requests that wait for a live server say so once per 10 s."""

from __future__ import annotations

import itertools
import logging
import re
import socket

import pytest
import trio
import trio.testing

from operations_waits import documented
from trio_rl.engines import EngineTimeoutError, VLLMAdmin
from trio_rl.engines._waiting import LogThrottle, wait_logged, wait_until_up


def _waiting_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "waiting for" in r.getMessage()]


async def test_a_server_that_never_answers_is_logged_at_once_then_every_10_s(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    attempts: list[float] = []

    async def refused() -> str:
        attempts.append(trio.current_time())
        return "connection refused"

    start = trio.current_time()
    with pytest.raises(EngineTimeoutError) as info:
        await wait_until_up(refused, "http://127.0.0.1:9/health", 45.0)
    assert trio.current_time() - start == pytest.approx(45.0)
    assert "http://127.0.0.1:9/health did not answer within 45.0s" in str(info.value)
    assert "the last: connection refused" in str(info.value)
    lines = _waiting_lines(caplog)
    # at once, then every 10 s: 0, ~10, ~20, ~30, ~40
    assert lines[0].levelno == logging.WARNING
    assert lines[0].created <= lines[-1].created
    assert lines[0].getMessage() == (
        "waiting for http://127.0.0.1:9/health (connection refused, 1 attempt), giving up in 45 s"
    )
    assert 4 <= len(lines) <= 5
    # each line at the first attempt 10 s or more after the previous line
    assert re.search(r"attempts\), giving up in 3\d s$", lines[1].getMessage())
    # backoff: the pauses grow to the cap (2 s), far fewer attempts than one per 0.25 s
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] == pytest.approx(0.25)
    assert max(gaps) == pytest.approx(2.0)
    assert len(attempts) < 45 / 2 + 6


async def test_a_server_that_comes_up_ends_the_wait_and_says_so(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")

    async def up_after_5_s() -> str | None:
        return None if trio.current_time() >= 5 else "HTTP 503"

    await wait_until_up(up_after_5_s, "a server", 60.0)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("waiting for a server (HTTP 503, 1 attempt)")
    assert messages[-1].startswith("a server is up after")
    documented("opening a fleet", messages[-1], 1)


async def test_a_process_that_exits_ends_the_wait_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    exited: list[str] = []

    async def refused() -> str:
        return "connection refused"

    async def exit_at_3_s() -> None:
        await trio.sleep(3)
        exited.append("exited")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(exit_at_3_s)
        await wait_until_up(refused, "a server", 600.0, gone=lambda: exited[0] if exited else None)
    assert trio.current_time() < 10


async def test_a_refused_port_is_named_connection_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with VLLMAdmin(url) as admin:
        with pytest.raises(EngineTimeoutError, match="the last: connection refused"):
            await admin.wait_healthy(0.6, poll_interval=0.05)
    first = _waiting_lines(caplog)[0].getMessage()
    assert first.startswith(f"waiting for {url}/health (connection refused, 1 attempt)")
    documented("opening a fleet", first)


async def test_many_waits_sharing_a_throttle_log_once_per_10_s(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.engines")
    throttle = LogThrottle()
    never = trio.Event()
    results: list[bool] = []

    async def one() -> None:
        results.append(await wait_logged(never.wait, "a live server", 35.0, throttle=throttle))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one)
    assert results == [False] * 20
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # at 10, 20 and 30 s: one line each, not twenty
    assert lines[0] == "still waiting for a live server after 10 s, giving up in 25 s"


async def test_a_wait_that_ends_in_time_returns_true(
    autojump_clock: trio.testing.MockClock,
) -> None:
    done = trio.Event()

    async def set_later() -> None:
        await trio.sleep(12)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(set_later)
        assert await wait_logged(done.wait, "x", 60.0)
    assert trio.current_time() == pytest.approx(12)
