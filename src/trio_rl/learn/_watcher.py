"""The weight watcher: a newly published version reaches every engine before it counts."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from ..engines import EngineError, WeightLoader
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._weights import PublishedWeights, latest_weights

__all__ = ["watch_weights"]

logger = logging.getLogger("trio_rl.learn")


async def watch_weights(
    root: str | os.PathLike[str],
    engines: Sequence[WeightLoader],
    set_policy_version: Callable[[PolicyVersion], None] | PolicyVersionCell,
    *,
    current: PolicyVersion | None = None,
    poll_interval: float = 0.02,
    on_loaded: Callable[[PublishedWeights], None] | None = None,
) -> None:
    """Poll ``root`` for published weights; load each newer version into every engine, then call
    ``set_policy_version`` (e.g. :meth:`Orchestrator.set_policy_version`), or advance the run's
    :class:`~trio_rl.policy.PolicyVersionCell` when given one (``current`` then defaults to the
    cell's version; otherwise to 0). Engines sharing that cell would advance it on their own
    load, before every engine has the weights: give loading engines their own cells.

    Only the newest version is loaded when several appeared between two polls. A version that
    cannot be loaded (e.g. pruned while being read) is logged and retried at the next poll.
    Runs until cancelled; cancellation during a load leaves the engines on the weights they had
    and the policy version where it was.
    """
    where = Path(root)
    if isinstance(set_policy_version, PolicyVersionCell):
        cell = set_policy_version
        report: Callable[[PolicyVersion], object] = cell.advance
        current = cell.value if current is None else current
    else:
        report = set_policy_version
    current = 0 if current is None else current
    while True:
        latest = await trio.to_thread.run_sync(latest_weights, where)
        if latest is not None and latest.version > current:
            try:
                for engine in engines:
                    await engine.load_weights(latest.path, latest.version)
            except EngineError as exc:
                logger.warning("could not load weights %s: %s", latest.path, exc)
            else:
                current = latest.version
                report(current)
                if on_loaded is not None:
                    on_loaded(latest)
        await trio.sleep(poll_interval)
