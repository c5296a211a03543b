"""The orchestrator: rollout -> train sink -> publisher -> transport, checkpointed every step.

It ties the pipeline's layers together (the commands above it, ``trio-rl run`` and
``trio-rl simulate``, add the engine, the transport and the trainer) and owns, in one nursery
hierarchy:

* a fully-async rollout driver (its worker keeps the engine saturated with groups);
* the train sink, fed with finished groups;
* a publisher that finalizes every batch in worker threads and ships it through a
  :class:`~trio_rl.transport.Sender`, writing one checkpoint per shipped step.

The train sink's open-group book is the one record of work in flight (``docs/accounting.md``):
the driver reports every group it submits, each finished member as it arrives, failed attempts
and discards to it (``book=sink.book``). A checkpoint is the sink's state plus the source cursor:
the queue and every group the rollout layer has open (running, buffered or resumed but not
started) with its finished members, so a resume continues those groups under the same id and
regenerates only their missing members. Nothing is merged or patched here.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Literal

import attrs
import trio

from ._validation import at_least, check_at_least, one_of
from .engines import Engine, SamplingParams
from .errors import InvalidArgumentError, collapse_single
from .payloads import PayloadStore
from .policy import PolicyVersionCell
from .publish import (
    Monitor,
    ProgressTotals,
    Publisher,
    ShipRecord,
    SinkCheckpointer,
    open_publisher,
    pack_samples,
)
from .rollout import (
    AsyncRolloutDriver,
    DataSource,
    DataSourceError,
    FailurePolicy,
    GenerateFn,
    GroupFactory,
    GroupGranularity,
    GroupRewardFn,
    GroupRunner,
    RoutingKeys,
    SampleBackfill,
    SampleRewardFn,
    SourceExhausted,
    SubmissionPolicy,
    engine_generate,
    open_async_rollout,
)
from .samples import PolicyVersion
from .train import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    RestoreReport,
    RunBounds,
    SinkConfig,
    SinkCounters,
    TrainSink,
    check_run_bounds,
)
from .transport import Sender

__all__ = [
    "Orchestrator",
    "OrchestratorConfig",
    "RunSummary",
    "StalenessAdmission",
    "open_orchestrator",
]

logger = logging.getLogger("trio_rl.orchestrator")


@attrs.frozen(kw_only=True)
class OrchestratorConfig:
    """How a run is shaped (keyword arguments only).

    A step trains on ``batch_groups`` groups of ``group_size`` samples. ``max_groups_in_flight``
    (the budget ``B``, default ``2 x batch_groups``) bounds rollout concurrency under
    ``submission`` (``"sample"``: sample backfill; ``"group"``: group granularity).
    ``max_async_level`` is the ship gate: batch ``S`` ships only once the policy version is at
    least ``S - 1 - max_async_level``. ``sink`` is the train sink's own config
    (:class:`~trio_rl.train.SinkConfig`: the staleness limit ``max_off_policy_steps``, the
    ``staleness`` rule, pruning, scoring); by default the library's, cutting ``batch_groups x
    group_size`` samples per batch, which a given one must cut too. ``routing_keys``
    turns routing keys on (see :class:`~trio_rl.rollout.GroupFactory`): ``"group"`` is
    group-sticky routing, every sample of a group with one key, which the HTTP engines send as
    the ``X-SMG-Routing-Key`` header and :class:`~trio_rl.engines.EngineFleet` routes by.
    """

    batch_groups: int = attrs.field(default=8, validator=at_least(1))
    group_size: int = attrs.field(default=8, validator=at_least(1))
    max_groups_in_flight: int | None = attrs.field(default=None, validator=at_least(1))
    submission: Literal["sample", "group"] = "sample"
    max_async_level: int = attrs.field(default=1, validator=at_least(0))
    seq_len: int = attrs.field(default=8192, validator=at_least(1))
    pad_to_multiple_of: int = attrs.field(default=1, validator=at_least(1))
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int | None = None
    routing_keys: RoutingKeys = attrs.field(
        default="none", validator=one_of(("none", "sample", "group"))
    )
    failure: FailurePolicy = attrs.field(factory=FailurePolicy)
    checkpoint_keep: int = attrs.field(default=3, validator=at_least(1))
    #: Incremental checkpoints: a full one first, then per step a delta of what changed since
    #: the previous one, compacted into a full file in the background (see
    #: :class:`~trio_rl.train.CheckpointManager`). False: a full checkpoint every step.
    checkpoint_incremental: bool = True
    #: Deadline in seconds of each sample (generation plus its reward); expiry fails the sample
    #: and so its group, which then follows ``failure``. None: only the engine's own deadlines.
    sample_timeout: float | None = None
    #: Staleness-aware admission (:class:`StalenessAdmission`): a new group starts only if its
    #: samples can still ship within ``max_off_policy_steps`` (and before the run's last step),
    #: and a running group whose work can no longer be trained is cancelled early. False: the
    #: credit policy alone admits, and the sink drops what went stale.
    stale_admission: bool = True
    #: Reproducible rollouts (with ``stale_admission``): one group at a time, admitted only when
    #: the policy version is the one the async level prescribes for the batch it lands in
    #: (``S - 1 - max_async_level``), so a seeded run generates the same rollouts every time.
    #: The caller keeps the trainer from running ahead (see ``trio-rl run --deterministic``).
    lockstep: bool = False
    sink: SinkConfig = attrs.field(
        # max(1, ...): a bad batch_groups is reported by its own check, which attrs runs
        # after every default is made
        default=attrs.Factory(
            lambda self: SinkConfig(batch_size=max(1, self.batch_groups * self.group_size)),
            takes_self=True,
        )
    )

    @sink.validator
    def _check_sink(self, _: attrs.Attribute[SinkConfig], sink: SinkConfig) -> None:
        step = self.batch_groups * self.group_size
        if sink.batch_size != step:
            raise InvalidArgumentError(
                f"OrchestratorConfig.sink.batch_size must be batch_groups x group_size = {step} "
                f"(the samples of one step), got {sink.batch_size}"
            )

    def make_policy(self) -> SubmissionPolicy:
        return SampleBackfill() if self.submission == "sample" else GroupGranularity()


@attrs.define(slots=True, eq=False)
class StalenessAdmission:
    """Admission at dispatch from the sink's own books (a :class:`~trio_rl.rollout.Admission`).

    Batch ``S`` trains on policy ``S - 1``, and the sink drops a sample of version ``v`` from
    batch ``S`` when ``v < S - 1 - max_off_policy_steps``: work started now, at version ``v``,
    is trainable in batches up to ``v + 1 + max_off_policy_steps``. Batches are cut oldest
    version first, so every sample already queued or still to come from an open group goes
    before it: with ``ahead`` such samples (each open group counted as its full size, an upper
    bound) a new group of ``G`` lands at the latest in batch ``step + (ahead + G - 1) //
    batch_size``. It is admitted if that batch is within the staleness limit and not after
    ``horizon`` (the run's last step: work for later steps would be left over). The trainer's
    pace enters through the version: when it lags, admission waits for it instead of
    generating work that would be dropped.

    Liveness: when the work ahead cannot fill the batch being collected (``ahead <
    batch_size``), a group that straddles the limit is still admitted unless a shipped batch is
    waiting to be trained (then the version will advance and admit it whole).

    A running group expires once the sink would judge its start version stale for the batch
    being collected (certain: steps only advance); the driver then cancels it.

    In ``lockstep`` mode a group starts only when no other is open and the version is
    ``lands - 1 - async_level`` for the batch ``lands`` its first sample goes to (or later):
    rollouts then depend on the seed only, not on timing.
    """

    sink: TrainSink
    #: The last step the run will ship (None: unbounded).
    horizon: int | None = None
    lockstep: bool = False
    async_level: int = 1

    def ahead(self) -> int:
        """Samples that go before new work: queued, in a cut, or still to come from open groups."""
        return self.sink.queue.held + sum(g.group_size for g in self.sink.book.groups.values())

    def admits(self, version: PolicyVersion, samples: int) -> bool:
        config = self.sink.config
        size = config.batch_size
        m = config.max_off_policy_steps
        step = self.sink.step
        if self.lockstep and size is not None:
            if self.sink.book.groups or (self.horizon is not None and step > self.horizon):
                return False
            first = step + self.sink.queue.held // size
            return version >= max(0, first - 1 - self.async_level)
        if size is None or (m is None and self.horizon is None):
            return True
        ahead = self.ahead()
        lands = step + (ahead + samples - 1) // size
        fresh = m is None or lands <= version + 1 + m
        if fresh and (self.horizon is None or lands <= self.horizon):
            return True
        if ahead >= size or (self.horizon is not None and step > self.horizon):
            return False  # the batch being collected fills from work ahead (or the run is done)
        # the batch being collected needs this work: wait only if the version will advance
        return fresh or version >= step - 1

    def expired(self, version: PolicyVersion) -> bool:
        return self.sink.queue.is_stale(version)


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

    async def _ship_gate(self, step: int) -> None:
        """Wait until batch ``step`` may ship; the wait is reported as policy-wait time.

        Only the trainer advances the policy version (`set_policy_version`); after a resume the
        gate waits for the trainer to report one. A hold longer than ``gate_warn_after`` seconds
        is logged (WARNING, ``trio_rl.orchestrator``) with the step, the version it needs and
        the current one, and again every ``gate_warn_after`` seconds, so it is never silent.
        """
        needed = step - 1 - self.config.max_async_level
        if self.version.value >= needed:
            return
        started = trio.current_time()
        while self.version.value < needed:
            with trio.move_on_after(self.gate_warn_after):
                await self.version.wait_at_least(needed)
                continue
            logger.warning(
                "ship gate: step %d waits for policy version >= %d (current %d) for %.0f s; "
                "only the trainer advances the version (set_policy_version)",
                step,
                needed,
                self.version.value,
                trio.current_time() - started,
            )
        self.publisher.add_policy_wait(trio.current_time() - started)

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
                await self._ship_gate(self.sink.step)
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
            except SourceExhausted:
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

    @property
    def held_groups(self) -> int:
        """Groups the rollout layer holds (running, queued for a retry or resume, buffered)."""
        return 0 if self._driver is None else len(self._driver.held_groups())

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


def _restore_progress(ckpt: Checkpoint) -> ProgressTotals:
    """The progress totals a checkpoint saved (`ProgressTotals.from_progress`); a malformed
    one is a `CheckpointError` naming the file and the field."""
    try:
        return ProgressTotals.from_progress(ckpt.progress)
    except ValueError as exc:
        raise CheckpointError(str(ckpt.path), str(exc)) from exc


def _restore_run_state(ckpt: Checkpoint, source: DataSource, factory: GroupFactory) -> int:
    """Load the source cursor and the factory state a checkpoint saved; return its policy
    version. Anything malformed is a `CheckpointError` naming the file and the field."""
    where = str(ckpt.path)
    cursor = {} if ckpt.cursor is None else ckpt.cursor
    if not isinstance(cursor, Mapping):
        raise CheckpointError(where, f"cursor: a map expected, got {type(cursor).__name__}")
    for name, target in (("source", source), ("factory", factory)):
        state = cursor.get(name, {})
        if not isinstance(state, Mapping):
            raise CheckpointError(
                where, f"cursor.{name}: a map expected, got {type(state).__name__}"
            )
        try:
            target.load_state(state)
        except DataSourceError as exc:
            raise CheckpointError(where, f"cursor.{name}: {exc}") from exc
    version = ckpt.progress.get("policy_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise CheckpointError(
            where, f"progress.policy_version: a non-negative integer expected, got {version!r}"
        )
    return version


@asynccontextmanager
async def open_orchestrator(
    engine: Engine,
    source: DataSource,
    sender: Sender,
    *,
    config: OrchestratorConfig | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = True,
    sample_reward: SampleRewardFn | None = None,
    group_reward: GroupRewardFn | None = None,
    monitor: Monitor | None = None,
    limiter: trio.CapacityLimiter | None = None,
    on_policy_version: Callable[[PolicyVersion], None] | None = None,
    generate: GenerateFn | None = None,
    payloads: PayloadStore | None = None,
    version: PolicyVersionCell | None = None,
) -> AsyncIterator[Orchestrator]:
    """Open a run: rollout driver, sink and publisher, resumed from the latest checkpoint.

    With ``checkpoint_dir`` set and ``resume`` on, the newest loadable checkpoint there is
    restored: queued samples ship first, open groups continue with their id (only their missing
    members are generated) before any new prompt, and the data source and sample counters carry
    on from where they were. A broken newest checkpoint is skipped with a warning.

    ``on_policy_version`` is told every new version (e.g. to update a simulated engine).
    ``generate`` replaces the default generate function (``engine_generate(engine,
    config.sampling)``), e.g. one that also writes by-handle payload files. With ``payloads``,
    the payload store's orphan directories are swept after every shipped batch, keeping every
    version a holder may still read (see :meth:`Orchestrator.live_payload_versions`); a
    version's batches count as read once the trainer reports that version.

    ``version`` is the run's policy-version cell when the caller already has one to share
    (e.g. an engine's ``version``); by default the orchestrator creates it. A resumed run
    advances it to the checkpoint's version. The orchestrator hands it to the rollout driver;
    ``orchestrator.version`` is the cell to give engines and the weight watcher.

    Leaving the block cancels the rollout worker and every group in flight, and waits for the
    publisher's pending memory release (shielded); no task outlives it.
    """
    config = OrchestratorConfig() if config is None else config
    limiter = trio.CapacityLimiter(4) if limiter is None else limiter
    factory = GroupFactory(config.group_size, seed=config.seed, routing_keys=config.routing_keys)
    sink = TrainSink(config.sink)
    manager = (
        None
        if checkpoint_dir is None
        else CheckpointManager(
            checkpoint_dir,
            keep=config.checkpoint_keep,
            limiter=limiter,
            payload_root=None if payloads is None else payloads.root,
            incremental=config.checkpoint_incremental,
        )
    )
    try:
        resumed = _Resumed()
        if manager is not None:
            bounds = RunBounds(
                group_size=config.group_size,
                samples_made=None,  # set from the factory once its state is loaded
                groups_made=None,
                # engine_generate never exceeds the configured cap; a custom generate may
                max_completion_tokens=config.sampling.max_tokens if generate is None else None,
                payload_files_per_call=payloads is not None,
            )
            resumed = await _resume_or_set_aside(
                manager, sink, source, factory, bounds, resume=resume, limiter=limiter
            )
        if version is None:
            version = PolicyVersionCell(resumed.policy_version)
        elif version.value < resumed.policy_version:
            version.advance(resumed.policy_version)
        orch = Orchestrator(
            config=config,
            sink=sink,
            factory=factory,
            source=source,
            policy_version=version,
            payloads=payloads,
            limiter=limiter,
            restore=resumed.restore,
            on_version=on_policy_version,
        )
        runner = GroupRunner(
            generate if generate is not None else engine_generate(engine, config.sampling),
            sample_reward=sample_reward,
            group_reward=group_reward,
            sample_timeout=config.sample_timeout,
        )
        with collapse_single():
            async with (
                _open_rollout(orch, runner, resumed.restore) as driver,
                _open_publishing(
                    orch, sender, manager, resumed.progress, monitor=monitor
                ) as publisher,
            ):
                with orch._attached(driver, publisher):
                    if resumed.pending is not None:
                        publisher.add_pending(*resumed.pending)
                    yield orch
    finally:
        if manager is not None:
            # a background compaction stops (the deltas it would replace stay valid)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(manager.close)


@attrs.frozen
class _Resumed:
    """What a run continues from: its policy version, the sink's restore, the step whose
    delivery was not confirmed (re-sent first) and the progress totals."""

    policy_version: PolicyVersion = 0
    restore: RestoreReport | None = None
    pending: tuple[int, list[bytes]] | None = None
    progress: ProgressTotals = attrs.field(factory=ProgressTotals)


async def _resume_or_set_aside(
    manager: CheckpointManager,
    sink: TrainSink,
    source: DataSource,
    factory: GroupFactory,
    bounds: RunBounds,
    *,
    resume: bool,
    limiter: trio.CapacityLimiter,
) -> _Resumed:
    """Restore the newest usable checkpoint into the sink, the source and the factory; or, for
    a fresh start, move the earlier run's checkpoints aside (never deleted)."""
    if not resume:
        aside = await trio.to_thread.run_sync(manager.set_aside, limiter=limiter)
        if aside is not None:
            logger.warning("fresh start: earlier checkpoints moved to %s", aside)
        return _Resumed()
    ckpt = await manager.load_latest(require_usable=True)
    if ckpt is None:
        return _Resumed()
    policy_version = _restore_run_state(ckpt, source, factory)
    # Nothing is restored or started for a checkpoint holding more than this run could have
    # produced (a million-member open group would start a million sample tasks).
    bounds = attrs.evolve(
        bounds,
        samples_made=factory.next_sample_index,
        groups_made=factory.next_group_index,
    )
    await trio.to_thread.run_sync(
        check_run_bounds, ckpt, bounds, limiter=limiter, abandon_on_cancel=True
    )
    progress = _restore_progress(ckpt)
    # an incremental manager goes on from the checkpoint's file (its next is a delta);
    # a checkpoint every few hundred records: a deadline around a resume always fires
    restore = await manager.arestore(sink, ckpt)
    outbox = await trio.to_thread.run_sync(manager.read_outbox, ckpt.step, limiter=limiter)
    pending = None if outbox is None else (ckpt.step, outbox)
    logger.info(
        "resumed from step %d: %d queued samples, %d open groups continue%s",
        ckpt.step,
        restore.queued,
        len(restore.resumed),
        "" if pending is None else f"; step {ckpt.step} is re-sent first",
    )
    return _Resumed(policy_version, restore, pending, progress)


def _open_rollout(
    orch: Orchestrator, runner: GroupRunner, restore: RestoreReport | None
) -> AbstractAsyncContextManager[AsyncRolloutDriver]:
    config = orch.config
    return open_async_rollout(
        orch.source,
        orch.factory,
        runner,
        batch_size=config.batch_groups,
        policy=config.make_policy(),
        max_groups_in_flight=config.max_groups_in_flight or 2 * config.batch_groups,
        # The sink's staleness filter is the hard guarantee; the driver passes all.
        max_staleness=None,
        aborted="recycle",
        on_failure=config.failure,
        # the sink's book is the one record of work in flight: the driver reports to it
        book=orch.sink.book,
        resumed=() if restore is None else restore.resumed,
        policy_version=orch.version,
        admission=orch.admission,
    )


def _open_publishing(
    orch: Orchestrator,
    sender: Sender,
    manager: CheckpointManager | None,
    progress: ProgressTotals,
    *,
    monitor: Monitor | None,
) -> AbstractAsyncContextManager[Publisher]:
    config, sink, source, factory = orch.config, orch.sink, orch.source, orch.factory
    pack = functools.partial(
        pack_samples,
        seq_len=config.seq_len,
        num_ranks=sender.world_size,
        pad_to_multiple_of=config.pad_to_multiple_of,
    )
    checkpointer = (
        None
        if manager is None
        else SinkCheckpointer(
            manager,
            sink,
            cursor=lambda: {"source": source.state(), "factory": factory.state()},
            progress=lambda: {"policy_version": orch.policy_version, **progress.as_progress()},
        )
    )
    return open_publisher(
        sink,
        sender,
        pack=pack,
        limiter=orch.limiter,
        checkpointer=checkpointer,
        monitor=monitor,
        progress=progress,
    )
