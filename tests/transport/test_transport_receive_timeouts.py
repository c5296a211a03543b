"""Every receive path has a deadline: `MemoryReceiver` like `FileReceiver` (timeout and a log
line while it waits), and `BatchReceiver.zmq` through the receive call's cancel scope."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import trio
import trio.testing

from operations_waits import documented
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import (
    FileReceiver,
    MemorySender,
    TransportTimeoutError,
    _wait,
    free_port_pair,
)
from trio_rl.wire import encode


async def test_memory_receiver_times_out_and_logs_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_wait, "WAIT_LOG_INTERVAL", 0.05)
    caplog.set_level(logging.INFO, logger="trio_rl.transport")
    async with MemorySender(2) as sender:
        receiver = sender.receiver(1, timeout=0.3)
        with trio.fail_after(5), pytest.raises(TransportTimeoutError) as info:
            await receiver.receive()
        assert "memory rank 1: no step 0 after waiting 0.3 s" in str(info.value)
        assert receiver.next_step == 0
        waits = [r for r in caplog.records if "still waiting" in r.getMessage()]
        assert len(waits) >= 2
        # nothing was lost: the step sent afterwards is the next one received
        await sender.send(0, [b"a", b"b"])
        with trio.fail_after(5):
            got = await receiver.receive()
    assert (got.step, got.data) == (0, b"b")


async def test_memory_receiver_without_timeout_waits_until_cancelled() -> None:
    async with MemorySender(1) as sender:
        receiver = sender.receiver(0)
        with trio.move_on_after(0.2) as scope:
            await receiver.receive()
        assert scope.cancelled_caught
        with pytest.raises(ValueError, match="timeout"):
            sender.receiver(0, timeout=-1)


async def test_a_wait_without_a_deadline_is_told_at_info_not_warned_about(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # a trainer whose rollouts take longer than its steps waits like this every step: the
    # line is there for whoever looks, but it is no warning; with a deadline it is one
    caplog.set_level(logging.INFO, logger="trio_rl.transport")
    endless, bounded = _wait.Wait(math.inf, "endless"), _wait.Wait(600.0, "bounded")
    for _ in range(2):
        await trio.sleep(10)
        assert endless.remaining() == math.inf
        assert bounded.remaining() > 0
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.INFO, "endless: still waiting after 10 s, giving up never"),
        (logging.WARNING, "bounded: still waiting after 10 s, giving up in 590 s"),
        (logging.INFO, "endless: still waiting after 20 s, giving up never"),
        (logging.WARNING, "bounded: still waiting after 20 s, giving up in 580 s"),
    ]


async def test_batch_receiver_over_zeromq_times_out_and_loses_nothing() -> None:
    from trio_rl.transport import ZmqSender

    port = free_port_pair()
    with trio.fail_after(30):
        async with BatchReceiver.zmq(0, port=port, timeout=0.3) as receiver:
            with pytest.raises(TransportTimeoutError) as info:
                await receiver.receive()
            assert "rank 0: no payload for step 0" in str(info.value)
            assert receiver.next_step == 0
            async with ZmqSender(1, port=port) as sender:
                await sender.send(0, [encode([])])
                step, micro_batches = await receiver.receive()
    assert (step, micro_batches) == (0, [])


async def test_a_missing_batch_file_is_logged_every_10_s_and_fails_at_the_timeout(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_rl.transport")
    async with FileReceiver(tmp_path, 0, start_step=3, timeout=600.0) as receiver:
        path = receiver.path(3)
        start = trio.current_time()
        with pytest.raises(TransportTimeoutError) as info:
            await receiver.receive()
        # the budget, the transport's timeout, to the poll (0.5 s at most)
        assert 600 <= trio.current_time() - start <= 600.5
        assert str(info.value) == f"rank 0: no batch file {path} for step 3 after waiting 600 s"
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 59  # at 10, 20, ... 590 s
        assert lines[0] == (
            f"rank 0: no batch file {path} for step 3: still waiting after 10 s, giving up in 590 s"
        )
        documented("receiving a batch", lines[0])
        # cancelled, the wait ends at once and the step is still the next one
        caplog.clear()
        with trio.move_on_after(15) as scope:
            await receiver.receive()
        assert scope.cancelled_caught
        assert len(caplog.records) == 1
        assert receiver.next_step == 3
