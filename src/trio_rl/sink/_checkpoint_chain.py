"""An incremental checkpoint chain: a full file, then deltas that each name the file they were
written after; reading one replays its chain, and a background compaction rewrites a long
chain's newest delta as a full file. The files a manager wrote, their links and their pruning
live here too (a full file is a chain of one).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import secrets
import threading
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .._durable import atomic_write, fsync_dir, write_synced
from ..samples import OpenGroup
from ._checkpoint_compaction import Compaction
from ._checkpoint_format import (
    DELTA_SCHEMA_VERSION,
    ChainFile,
    Checkpoint,
    CheckpointSnapshot,
    Part,
    checkpoint_name,
    encode_meta,
    list_checkpoints,
    read_part,
    step_of,
    write_body,
    write_checkpoint,
    write_stream,
)
from ._checkpoint_schema import check_state
from ._codec import CodecError
from ._errors import CheckpointError
from ._sink import TrainSink, restoring, snapshot_changes
from ._sink_state import RestoreReport, SinkDelta, SinkState
from ._types import TrainingSample

_TMP = re.compile(r"^step_\d+\.ckpt\.\d+\.tmp$")
_COMPACT_TMP = re.compile(r"^step_\d+\.ckpt\.\d+\.compact$")


@attrs.frozen
class IncrementalSnapshot:
    """An incremental manager's snapshot: what the loop took (a full `SinkState` or a
    `SinkDelta`, O(what changed)) waits in the manager under ``epoch`` until it is written."""

    step: int
    progress: Mapping[str, Any]
    cursor: Any
    epoch: int


def read_checkpoint(
    path: str | os.PathLike[str], *, stop: threading.Event | None = None
) -> Checkpoint:
    """Verify and decode a checkpoint file (blocking; run it in a worker thread).

    A delta checkpoint (schema version 2) is read with the files it was written after (named
    ``step_<parent>.ckpt`` in the same directory), back to a full one, and replayed.

    Raises :class:`CheckpointError` naming the file when it is missing, truncated, corrupt, of an
    unknown schema version, or malformed (a delta's: naming the file of the chain that is).
    ``stop`` set (by an async caller that was cancelled), the read stops at its next record
    with `_ReadStoppedError`.
    """
    p = Path(path)
    name = str(p)
    head = read_part(p, stop)
    parts = [head]
    while parts[-1].link.parent is not None:
        child = parts[-1]
        assert child.link.parent is not None
        parent_path = p.with_name(checkpoint_name(child.link.parent))
        try:
            parent = read_part(parent_path, stop)
        except CheckpointError as exc:
            raise CheckpointError(
                name, f"replays {parent_path.name}, which is unusable: {exc}"
            ) from exc
        if parent.link.chain != child.link.chain or parent.link.seq != child.link.seq - 1:
            raise CheckpointError(
                str(child.path),
                f"a delta after {parent_path.name} (chain {child.link.chain}, position "
                f"{child.link.seq - 1}), but that file is chain {parent.link.chain}, position "
                f"{parent.link.seq}: not the checkpoint it was written after",
            )
        parts.append(parent)
    if len(parts) == 1:
        assert head.sink is not None
        return Checkpoint(
            path=p,
            step=head.step,
            progress=head.progress,
            cursor=head.cursor,
            sink=head.sink,
            chain=_chain_of(parts),
        )
    base = parts[-1].sink
    assert base is not None
    queued = {ts.arrival: ts for ts in base.queued}
    groups = {og.group_id: og for og in base.open_groups}
    for part in reversed(parts[:-1]):
        assert part.delta is not None
        _apply(queued, groups, part.delta)
    d = head.delta
    assert d is not None
    state = SinkState(
        step=d.step,
        next_arrival=d.next_arrival,
        counters=d.counters,
        window=d.window,
        queued=tuple(queued[a] for a in sorted(queued)),
        open_groups=tuple(groups.values()),
    )
    try:
        check_state(state)
    except CodecError as exc:
        raise CheckpointError(
            str(p), f"{exc.field}: {exc.reason} (replayed from {parts[-1].path.name})"
        ) from exc
    return Checkpoint(
        path=p,
        step=head.step,
        progress=head.progress,
        cursor=head.cursor,
        sink=state,
        chain=_chain_of(parts),
    )


def _apply(queued: dict[int, TrainingSample], groups: dict[str, OpenGroup], d: SinkDelta) -> None:
    """Replay one delta onto a chain's state: removals, puts, closes, then group records."""
    for a in d.removed:
        queued.pop(a, None)
    for ts in d.put:
        queued[ts.arrival] = ts
    for gid in d.closed:
        groups.pop(gid, None)
    for og in d.groups:
        groups[og.group_id] = og


def _chain_of(parts: list[Part]) -> tuple[ChainFile, ...]:
    return tuple(
        ChainFile(
            path=part.path,
            parent=None
            if part.link.parent is None
            else part.path.with_name(checkpoint_name(part.link.parent)),
            chain=part.link.chain,
            seq=part.link.seq,
            size=part.size,
        )
        for part in parts
    )


@attrs.define(eq=False)
class _Mirror:
    """The state of the last file an incremental manager wrote (queued samples shared with the
    sink, open-group records owned): what a delta is applied to and a compaction writes."""

    path: Path
    step: int
    chain: int
    seq: int
    epoch: int
    progress: Mapping[str, Any]
    cursor: Any
    head: SinkDelta  # step, next_arrival, counters, window (put/removed/... unused)
    queued: dict[int, TrainingSample]
    groups: dict[str, OpenGroup]

    @classmethod
    def of(cls, state: SinkState, epoch: int) -> _Mirror:
        return cls(
            path=Path(),
            step=-1,
            chain=-1,
            seq=-1,
            epoch=epoch,
            progress={},
            cursor=None,
            head=_head_of(state),
            queued={ts.arrival: ts for ts in state.queued},
            groups={og.group_id: og for og in state.open_groups},
        )

    def state(self, *, ordered: bool = True) -> SinkState:
        """The mirrored state (samples shared); ``ordered=False`` leaves the queue in the
        mirror's order, for a compaction that sorts it in its own thread."""
        h = self.head
        queued = self.queued
        return SinkState(
            step=h.step,
            next_arrival=h.next_arrival,
            counters=h.counters,
            window=h.window,
            queued=tuple(queued[a] for a in sorted(queued)) if ordered else tuple(queued.values()),
            open_groups=tuple(self.groups.values()),
        )


def _head_of(x: SinkState | SinkDelta) -> SinkDelta:
    return SinkDelta(x.step, x.next_arrival, x.counters, x.window, (), (), (), ())


def _compose(deltas: Sequence[SinkDelta]) -> SinkDelta:
    """One delta with the effect of applying ``deltas`` in order."""
    if len(deltas) == 1:
        return deltas[0]
    queued: dict[int, TrainingSample | None] = {}
    groups: dict[str, OpenGroup] = {}
    closed: dict[str, None] = {}
    for d in deltas:
        for a in d.removed:
            queued[a] = None
        for ts in d.put:
            queued[ts.arrival] = ts
        for gid in d.closed:
            groups.pop(gid, None)
            closed[gid] = None
        for og in d.groups:
            groups[og.group_id] = og
    last = deltas[-1]
    return SinkDelta(
        step=last.step,
        next_arrival=last.next_arrival,
        counters=last.counters,
        window=last.window,
        put=tuple(ts for _, ts in sorted(queued.items()) if ts is not None),
        removed=tuple(sorted(a for a, ts in queued.items() if ts is None)),
        groups=tuple(groups.values()),
        closed=tuple(closed),
    )


class CheckpointChain:
    """A manager's files: those it wrote (the only ones it deletes), the links between them and
    their pruning; incremental, the snapshots taken and not written yet, the mirror of its last
    file and the background compaction."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        incremental: bool,
        compact_ratio: float,
        max_chain: int,
        background_compaction: bool,
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.incremental = incremental
        self.compact_ratio = compact_ratio
        self.max_chain = max_chain
        self.background_compaction = background_compaction
        #: Guards the files, their links and ``written``: written by worker threads.
        self.lock = threading.RLock()
        #: The checkpoint files written here (in this process): the only ones ever deleted.
        self.written: set[Path] = set()
        #: Bytes each write put in its checkpoint file (compactions excluded), newest last.
        self.written_bytes: list[int] = []
        #: Compactions completed (a delta rewritten as a full file).
        self.compactions = 0
        # snapshots taken on the loop, not written yet: its own lock, never held during I/O
        self.pending_lock = threading.Lock()
        self.pending: list[tuple[int, SinkState | SinkDelta]] = []
        self.mirror: _Mirror | None = None
        self.need_full = False
        self.links: dict[Path, tuple[Path | None, int, int, int]] = {}  # parent, chain, seq, size
        self.compaction = Compaction(self.lock)

    def snapshot(
        self, sink: TrainSink, step: int | None, cursor: Any, progress: Mapping[str, Any] | None
    ) -> IncrementalSnapshot:
        changes = sink.changes
        part: SinkState | SinkDelta
        if changes.active and changes.owner is self and not self.need_full:
            part = snapshot_changes(sink)
        else:
            part = sink.state_dict()
            changes.start(self)
            self.need_full = False
        with self.pending_lock:
            self.pending.append((changes.epoch, part))
        return IncrementalSnapshot(
            step=sink.step - 1 if step is None else step,
            progress=copy.deepcopy(dict(progress or {})),
            cursor=copy.deepcopy(cursor),
            epoch=changes.epoch,
        )

    def restoring(self, sink: TrainSink, ckpt: Checkpoint) -> Generator[None, None, RestoreReport]:
        """`TrainSink.load_state_dict` from ``ckpt`` (with its ``missing_files``), as a generator
        (see :func:`restoring`; the caller checked the state's invariants); an incremental
        manager then goes on from ``ckpt``'s file: its next checkpoint is a delta after it
        (what the restore itself changed included) rather than a full one. The files it replays
        stay the run's that wrote them: never deleted by this manager."""
        head = ckpt.chain[0] if ckpt.chain else None
        same_dir = ckpt.path.parent.resolve() == self.directory.resolve()
        if not self.incremental or head is None or head.chain is None or not same_dir:
            return (yield from restoring(sink, ckpt.sink, missing_files=ckpt.missing_files))
        report = yield from restoring(sink, ckpt.sink, missing_files=ckpt.missing_files, track=self)
        mirror = _Mirror.of(ckpt.sink, sink.changes.start_epoch)
        mirror.path, mirror.step, mirror.chain, mirror.seq = (
            ckpt.path,
            ckpt.step,
            head.chain,
            head.seq,
        )
        mirror.progress, mirror.cursor = ckpt.progress, ckpt.cursor
        with self.lock:
            for f in ckpt.chain:
                self.links[f.path] = (f.parent, f.chain or 0, f.seq, f.size)
            self.mirror, self.need_full = mirror, False
        return report

    def write_file(self, target: Path, snap: CheckpointSnapshot | IncrementalSnapshot) -> Path:
        """Blocking, under ``lock``: write ``snap`` at ``target``, prune to ``keep`` and remove
        the temporary files a crashed writer left behind."""
        if isinstance(snap, IncrementalSnapshot):
            path = self.write(target, snap)
        else:
            path = write_checkpoint(target, snap)
            self.written_bytes.append(path.stat().st_size)
            self.links.pop(path, None)
        self.written.add(path)
        self.prune(snap.step)
        compacting = self.compaction.running
        with os.scandir(self.directory) as entries:
            for entry in entries:
                # left behind by a writer (or a compaction) that crashed mid-save; a directory
                # of that name is not a file a writer left: not ours to delete
                stale = _TMP.match(entry.name) or (
                    not compacting and _COMPACT_TMP.match(entry.name)
                )
                if stale and not entry.is_dir(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
        # after this step's file is written: a persistent failure loses nothing accepted
        self.compaction.check()
        return path

    def write(self, target: Path, snap: IncrementalSnapshot) -> Path:
        """Apply the pending snapshots up to ``snap``'s to the mirror; write a delta after the
        mirror's file, or a full file when there is none to follow (the first, a re-save of the
        same step, after a failure). Then maybe start a compaction."""
        with self.pending_lock:
            parts = [(e, p) for e, p in self.pending if e <= snap.epoch]
            self.pending = [(e, p) for e, p in self.pending if e > snap.epoch]
        mirror = self.mirror
        fulls = [i for i, (_, p) in enumerate(parts) if isinstance(p, SinkState)]
        try:
            if fulls:
                _, state = parts[fulls[-1]]
                assert isinstance(state, SinkState)
                mirror = _Mirror.of(state, parts[fulls[-1]][0])
                deltas = [p for _, p in parts[fulls[-1] + 1 :]]
                parent: Path | None = None
            else:
                if mirror is None or not parts or parts[0][0] != mirror.epoch + 1:
                    raise CheckpointError(
                        str(target),
                        "incremental snapshot out of order (an earlier one was not written, or "
                        "its write failed): the next checkpoint will be a full one",
                    )
                deltas = [p for _, p in parts]
                parent = mirror.path
                # the parent: this manager's last file, or the one it resumed from (`restore`)
                if mirror.step >= snap.step or parent not in self.links or not parent.exists():
                    parent = None
            delta = _compose([d for d in deltas if isinstance(d, SinkDelta)]) if deltas else None
            if delta is not None:
                _apply(mirror.queued, mirror.groups, delta)
                mirror.head = _head_of(delta)
            mirror.epoch = snap.epoch
            mirror.progress, mirror.cursor = snap.progress, snap.cursor
            if parent is None or delta is None:
                chain, seq = secrets.randbits(62), 0
                size = _write_full(target, snap, mirror.state(), chain)
                self.links[target] = (None, chain, seq, size)
            else:
                chain, seq = mirror.chain, mirror.seq + 1
                size = _write_delta(target, snap, delta, mirror, seq)
                self.links[target] = (parent, chain, seq, size)
        except BaseException:
            self.mirror, self.need_full = None, True
            raise
        mirror.path, mirror.step, mirror.chain, mirror.seq = target, snap.step, chain, seq
        self.mirror = mirror
        self.written.add(target)  # before a compaction, which checks it
        self.written_bytes.append(size)
        self.maybe_compact()
        return target

    def maybe_compact(self) -> None:
        mirror = self.mirror
        if mirror is None or self.compaction.running:
            return
        length = _chain_length(self.links, mirror.path)
        if length is None:
            return
        n, delta_bytes, full_bytes = length
        if delta_bytes <= self.compact_ratio * full_bytes and n < self.max_chain:
            return
        # an owned view of the mirror (samples shared): the writer goes on changing the mirror
        state = mirror.state(ordered=False)
        snap = CheckpointSnapshot(mirror.step, mirror.progress, mirror.cursor, state)
        job = functools.partial(self.compact, mirror.path, mirror.chain, mirror.seq, snap)
        self.compaction.start(mirror.path, job, background=self.background_compaction)

    def compact(self, path: Path, chain: int, seq: int, snap: CheckpointSnapshot) -> None:
        """Rewrite the delta ``path`` as a full file with the same content (atomically); the
        files before it are then needed only by older checkpoints, and pruned with them."""
        s = snap.sink
        state = attrs.evolve(s, queued=tuple(sorted(s.queued, key=lambda ts: ts.arrival)))
        full = attrs.evolve(snap, sink=state)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.compact")
        try:
            size = write_synced(
                tmp,
                lambda f: write_stream(
                    f,
                    full,
                    str(path),
                    link={"chain": chain, "seq": seq},
                    abort=self.compaction.abort,
                ),
            )
            with self.lock:
                link = self.links.get(path)
                if path not in self.written or link is None or link[1:3] != (chain, seq):
                    tmp.unlink(missing_ok=True)  # replaced or pruned meanwhile
                    return
                os.replace(tmp, path)
                fsync_dir(path.parent)
                self.links[path] = (None, chain, seq, size)
                self.compactions += 1
                mirror = self.mirror
                self.prune(mirror.step if mirror is not None else step_of(path))
        except BaseException:
            # the failure (or the stop) is the caller's, `Compaction`'s; the file is ours
            _remove(tmp)
            raise

    def prune(self, step: int) -> None:
        """Delete own checkpoints newer than ``step`` (an abandoned run's) and all but the newest
        ``keep`` others, except files a kept one depends on."""
        own = [p for p in list_checkpoints(self.directory) if p in self.written]
        newer = [p for p in own if step_of(p) > step]
        kept = [p for p in own if p not in newer][-self.keep :]
        needed: set[Path] = set()
        for p in kept:
            q: Path | None = p
            while q is not None and q not in needed:
                needed.add(q)
                link = self.links.get(q)
                q = None if link is None else link[0]
        for old in own:
            if old not in needed:
                old.unlink(missing_ok=True)
                self.written.discard(old)
                self.links.pop(old, None)


def _remove(path: Path) -> None:
    """Remove a compaction's temporary file; what stands there is left when it is no file
    (the failure being reported names the cause)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _write_full(target: Path, snap: IncrementalSnapshot, state: SinkState, chain: int) -> int:
    """The first file of a new chain ``chain``: a full checkpoint of ``state``; its size."""
    full = CheckpointSnapshot(snap.step, snap.progress, snap.cursor, state)
    link = {"chain": chain, "seq": 0}
    return atomic_write(target, lambda f: write_stream(f, full, str(target), link=link))


def _write_delta(
    target: Path, snap: IncrementalSnapshot, d: SinkDelta, mirror: _Mirror, seq: int
) -> int:
    """Delta ``d`` as position ``seq`` of the mirror's chain, after the mirror's file; its
    size."""
    meta = encode_meta(snap.step, snap.progress, snap.cursor, d, len(d.put), len(d.groups)) | {
        "kind": "delta",
        "chain": mirror.chain,
        "seq": seq,
        "parent": mirror.step,
        "removed": list(d.removed),
        "closed": list(d.closed),
    }
    return atomic_write(
        target,
        lambda f: write_body(f, DELTA_SCHEMA_VERSION, meta, d.put, d.groups, str(target)),
    )


def _chain_length(
    links: Mapping[Path, tuple[Path | None, int, int, int]], path: Path
) -> tuple[int, int, int] | None:
    """The deltas from ``path`` back to its full file: how many, their bytes and the full
    file's bytes; None when ``path`` is a full file or a link is unknown."""
    n, delta_bytes, q = 0, 0, path
    link = links.get(q)
    while link is not None and link[0] is not None:
        n, delta_bytes = n + 1, delta_bytes + link[3]
        q = link[0]
        link = links.get(q)
    if link is None or n == 0:
        return None
    return n, delta_bytes, link[3]
