"""Heartbeats between the orchestrator and the trainer job, which share only the run
directory: each side rewrites its heartbeat file every second (`beat`) and watches the other's
change (`watch_heartbeat`), failing when it has not changed for ``trainer.connect_timeout``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from ..transport import TransportTimeoutError
from ._run_io import write_atomic

__all__ = ["Heartbeat", "beat", "watch_heartbeat"]

logger = logging.getLogger("trio_rl.learn")


async def beat(path: Path, interval: float = 1.0) -> None:
    """Rewrite ``path`` with a new counter every ``interval`` seconds until cancelled: the
    other side of the run directory watches it change."""
    count = 0
    while True:
        count += 1
        text = json.dumps({"beat": count, "pid": os.getpid()})
        await trio.to_thread.run_sync(write_atomic, path, text)
        await trio.sleep(interval)


@attrs.frozen
class Heartbeat:
    """The other side's heartbeat a side watches: its file and how long it may stay unchanged,
    and the words of the log lines and the error: ``waiting`` (``waiting for the trainer
    job``), ``lost(started)`` (``the trainer job did not start``, or ``stopped``) and
    ``start`` (how to start that side)."""

    path: Path
    timeout: float
    #: The other side, as the log names it once its heartbeat changes (``the trainer job``).
    name: str
    waiting: str
    lost: Callable[[bool], str]
    start: str
    #: Polled each time: once True, the other side's silence is expected (it ended).
    ended: Callable[[], bool] | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


async def watch_heartbeat(heart: Heartbeat, log_every: float = 10.0) -> None:
    """Raise `TransportTimeoutError` when ``heart.path`` has not changed for ``heart.timeout``
    seconds (the other side never started, or stopped and was not restarted), logging what it
    waits for meanwhile. A heartbeat left by a side that is gone does not count: only a
    change does. Returns once ``heart.ended()``."""
    last = await trio.to_thread.run_sync(_read, heart.path)
    connected = False
    changed = trio.current_time()
    # logged every `log_every` s, and at least once before a short deadline
    log_every = min(log_every, heart.timeout / 2)
    next_log = changed + log_every
    while True:
        await trio.sleep(0.25)
        if heart.ended is not None and await trio.to_thread.run_sync(heart.ended):
            return
        now = trio.current_time()
        current = await trio.to_thread.run_sync(_read, heart.path)
        if current is not None and current != last:
            if not connected:
                logger.info("%s is up (%s)", heart.name, heart.path)
            connected, last, changed, next_log = True, current, now, now + log_every
            continue
        if now - changed >= heart.timeout:
            raise TransportTimeoutError(
                f"{heart.lost(connected)} in {heart.path} for {heart.timeout:g} s "
                f"(trainer.connect_timeout); start it with {heart.start} on a machine that "
                "sees the run directory"
            )
        if now >= next_log:
            logger.warning(
                "%s: no heartbeat in %s for %.0f s; failing in %.0f s (trainer.connect_timeout)",
                heart.waiting,
                heart.path,
                now - changed,
                heart.timeout - (now - changed),
            )
            next_log = now + log_every
