"""The checkpoint manager: one checkpoint per step in a directory, written in a worker thread,
pruned to the newest few, read back newest usable first; and the outbox files next to them.
`CheckpointConfig` holds a run's checkpoint knobs. The file format is ``_checkpoint_format``'s,
incremental chains ``_checkpoint_chain``'s.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from .._durable import fsync_dir
from .._validation import at_least, check_at_least, positive_finite
from ..errors import InvalidArgumentError
from ._checkpoint_chain import CheckpointChain, IncrementalSnapshot, read_checkpoint
from ._checkpoint_format import (
    CHECKPOINT_NAME,
    STOP_EVERY,
    Checkpoint,
    CheckpointSnapshot,
    checkpoint_name,
    list_checkpoints,
    step_of,
    stopped,
)
from ._checkpoint_schema import RunBounds, run_bound_problem
from ._errors import CheckpointError
from ._outbox import OUTBOX_NAME, outbox_name, read_outbox_file, write_outbox_file
from ._sink import TrainSink, finish_restore, finish_restore_async
from ._sink_state import RestoreReport, check_restorable, payload_files_of_state

__all__ = ["CheckpointConfig", "CheckpointManager", "check_run_bounds"]

logger = logging.getLogger("trio_rl.sink")
_R = TypeVar("_R")


async def _stoppable(fn: Callable[..., _R], limiter: trio.CapacityLimiter | None) -> _R:
    """``fn(stop=stop)`` in a worker thread that a cancellation reaches at once: ``fn`` only reads
    (or moves files aside only after its last look at ``stop``), so the thread is abandoned,
    told to stop, and ends at its next look, within ``STOP_EVERY`` records."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(
            functools.partial(fn, stop=stop), limiter=limiter, abandon_on_cancel=True
        )
    except trio.Cancelled:
        stop.set()
        raise


def check_run_bounds(ckpt: Checkpoint, bounds: RunBounds) -> None:
    """Refuse a checkpoint that holds more than the run restoring it could have produced (see
    `RunBounds`): one `CheckpointError` naming the file, the field and both values. Call it
    before restoring anything: it is O(records) and allocates nothing per token."""
    problem = run_bound_problem(ckpt.sink, bounds)
    if problem is not None:
        field, got, allowed, why = problem
        raise CheckpointError(str(ckpt.path), f"{field}: {got} in the checkpoint, {allowed}: {why}")


class _Outboxes:
    """The outbox files next to the checkpoints (see `CheckpointManager`)."""

    directory: Path

    def outbox_path(self, step: int) -> Path:
        """Where the payload bytes of ``step`` wait until their delivery is confirmed."""
        return self.directory / outbox_name(step)

    # -- outbox: the payload bytes of a step whose delivery is not confirmed yet --

    def write_outbox(self, step: int, payloads: Sequence[bytes | bytearray | memoryview]) -> Path:
        """Blocking: write step ``step``'s payloads (one per rank) atomically and durably."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return write_outbox_file(self.outbox_path(step), step, payloads)

    def read_outbox(self, step: int) -> list[bytes] | None:
        """Blocking: step ``step``'s pending payloads, or None when it has no outbox file.

        A truncated or corrupt outbox raises `CheckpointError` naming the file and offset.
        """
        return read_outbox_file(self.outbox_path(step), step)

    def clear_outbox(self, step: int) -> None:
        """Blocking: step ``step``'s delivery is confirmed; forget its payload bytes."""
        self.outbox_path(step).unlink(missing_ok=True)

    def pending_outboxes(self) -> list[int]:
        """Steps with an outbox file (a delivery not confirmed), in order."""
        if not self.directory.is_dir():
            return []
        return sorted(
            int(m.group(1))
            for e in os.scandir(self.directory)
            if (m := OUTBOX_NAME.match(e.name)) is not None
        )


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """How a run checkpoints (keyword arguments only): what :class:`CheckpointManager` is made
    with when the orchestrator makes it.

    Each knob's meaning is its field's ``metadata["help"]``: the ``[checkpoint]`` section of the
    configuration files (``trio_rl.config``) is generated from these fields, so a knob added
    here is a key there, with ``--set checkpoint.<key>=...``, and a line of the reference.
    Incremental checkpoints are on by default here (a run's checkpoint then costs what changed
    since the previous one); a `CheckpointManager` made by hand writes full ones unless told.
    """

    keep: int = attrs.field(
        default=3,
        validator=at_least(1),
        metadata={"help": "checkpoints kept (the newest, and every file they depend on)"},
    )
    incremental: bool = attrs.field(
        default=True,
        metadata={
            "help": "a full checkpoint first, then per step a delta of what changed, compacted "
            "into a full file in the background; false: a full checkpoint every step"
        },
    )
    compact_ratio: float = attrs.field(
        default=1.0,
        validator=positive_finite,
        metadata={
            "help": "incremental: compact once the deltas since the last full file exceed this "
            "times its size"
        },
    )
    max_chain: int = attrs.field(
        default=256,
        validator=at_least(1),
        metadata={"help": "incremental: compact once this many deltas follow the last full file"},
    )

    def manager(
        self,
        directory: str | os.PathLike[str],
        *,
        limiter: trio.CapacityLimiter | None = None,
        payload_root: str | os.PathLike[str] | None = None,
    ) -> CheckpointManager:
        """The :class:`CheckpointManager` of ``directory`` with these knobs."""
        return CheckpointManager(
            directory,
            keep=self.keep,
            limiter=limiter,
            payload_root=payload_root,
            incremental=self.incremental,
            compact_ratio=self.compact_ratio,
            max_chain=self.max_chain,
        )


