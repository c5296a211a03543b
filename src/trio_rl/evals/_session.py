"""`RunEvals`: the evals of one training run, each of one policy version, each recorded once.

The run's weight loader drives it (see docs/evaluation.md): it asks :meth:`RunEvals.target`
which published version to load next (the oldest one an eval is due for, so none is skipped),
loads it under the :class:`VersionPin`, and when :meth:`RunEvals.wants` that version, awaits
:meth:`RunEvals.evaluate` before it loads anything else. The engines therefore serve that one
version for the whole eval, while training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import attrs
import trio

from ..samples import PolicyVersion, Prompt
from ._config import EvalConfig
from ._journal import EvalJournal, PendingEval
from ._pin import VersionPin
from ._result import EvalResult
from ._runner import EvalProgress, EvalRunner

__all__ = ["EvalReport", "RunEvals"]

logger = logging.getLogger("trio_rl.evals")

#: Told each eval's result once it is in ``eval.jsonl`` (sinks, the console); awaited.
EvalReport = Callable[[EvalResult], Awaitable[None]]


@attrs.define(slots=True, eq=False, kw_only=True)
class RunEvals:
    """Which policy versions of a run are evaluated, and their evals (see the module docs).

    The step of an eval is the policy version it evaluates (the trained steps behind it).
    ``report`` is told every result written (a dropped eval's too); ``progress`` every
    prompt finished.
    """

    config: EvalConfig
    runner: EvalRunner
    prompts: Sequence[Prompt]
    journal: EvalJournal
    pin: VersionPin = attrs.field(factory=VersionPin)
    report: EvalReport | None = None
    progress: EvalProgress | None = None
    _recorded: set[int] = attrs.field(factory=set, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    async def open(self, served: PolicyVersion) -> None:
        """Read the run directory's evals; settle an eval a kill cut short.

        ``served`` is the version the engines serve as the run (re)starts. Under
        ``on_resume = "redo"`` an interrupted eval of that version is done again (it is due
        and has no record: the loader's first :meth:`wants` says so); of an older version, or
        under ``"drop"``, it is recorded as dropped, never silently lost.
        """
        self._recorded = await trio.to_thread.run_sync(self.journal.steps)
        pending = await trio.to_thread.run_sync(self.journal.interrupted)
        if pending is None:
            return
        if self.config.on_resume == "redo" and pending.step == served:
            logger.info("the eval of step %d was cut short by a stop: it is redone", served)
            return
        why = (
            "on_resume is drop"
            if self.config.on_resume == "drop"
            else f"its policy (version {pending.step}) is no longer served (version {served})"
        )
        logger.warning(
            "the eval of step %d was cut short by a stop: dropped (%s)", pending.step, why
        )
        await self._drop(pending)

    def wants(self, version: PolicyVersion) -> bool:
        """Whether ``version`` is due for an eval that has no record yet."""
        return self.config.due(version) and version not in self._recorded

    def target(self, current: PolicyVersion, available: Iterable[PolicyVersion]) -> int | None:
        """The published version to load after ``current``: the oldest newer one an eval is
        due for, else the newest (None: nothing newer)."""
        newer = sorted(v for v in available if v > current)
        if not newer:
            return None
        return next((v for v in newer if self.wants(v)), newer[-1])

    async def skipped(self, versions: Iterable[PolicyVersion], why: str) -> None:
        """Record due evals whose versions will never be served (their weights were pruned
        before the loader got to them) as dropped."""
        for v in versions:
            if self.wants(v):
                logger.warning("the eval of step %d is dropped: %s", v, why)
                await self._drop(PendingEval(v, v, self.config.k))

    async def evaluate(
        self, version: PolicyVersion, *, deadline: float | None = None, held: bool = False
    ) -> EvalResult:
        """Evaluate the served ``version`` under the pin and record it; the eval is cut after
        the config's ``timeout`` (or ``deadline`` seconds, if sooner). ``held``: the caller
        holds the pin already (the loader that just loaded ``version``, so that nothing, not
        even a publication, comes between the load and the eval). Cancelled, it records
        nothing and leaves its marker: a resumed run redoes or drops it."""
        if held:
            return await self._evaluate(version, deadline)
        async with self.pin.pinned(f"the eval of step {version}"):
            return await self._evaluate(version, deadline)

    async def _evaluate(self, version: PolicyVersion, deadline: float | None) -> EvalResult:
        limit = self.config.timeout if deadline is None else min(deadline, self.config.timeout)
        await trio.to_thread.run_sync(
            self.journal.begin, PendingEval(version, version, self.config.k)
        )
        result = await self.runner.run(
            self.prompts,
            step=version,
            deadline=limit,
            policy_version=version,
            progress=self.progress,
        )
        await self._record(result)
        return result

    async def cut(self, version: PolicyVersion) -> None:
        """Record the eval of ``version`` as cut without figures: the run ended before its
        engines served that version (a run's last eval that could not start in time)."""
        if self.wants(version):
            logger.warning("the eval of step %d could not run before the run's end: cut", version)
            await self._record(
                EvalResult(step=version, policy_version=None, k=self.config.k, status="cut")
            )

    async def wait_recorded(self, version: PolicyVersion) -> None:
        """Wait until ``version`` needs no eval (recorded, or never due)."""
        while self.wants(version):
            logger.debug("waiting for the eval of step %d", version)
            await self._changed.wait()

    async def _drop(self, pending: PendingEval) -> None:
        await trio.to_thread.run_sync(self.journal.drop, pending)
        dropped = EvalResult(
            step=pending.step, policy_version=pending.policy_version, k=pending.k, status="dropped"
        )
        await self._recorded_now(dropped)

    async def _record(self, result: EvalResult) -> None:
        # shielded: a result computed is written, even by a run being stopped
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.journal.finish, result)
        await self._recorded_now(result)

    async def _recorded_now(self, result: EvalResult) -> None:
        self._recorded.add(result.step)
        self._changed.set()
        self._changed = trio.Event()
        if self.report is not None:
            await self.report(result)
