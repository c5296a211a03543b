"""A bad argument to any transport is an `InvalidArgumentError` (a ``TrioRLError`` and a
``ValueError``) whose message names the argument: one case per transport module."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from trio_rl.errors import InvalidArgumentError, TrioRLError
from trio_rl.transport import FileReceiver, FileSender, MemorySender, ZmqReceiver, ZmqSender

CASES: list[tuple[str, Callable[[Path], object], str]] = [
    ("memory", lambda _: MemorySender(0), "world_size must be >= 1, got 0"),
    ("wait", lambda _: MemorySender(1).receiver(0, timeout=-1.0), "timeout must be >= 0 seconds"),
    ("files", lambda d: FileSender(d, world_size=0), "world_size must be >= 1, got 0"),
    (
        "files",
        lambda d: FileReceiver(d, 0, poll_interval=0.0),
        "poll_interval must be > 0 and <= max_poll_interval",
    ),
    (
        "base",
        lambda d: FileSender(d, world_size=1, limiter=trio.CapacityLimiter(1)).use_limiter(
            trio.CapacityLimiter(1)
        ),
        "FileSender was given its own CapacityLimiter",
    ),
    ("zmq", lambda _: ZmqSender(1, hwm=0), "hwm must be >= 1, got 0"),
    ("zmq", lambda _: ZmqReceiver(0, port=0), "port must be in 1..65534"),
]


@pytest.mark.parametrize(("module", "make", "message"), CASES, ids=[c[0] for c in CASES])
async def test_a_bad_argument_is_an_invalid_argument_naming_it(
    tmp_path: Path, module: str, make: Callable[[Path], object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as info:
        make(tmp_path)
    assert isinstance(info.value, TrioRLError)
    assert isinstance(info.value, ValueError)
