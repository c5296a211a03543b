"""The weight watcher: a newly published version reaches every engine before it counts; with
the run's evals, it also evaluates each version an eval is due for before loading another."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from ..engines import EngineError, WeightLoader
from ..evals import RunEvals, VersionPin
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._weights import PublishedWeights, published_weights

__all__ = ["watch_weights"]

logger = logging.getLogger("trio_rl.learn")


def _pick(
    published: list[PublishedWeights], current: PolicyVersion, evals: RunEvals | None
) -> PublishedWeights | None:
    """The version to load next: the newest, or with evals the oldest one an eval is due
    for (so none is skipped)."""
    newer = [w for w in published if w.version > current]
    if not newer:
        return None
    if evals is None:
        return newer[-1]
    target = evals.target(current, [w.version for w in newer])
    return next(w for w in newer if w.version == target)


async def watch_weights(
    root: str | os.PathLike[str],
    engines: Sequence[WeightLoader],
    set_policy_version: Callable[[PolicyVersion], None] | PolicyVersionCell,
    *,
    current: PolicyVersion | None = None,
    poll_interval: float = 0.02,
    on_loaded: Callable[[PublishedWeights], None] | None = None,
    evals: RunEvals | None = None,
) -> None:
    """Poll ``root`` for published weights; load each newer version into every engine, then call
    ``set_policy_version`` (e.g. :meth:`Orchestrator.set_policy_version`), or advance the run's
    :class:`~trio_rl.policy.PolicyVersionCell` when given one (``current`` then defaults to the
    cell's version; otherwise to 0). Engines sharing that cell would advance it on their own
    load, before every engine has the weights: give loading engines their own cells.

    Only the newest version is loaded when several appeared between two polls, except with
    ``evals`` (the run's :class:`~trio_rl.evals.RunEvals`): then the oldest newer version an
    eval is due for is loaded next, and evaluated (:meth:`RunEvals.evaluate`) before anything
    else is loaded, so the engines serve that one version for the whole eval; each load holds
    the evals' pin. A version that cannot be loaded (e.g. pruned while being read) is logged
    and retried at the next poll. Runs until cancelled; cancellation during a load leaves the
    engines on the weights they had and the policy version where it was.
    """
    where = Path(root)
    if isinstance(set_policy_version, PolicyVersionCell):
        cell = set_policy_version
        report: Callable[[PolicyVersion], object] = cell.advance
        current = cell.value if current is None else current
    else:
        report = set_policy_version
    current = 0 if current is None else current
    pin = evals.pin if evals is not None else VersionPin()  # without evals: never contended
    while True:
        if evals is not None and evals.wants(current):
            await evals.evaluate(current)
        published = await trio.to_thread.run_sync(published_weights, where)
        latest = _pick(published, current, evals)
        if latest is not None and evals is not None:
            # due versions older than the one loaded whose weights are gone: never served
            have = {w.version for w in published}
            gone = [v for v in range(current + 1, latest.version) if v not in have]
            await evals.skipped(gone, "its weights were pruned before they were loaded")
        if latest is not None:
            async with pin.loading(f"the load of version {latest.version}"):
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
                    if evals is not None and evals.wants(current):
                        # still under the load's pin: no publication comes in between, so a
                        # stop mid-eval resumes at this version and can redo the eval
                        await evals.evaluate(current, held=True)
        await trio.sleep(poll_interval)
