"""`Orchestrator`, the handle `open_orchestrator` yields, and `RunSummary`, what a run did."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import trio

from .._validation import check_at_least
from ..payloads import PayloadStore
from ..policy import PolicyVersionCell
from ..publish import (
    ProgressTotals,
    Publisher,
    ShipRecord,
)
from ..rollout import (
    AsyncRolloutDriver,
    DataSource,
    GroupFactory,
    SourceExhaustedError,
)
from ..samples import OpenGroup, PolicyVersion
from ..sink import (
    RestoreReport,
    SinkCounters,
    TrainSink,
)
from ._admission import StalenessAdmission
from ._config import OrchestratorConfig

logger = logging.getLogger("trio_rl.orchestrator")


@attrs.frozen
class RunSummary:
    """What :meth:`Orchestrator.run` did."""

    first_step: int
    last_step: int
    records: tuple[ShipRecord, ...]
    counters: SinkCounters
    resumed_groups: int
    restored_queued: int
    #: The data source ran dry before ``steps`` batches were shipped.
    exhausted: bool = False


class Orchestrator:
    """The handle :func:`open_orchestrator` yields.

    :func:`open_orchestrator` makes it from the run's parts and attaches the rollout driver and
    the publisher it opened for the block (`driver` and `publisher` fail outside it); nothing
    else sets its attributes.
    """

    def __init__(
        self,
        *,
        config: OrchestratorConfig,
        sink: TrainSink,
        factory: GroupFactory,
        source: DataSource,
        policy_version: PolicyVersion | PolicyVersionCell,
        payloads: PayloadStore | None = None,
        limiter: trio.CapacityLimiter | None = None,
        restore: RestoreReport | None = None,
        on_version: Callable[[PolicyVersion], None] | None = None,
    ) -> None:
        self.config = config
        self.payloads = payloads
        #: The one limiter every worker thread of the run borrows from.
        self.limiter = limiter if limiter is not None else trio.CapacityLimiter(4)
        self.sink = sink
        self.factory = factory
        self.source = source
        #: The run's one policy-version cell, shared with the driver (and any engine or weight
        #: watcher given it); only `set_policy_version` / ``version.advance`` moves it.
        self.version = (
            policy_version
            if isinstance(policy_version, PolicyVersionCell)
            else PolicyVersionCell(policy_version)
        )
        self.version.on_advance(self._advanced)
        self._driver: AsyncRolloutDriver | None = None
        self._publisher: Publisher | None = None
        #: What the run resumed from (None: a fresh start).
        self.restore = restore
        self._on_version: list[Callable[[PolicyVersion], None]] = []
        if on_version is not None:
            self._on_version.append(on_version)
            on_version(self.version.value)
        self._ended = False
        #: Seconds the ship gate holds before it logs what it waits for (and between repeats).
        self.gate_warn_after = 5.0
        #: The staleness-aware admission the driver asks (None when switched off).
        self.admission: StalenessAdmission | None = (
            StalenessAdmission(sink, lockstep=config.lockstep, async_level=config.max_async_level)
            if config.stale_admission
            else None
        )
        #: The last step the run will ship, when known (None: open-ended, e.g. a run resumed
        #: later for more steps): admission generates nothing for later steps, so no work is
        #: left over when the run ends. Read by `run`.
        self.final_step: int | None = None

    @property
    def policy_version(self) -> PolicyVersion:
        return self.version.value

    @property
    def step(self) -> int:
        """The step being collected (1-based)."""
        return self.sink.step

    @property
    def progress(self) -> ProgressTotals:
        """Tokens, samples and problems over every shipped batch, this run and the ones it
        resumed (saved in each checkpoint's ``progress`` map)."""
        return self.publisher.progress

    @property
    def driver(self) -> AsyncRolloutDriver:
        assert self._driver is not None
        return self._driver

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None
        return self._publisher

    @contextmanager
    def _attached(self, driver: AsyncRolloutDriver, publisher: Publisher) -> Iterator[None]:
        """The rollout driver and the publisher `open_orchestrator` opened, for the block."""
        self._driver, self._publisher = driver, publisher
        try:
            yield
        finally:
            self._driver = self._publisher = None

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Record a weight update (the trainer finished a step): advance the shared
        :class:`~trio_rl.policy.PolicyVersionCell`. Versions never go back (a smaller one raises
        ``PolicyVersionError``, a ``ValueError``); the same one is a no-op."""
        self.version.advance(version)

    def _advanced(self, old: PolicyVersion, new: PolicyVersion) -> None:
        # The trainer broadcasts v_S after training batch S: batches up to S have been read.
        for step in range(old + 1, new + 1):
            self.sink.mark_read(step)
        self._reconsider("policy version")
        for hook in self._on_version:
            hook(new)

    def _reconsider(self, reason: str) -> None:
        if self._driver is not None and self.admission is not None:
            self._driver.expiry.reconsider(reason)

    @property
    def pending_steps(self) -> list[int]:
        """Steps booked as shipped whose delivery is not confirmed (re-sent first by `run`)."""
        return [] if self._publisher is None else self._publisher.pending_steps

    async def run(self, steps: int) -> RunSummary:
        """Collect and ship ``steps`` more batches; return what was shipped.

        When the data source runs dry, the samples still queued ship as a last, shorter batch
        and the summary says ``exhausted``; nothing taken from the source is left behind, and
        the sender's ``end_stream`` tells every trainer rank that no later step will come (their
        ``BatchReceiver`` iteration ends instead of waiting forever).

        Steps pending delivery (see `pending_steps`) are re-sent first, with identical bytes.

        On cancellation the batch being published goes back to the sink's queue, or, once it is
        booked, its checkpoint and outbox are written (shielded) and it stays pending until a
        send succeeds (here or in a resumed run); groups in flight are cancelled when the
        orchestrator closes, and are regenerated from the last checkpoint on resume.
        """
        check_at_least("steps", steps, 0)
        # A step checkpointed but not confirmed delivered (before a crash or a failed send) goes
        # out again first, with its identical bytes.
        await self.publisher.resend_pending()
        first = self.sink.step
        last = first + steps - 1
        if self.admission is not None and self.admission.horizon != self.final_step:
            self.admission.horizon = self.final_step
            self._reconsider("run")
        records: list[ShipRecord] = []
        exhausted = False
        while self.sink.step <= last:
            if self.sink.ready() or (exhausted and self.sink.queued):
                await _ship_gate(self, self.sink.step)
                record = await self.publisher.publish(force=exhausted)
                self._reconsider("shipped")
                if record is not None:
                    records.append(record)
                    await self.sweep_payloads()
                continue
            if exhausted:
                break
            # Ask for just the groups the next cut still needs: restored queued samples and
            # groups completed at restore count toward it.
            missing = (
                self.sink.config.batch_size - self.sink.queued if self.sink.config.batch_size else 1
            )
            # (lockstep: one group at a time, each scored before the next starts)
            wanted = 1 if self.config.lockstep else max(1, -(-missing // self.config.group_size))
            try:
                groups = await self.driver.next_batch(wanted, allow_partial=True)
            except SourceExhaustedError:
                groups = []
            for group in groups:
                # The training lists are built in a worker thread, shielded: a group taken from
                # the driver always reaches the sink. No checkpoint can be taken meanwhile:
                # only this task publishes.
                await self.sink.ingest_group(group, limiter=self.limiter)
            if groups:
                self._reconsider("scored")
            if len(groups) < wanted:
                exhausted = True
        if exhausted and not self._ended:
            # Tell the trainer ranks the stream ended (a marker prime-rl receivers ignore), once
            # every shipped step is out.
            await self.publisher.resend_pending()
            await self.publisher.sender.end_stream(self.sink.step)
            self._ended = True
        restore = self.restore
        return RunSummary(
            first_step=first,
            last_step=self.sink.step - 1,
            records=tuple(records),
            counters=self.sink.counters,
            resumed_groups=0 if restore is None else len(restore.resumed),
            restored_queued=0 if restore is None else restore.queued,
            exhausted=exhausted,
        )

    async def save_checkpoint(self) -> Path | None:
        """Checkpoint the run as it is now (see `Publisher.save_checkpoint`): for a graceful stop
        after `run` was cancelled mid-step, so that the groups finished since the last shipped
        step are not generated again. Returns the checkpoint's path (None without a checkpoint
        directory). Shielded: it completes even when cancelled.
        """
        path = await self.publisher.save_checkpoint()
        return path if isinstance(path, Path) else None

    def held_groups(self) -> list[OpenGroup]:
        """Groups the rollout layer holds (running, queued for a retry or resume, buffered).

        The driver's own view (`AsyncRolloutDriver.held_groups`), one `OpenGroup` per group;
        empty when no driver is open. ``len(orch.held_groups())`` counts them.
        """
        return [] if self._driver is None else self._driver.held_groups()

    def live_payload_versions(self) -> set[PolicyVersion]:
        """Every version whose payload directory a holder may still read.

        The sink's holders (queued samples, restored ones included; open groups; batches shipped
        and not yet read), every group the rollout layer holds (its start version bounds the
        versions its requests wrote under) and the current version (new requests write there).
        """
        live = self.sink.live_payload_versions()  # the sink's book holds the driver's groups
        live.add(self.version.value)
        return live

    async def sweep_payloads(self) -> None:
        """Delete payload directories below every live version (in a worker thread).

        Runs after every shipped batch; call it yourself e.g. once the trainer caught up at the
        end of a run. A no-op without a payload store.

        Cancellation: the live versions are taken on the loop, then
        :meth:`PayloadStore.asweep_orphans <trio_rl.payloads.PayloadStore.asweep_orphans>` runs:
        cancelled before its thread starts, nothing is deleted; once it runs, the sweep
        completes and `trio.Cancelled` arrives at the caller's next checkpoint. Either way the
        next sweep deletes whatever this one left.
        """
        if self.payloads is not None:
            await self.payloads.asweep_orphans(self.live_payload_versions(), self.version.value)


async def _ship_gate(orch: Orchestrator, step: int) -> None:
    """Wait until batch ``step`` may ship; the wait is reported as policy-wait time.

    Only the trainer advances the policy version (`set_policy_version`); after a resume the
    gate waits for the trainer to report one. A hold longer than ``gate_warn_after`` seconds
    is logged (WARNING, ``trio_rl.orchestrator``) with the step, the version it needs and
    the current one, and again every ``gate_warn_after`` seconds, so it is never silent.
    """
    needed = step - 1 - orch.config.max_async_level
    if orch.version.value >= needed:
        return
    started = trio.current_time()
    while orch.version.value < needed:
        with trio.move_on_after(orch.gate_warn_after):
            await orch.version.wait_at_least(needed)
            continue
        logger.warning(
            "ship gate: step %d waits for policy version >= %d (current %d) for %.0f s; "
            "only the trainer advances the version (set_policy_version)",
            step,
            needed,
            orch.version.value,
            trio.current_time() - started,
        )
    orch.publisher.add_policy_wait(trio.current_time() - started)
