"""`open_orchestrator`: a run's rollout driver, sink and publisher, opened together."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio

from ..engines import Engine
from ..errors import collapse_single
from ..payloads import PayloadStore
from ..policy import PolicyVersionCell
from ..publish import (
    Monitor,
    ProgressTotals,
    Publisher,
    SinkCheckpointer,
    open_publisher,
    pack_samples,
)
from ..rollout import (
    AsyncRolloutDriver,
    DataSource,
    GenerateFn,
    GroupFactory,
    GroupRewardFn,
    GroupRunner,
    SampleRewardFn,
    engine_generate,
    open_async_rollout,
)
from ..samples import PolicyVersion
from ..sink import (
    CheckpointError,
    CheckpointManager,
    RestoreReport,
    RunBounds,
    TrainSink,
)
from ..transport import Sender
from ._config import OrchestratorConfig
from ._handle import Orchestrator
from ._resume import Resumed, resume_or_set_aside

logger = logging.getLogger("trio_rl.orchestrator")


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
    factory = GroupFactory(
        config.group_size,
        seed=config.seed,
        routing_keys=config.rollout.routing_keys,
        seeds=config.rollout.seeds,
    )
    sink = TrainSink(config.sink)
    manager = (
        None
        if checkpoint_dir is None
        else config.checkpoint.manager(
            checkpoint_dir,
            limiter=limiter,
            payload_root=None if payloads is None else payloads.root,
        )
    )
    try:
        resumed = Resumed()
        if manager is not None:
            bounds = RunBounds(
                group_size=config.group_size,
                samples_made=None,  # set from the factory once its state is loaded
                groups_made=None,
                # engine_generate never exceeds the configured cap; a custom generate may
                max_completion_tokens=config.sampling.max_tokens if generate is None else None,
                payload_files_per_call=payloads is not None,
            )
            resumed = await resume_or_set_aside(
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
            sample_timeout=config.rollout.sample_timeout,
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
    except BaseException:
        if manager is not None:
            # the run's own failure is the one raised; the manager's is only logged with it
            try:
                await _close(manager)
            except CheckpointError:
                logger.exception("closing the checkpoint manager failed too")
        raise
    else:
        if manager is not None:
            await _close(manager)


async def _close(manager: CheckpointManager) -> None:
    """Stop a background compaction (the deltas it would replace stay valid) and join its
    thread; a compaction failure not reported yet is raised (`CheckpointCompactionError`)."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(manager.close)


def _open_rollout(
    orch: Orchestrator, runner: GroupRunner, restore: RestoreReport | None
) -> AbstractAsyncContextManager[AsyncRolloutDriver]:
    config = orch.config
    return open_async_rollout(
        orch.source,
        orch.factory,
        runner,
        batch_size=config.batch_groups,
        policy=config.rollout.make_policy(),
        max_groups_in_flight=config.group_budget,
        # The sink's staleness filter is the hard guarantee; the driver passes all.
        max_staleness=None,
        aborted="recycle",
        on_failure=config.rollout.failure,
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
