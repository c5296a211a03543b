"""Resuming a run: the newest usable checkpoint restored into the sink, the data source and
the group factory (or, for a fresh start, the earlier checkpoints moved aside)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs
import trio

from ..publish import (
    ProgressTotals,
)
from ..rollout import (
    DataSource,
    DataSourceError,
    GroupFactory,
)
from ..samples import PolicyVersion
from ..sink import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    RestoreReport,
    RunBounds,
    TrainSink,
    check_run_bounds,
)

logger = logging.getLogger("trio_rl.orchestrator")


def restore_progress(ckpt: Checkpoint) -> ProgressTotals:
    """The progress totals a checkpoint saved (`ProgressTotals.from_progress`); a malformed
    one is a `CheckpointError` naming the file and the field."""
    try:
        return ProgressTotals.from_progress(ckpt.progress)
    except ValueError as exc:
        raise CheckpointError(str(ckpt.path), str(exc)) from exc


def restore_run_state(ckpt: Checkpoint, source: DataSource, factory: GroupFactory) -> int:
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


@attrs.frozen
class Resumed:
    """What a run continues from: its policy version, the sink's restore, the step whose
    delivery was not confirmed (re-sent first) and the progress totals."""

    policy_version: PolicyVersion = 0
    restore: RestoreReport | None = None
    pending: tuple[int, list[bytes]] | None = None
    progress: ProgressTotals = attrs.field(factory=ProgressTotals)


async def resume_or_set_aside(
    manager: CheckpointManager,
    sink: TrainSink,
    source: DataSource,
    factory: GroupFactory,
    bounds: RunBounds,
    *,
    resume: bool,
    limiter: trio.CapacityLimiter,
) -> Resumed:
    """Restore the newest usable checkpoint into the sink, the source and the factory; or, for
    a fresh start, move the earlier run's checkpoints aside (never deleted)."""
    if not resume:
        aside = await trio.to_thread.run_sync(manager.set_aside, limiter=limiter)
        if aside is not None:
            logger.warning("fresh start: earlier checkpoints moved to %s", aside)
        return Resumed()
    ckpt = await manager.load_latest(require_usable=True)
    if ckpt is None:
        return Resumed()
    policy_version = restore_run_state(ckpt, source, factory)
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
    progress = restore_progress(ckpt)
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
    return Resumed(policy_version, restore, pending, progress)