class CheckpointManager(_Outboxes):
    """One checkpoint per step in ``directory``, keeping the last ``keep`` it wrote itself.

    With ``incremental=True`` a checkpoint costs what changed since the previous one: the first
    (and any after a restore) is a full checkpoint, each later one a *delta* file (schema
    version 2) holding only the samples queued and settled, the open groups changed and the
    small tally since the file it names as its parent; the snapshot on the loop is O(changes)
    too (the sink's `ChangeLog`). Once the deltas since the last full file exceed
    ``compact_ratio`` times its size (or ``max_chain`` files), the newest delta is *compacted*:
    rewritten, atomically and with the same content, as a full file, in a background thread
    (``background_compaction``) or in the writing thread. Pruning keeps the newest ``keep``
    checkpoints and every file they depend on.

    A failed compaction loses nothing (the deltas stay valid) and is retried at the next write;
    the 3rd failure in a row is raised by that write (once its own file is written), a failure
    not yet reported by `wait_compaction` and `close` (which joins the manager's compaction
    thread within ``timeout``, or raises): `CheckpointCompactionError`, naming the delta.

    :meth:`snapshot` runs on the loop (an owned copy); :meth:`save` and the loads run the file
    work in a worker thread under ``limiter``. ``payload_root`` lets loads report which payload
    files named by the checkpoint are gone.

    A manager never deletes or overwrites a checkpoint it did not write itself (in this
    process): keep-``K`` pruning only considers its own files, and foreign files that would be
    in the way (an unusable newer checkpoint, a file of the step being written) are moved aside
    into ``<directory>.old-<timestamp>/`` instead. Next to the checkpoints it keeps *outbox*
    files, ``outbox_step_<N>.bin``: the exact payload bytes of step ``N``, written (durably)
    before the checkpoint of step ``N`` and deleted once step ``N``'s delivery is confirmed.
    Pruning never touches an outbox.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        limiter: trio.CapacityLimiter | None = None,
        payload_root: str | os.PathLike[str] | None = None,
        incremental: bool = False,
        compact_ratio: float = 1.0,
        max_chain: int = 256,
        background_compaction: bool = True,
    ) -> None:
        check_at_least("CheckpointManager keep", keep, 1)
        if not compact_ratio > 0:
            raise InvalidArgumentError(
                f"CheckpointManager compact_ratio must be > 0, got {compact_ratio}"
            )
        check_at_least("CheckpointManager max_chain", max_chain, 1)
        self.directory = Path(directory)
        self.keep = keep
        self.limiter = limiter
        self.payload_root = Path(payload_root) if payload_root is not None else None
        self.incremental = incremental
        self.compact_ratio = compact_ratio
        self.max_chain = max_chain
        self.background_compaction = background_compaction
        self._chain = CheckpointChain(
            self.directory,
            keep=keep,
            incremental=incremental,
            compact_ratio=compact_ratio,
            max_chain=max_chain,
            background_compaction=background_compaction,
        )

    @property
    def written_bytes(self) -> list[int]:
        """Bytes each `write` put in its checkpoint file (compactions excluded), newest last."""
        return self._chain.written_bytes

    @property
    def compactions(self) -> int:
        """Compactions completed (a delta rewritten as a full file)."""
        return self._chain.compactions

    def path_for(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def snapshot(
        self,
        sink: TrainSink,
        *,
        step: int | None = None,
        cursor: Any = None,
        progress: Mapping[str, Any] | None = None,
    ) -> Any:
        """Snapshot on the loop (no await): later mutation of the sink cannot tear it.

        ``step`` defaults to the last shipped step (``sink.step - 1``); ``cursor`` is the data
        source's opaque, MessagePack-able state (deep-copied). Incremental: an
        `IncrementalSnapshot` (the changes since the previous snapshot of this manager, O(them);
        a full state the first time), else a `CheckpointSnapshot`.
        """
        if self.incremental:
            return self._chain.snapshot(sink, step, cursor, progress)
        return CheckpointSnapshot(
            step=sink.step - 1 if step is None else step,
            progress=copy.deepcopy(dict(progress or {})),
            cursor=copy.deepcopy(cursor),
            sink=sink.state_dict(),
        )

    def restore(self, sink: TrainSink, ckpt: Checkpoint) -> RestoreReport:
        """`TrainSink.load_state_dict` from ``ckpt`` (with its ``missing_files``); an incremental
        manager then goes on from ``ckpt``'s file: its next checkpoint is a delta after it
        (what the restore itself changed included) rather than a full one. The files it replays
        stay the run's that wrote them: never deleted by this manager."""
        check_restorable(ckpt.sink)
        return finish_restore(self._chain.restoring(sink, ckpt))

    async def arestore(self, sink: TrainSink, ckpt: Checkpoint) -> RestoreReport:
        """`restore` that lets a cancellation in, whatever ``ckpt`` holds: the invariants are
        checked in a worker thread (abandoned on cancellation: it only reads), the records are
        restored on the loop with a checkpoint every ``RESTORE_BATCH``. Cancelled, the sink
        holds part of the checkpoint: discard it (a resume that is cancelled starts nothing)."""
        await trio.to_thread.run_sync(
            check_restorable, ckpt.sink, limiter=self.limiter, abandon_on_cancel=True
        )
        return await finish_restore_async(self._chain.restoring(sink, ckpt))

    def close(self, timeout: float = 60.0) -> None:
        """Blocking: stop a background compaction and join its thread within ``timeout``
        seconds, else `CheckpointCompactionError` (a hung write: call again to join it); then
        raise a compaction failure not reported yet."""
        self._chain.compaction.close(timeout)

    def wait_compaction(self, timeout: float = 600.0) -> None:
        """Blocking: wait for a compaction (``timeout`` s); raise its failure or overrun."""
        self._chain.compaction.wait(timeout)

    def write(self, snap: CheckpointSnapshot | IncrementalSnapshot) -> Path:
        """Blocking save: atomic write, then rotation.

        Checkpoints of later steps than ``snap.step`` belong to a run that was abandoned by
        resuming from an older checkpoint: those this manager wrote are deleted, others are moved
        aside (otherwise "latest" would jump back to them); a foreign file of ``snap.step``
        itself is moved aside before it is replaced. Then all but the newest ``keep`` of the
        checkpoints this manager wrote are deleted, and temporary files a crashed writer left
        behind. One writer per directory at a time (compaction failures: see the class)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path_for(snap.step)
        with self._chain.lock:
            foreign = [
                p
                for p in self.list_checkpoints()
                if p not in self._chain.written and (step_of(p) > snap.step or p == target)
            ]
            if foreign:
                self._move_aside(foreign, "superseded by a resumed run")
            return self._chain.write_file(target, snap)

    async def save(self, snap: CheckpointSnapshot | IncrementalSnapshot) -> Path:
        """Serialise and write ``snap`` in a worker thread.

        Cancellation: if `trio.Cancelled` arrives before the worker thread started, nothing
        is written and it is raised here. Once the thread has started it is not abandoned: the
        write runs to completion (a checkpoint is never half-written) and this call *returns*
        the path normally; the `trio.Cancelled` arrives at the caller's next checkpoint.
        """
        return await trio.to_thread.run_sync(self.write, snap, limiter=self.limiter)

    def list_checkpoints(self) -> list[Path]:
        """Complete-named checkpoint files, oldest first (temporary files are ignored)."""
        return list_checkpoints(self.directory)

    def read(
        self, path: str | os.PathLike[str], *, stop: threading.Event | None = None
    ) -> Checkpoint:
        """Blocking load of one checkpoint, with its missing payload files. ``stop`` set, it
        stops at its next record or payload file (`_ReadStoppedError`)."""
        ckpt = read_checkpoint(path, stop=stop)
        if self.payload_root is None:
            return ckpt
        missing = set()
        for i, f in enumerate(payload_files_of_state(ckpt.sink)):
            if i % STOP_EVERY == 0:
                stopped(stop)
            if not (self.payload_root / f).exists():
                missing.add(f)
        return attrs.evolve(ckpt, missing_files=frozenset(missing))

    def read_latest(
        self, *, require_usable: bool = False, stop: threading.Event | None = None
    ) -> Checkpoint | None:
        """Blocking: the newest checkpoint that loads; broken ones are skipped with a warning.

        Broken checkpoints newer than the one loaded are moved aside (never deleted), so that
        saving later steps cannot overwrite them. With ``require_usable``, a directory that
        holds checkpoints none of which loads raises `CheckpointError` naming the directory
        (nothing is moved or deleted); without it, that case returns ``None``.
        """
        paths = self.list_checkpoints()
        broken: list[Path] = []
        reasons: list[str] = []
        for path in reversed(paths):
            try:
                ckpt = self.read(path, stop=stop)
            except CheckpointError as exc:
                broken.append(path)
                reasons.append(str(exc))
                continue
            stopped(stop)  # cancelled: nothing is moved
            for reason in reasons:
                logger.warning("skipping unusable checkpoint: %s", reason)
            if broken:
                self._move_aside(broken, "unusable")
            return ckpt
        if paths and require_usable:
            raise CheckpointError(
                str(self.directory),
                f"all {len(paths)} checkpoints are unusable, nothing was changed "
                f"(newest: {reasons[0]})",
            )
        for reason in reasons:
            logger.warning("skipping unusable checkpoint: %s", reason)
        return None

    async def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        """:meth:`read` in a worker thread.

        Cancellation arrives at once, whatever the file holds: the read (which changes
        nothing) is abandoned and told to stop; its thread ends at its next record.
        """
        return await _stoppable(functools.partial(self.read, path), self.limiter)

    async def load_latest(self, *, require_usable: bool = False) -> Checkpoint | None:
        """:meth:`read_latest` in a worker thread.

        Cancellation: as for `load` (unusable checkpoints are then not moved aside).
        """
        return await _stoppable(
            functools.partial(self.read_latest, require_usable=require_usable), self.limiter
        )

    def set_aside(self) -> Path | None:
        """Blocking: move every checkpoint and outbox file to ``<directory>.old-<timestamp>/``
        (a fresh start keeps the old run's files); return that directory, or None if there were
        none."""
        files = [
            Path(e.path)
            for e in (os.scandir(self.directory) if self.directory.is_dir() else ())
            if CHECKPOINT_NAME.match(e.name) or OUTBOX_NAME.match(e.name)
        ]
        return self._move_aside(files, "fresh start") if files else None

    def _move_aside(self, files: list[Path], why: str) -> Path:
        aside = move_aside(self.directory, files, why)
        self._chain.written.difference_update(files)
        return aside


def move_aside(directory: Path, files: list[Path], why: str) -> Path:
    """Blocking: move ``files`` into ``<directory>.old-<timestamp>/`` (never over a file an
    earlier move put there); returns that directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = directory.with_name(f"{directory.name}.old-{stamp}")
    n = 1
    while aside.exists() and any(
        (aside / f.name).exists() for f in files
    ):  # same second: never overwrite an earlier move
        n += 1
        aside = directory.with_name(f"{directory.name}.old-{stamp}-{n}")
    aside.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.replace(f, aside / f.name)
    fsync_dir(aside)
    fsync_dir(directory)
    logger.warning("moved %d checkpoint file(s) (%s) to %s", len(files), why, aside)
    return aside
