"""Checkpoints: progress, the data-source cursor and the sink state, written as one unit.

File format (schema version 1), ``step_<N>.ckpt``::

    header   b"TRIORLCK"  u16 schema version  u16 flags (0)  u32 reserved (0)     16 bytes
    body     a stream of MessagePack objects:
               meta map {"step", "progress", "cursor", "sink", "n_queued", "n_open"}
               n_queued queued training samples (compact records, see ``_codec``)
               n_open open groups [group_id, prompt, group_size, start version, [members]]
    trailer  u64 body length  u32 crc32 of the body  b"TRIOEND!"                   20 bytes

All integers little-endian. A file without a complete trailer is truncated; a checksum mismatch
is corruption; both, and an unknown schema version, raise :class:`CheckpointError` naming the file.
Loading never executes code (no pickle).

A *delta* (schema version 2, written by an incremental `CheckpointManager`) has the same framing;
its meta map adds ``kind: "delta"``, ``chain``, ``seq``, ``parent`` (the step of the file it was
written after) and the lists ``removed`` (arrivals) and ``closed`` (group ids); its records are
the samples queued and the open groups changed since the parent. A full file written by an
incremental manager carries ``chain`` and ``seq`` too. See docs/train.md.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import os
import re
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import attrs
import msgpack
import trio

from ..samples import OpenGroup
from ._checkpoint_schema import (
    Link,
    RunBounds,
    check_state,
    decode_link,
    decode_meta,
    decode_open_group,
    run_bound_problem,
)
from ._codec import (
    CodecError,
    decode_training_sample,
    encode_prompt,
    encode_sample,
    encode_training_sample,
)
from ._errors import CheckpointError, TrainError
from ._outbox import fsync_dir, read_outbox_file, write_outbox_file
from ._sink import (
    TrainSink,
    finish_restore,
    finish_restore_async,
    restoring,
    snapshot_changes,
)
from ._sink_state import (
    RestoreReport,
    SinkDelta,
    SinkState,
    check_restorable,
    payload_files_of_state,
)
from ._types import TrainingSample

__all__ = [
    "SCHEMA_VERSION",
    "DELTA_SCHEMA_VERSION",
    "IncrementalSnapshot",
    "RunBounds",
    "check_run_bounds",
    "encode_checkpoint",
    "decode_checkpoint",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointSnapshot",
    "read_checkpoint",
    "write_checkpoint",
]

logger = logging.getLogger("trio_rl.train")
_R = TypeVar("_R")

SCHEMA_VERSION = 1
#: Delta checkpoints (written by an incremental `CheckpointManager`) are schema version 2.
DELTA_SCHEMA_VERSION = 2
_MAGIC = b"TRIORLCK"
_END = b"TRIOEND!"
_HEADER = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<QI8s")
_NAME = re.compile(r"^step_(\d+)\.ckpt$")
_TMP = re.compile(r"^step_\d+\.ckpt\.\d+\.tmp$")
_COMPACT_TMP = re.compile(r"^step_\d+\.ckpt\.\d+\.compact$")
_FLUSH = 8 << 20
#: A background compaction sleeps this long every 8 records (GIL handed to the loop).
_YIELD = 0.0005
_OUTBOX = re.compile(r"^outbox_step_(\d+)\.bin$")


@attrs.frozen
class CheckpointSnapshot:
    """An owned copy of everything a checkpoint records, taken on the event loop."""

    step: int
    progress: Mapping[str, Any]
    cursor: Any
    sink: SinkState


@attrs.frozen
class IncrementalSnapshot:
    """An incremental manager's snapshot: what the loop took (a full `SinkState` or a
    `SinkDelta`, O(what changed)) waits in the manager under ``epoch`` until it is written."""

    step: int
    progress: Mapping[str, Any]
    cursor: Any
    epoch: int


@attrs.frozen
class ChainFile:
    """One file a checkpoint was read from: itself, or one it replays (see `Checkpoint.chain`)."""

    path: Path
    #: the file it was written after (None: a full checkpoint)
    parent: Path | None
    #: its chain id and position (None / 0: a full checkpoint without them, schema 1 of old)
    chain: int | None
    seq: int
    size: int


@attrs.frozen
class Checkpoint:
    """A loaded checkpoint. ``missing_files`` are payload files its samples name that are gone
    (computed when the manager knows the payload root); pass them to
    :meth:`TrainSink.load_state_dict`.
    """

    path: Path
    step: int
    progress: Mapping[str, Any]
    cursor: Any
    sink: SinkState
    missing_files: frozenset[str] = frozenset()
    #: The files it was read from, itself first, back to the full one it replays from.
    chain: tuple[ChainFile, ...] = ()


class _Body:
    """Buffered body writer that tracks length and crc32."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.chunks, self.pending, self.length, self.crc = f, list[bytes](), 0, 0, 0

    def add(self, data: bytes) -> None:
        self.chunks.append(data)
        self.pending += len(data)
        if self.pending >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.chunks:
            data = b"".join(self.chunks)
            self.f.write(data)
            self.crc = zlib.crc32(data, self.crc)
            self.length += len(data)
            self.chunks, self.pending = [], 0


class _CompactionStoppedError(TrainError):
    """A background compaction was told to stop (the manager is closing)."""


class _ReadStoppedError(TrainError):
    """A read in a worker thread was told to stop: its async caller was cancelled (the
    caller sees `trio.Cancelled`; this never reaches it)."""


#: Records (or payload files) a read handles between two looks at its stop event.
_STOP_EVERY = 64


def _stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise _ReadStoppedError


async def _stoppable(fn: Callable[..., _R], limiter: trio.CapacityLimiter | None) -> _R:
    """``fn(stop=stop)`` in a worker thread that a cancellation reaches at once: ``fn`` only reads
    (or moves files aside only after its last look at ``stop``), so the thread is abandoned,
    told to stop, and ends at its next look, within ``_STOP_EVERY`` records."""
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(
            functools.partial(fn, stop=stop), limiter=limiter, abandon_on_cancel=True
        )
    except trio.Cancelled:
        stop.set()
        raise


def _write_stream(
    f: BinaryIO,
    snap: CheckpointSnapshot,
    name: str,
    *,
    link: Mapping[str, Any] | None = None,
    abort: threading.Event | None = None,
) -> None:
    """A full checkpoint (schema version 1); ``link`` adds the chain fields of an incremental
    manager's base to the header record."""
    sink = snap.sink
    try:
        check_state(sink)
    except CodecError as exc:
        raise _refused(name, exc) from exc
    _write_body(
        f,
        SCHEMA_VERSION,
        _meta(snap.step, snap.progress, snap.cursor, sink, len(sink.queued), len(sink.open_groups))
        | dict(link or {}),
        sink.queued,
        sink.open_groups,
        name,
        abort,
    )


def _meta(
    step: int, progress: Mapping[str, Any], cursor: Any, sink: Any, n_queued: int, n_open: int
) -> dict[str, Any]:
    return {
        "step": step,
        "progress": dict(progress),
        "cursor": cursor,
        "sink": {
            "step": sink.step,
            "next_arrival": sink.next_arrival,
            "counters": attrs.asdict(sink.counters),
            "window": attrs.asdict(sink.window),
        },
        "n_queued": n_queued,
        "n_open": n_open,
    }


def _write_body(
    f: BinaryIO,
    version: int,
    meta: Mapping[str, Any],
    queued: Iterable[TrainingSample],
    open_groups: Iterable[OpenGroup],
    name: str,
    abort: threading.Event | None = None,
) -> None:
    packer = msgpack.Packer(use_bin_type=True)
    try:
        head = packer.pack(meta)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(name, f"progress or cursor is not MessagePack-able: {exc}") from exc
    # The reader's own validator judges every record before it is written: what the writer
    # accepts, the reader reads back (one set of rules, not two that can drift apart).
    _judge(name, head, "meta", lambda obj, _: _judge_meta(obj, version))
    f.write(_HEADER.pack(_MAGIC, version, 0, 0))
    body = _Body(f)
    body.add(head)
    for i, ts in enumerate(queued):
        if abort is not None and i & 7 == 0:
            # a background compaction: stop when told to, and leave the GIL to the event
            # loop between records (a compaction is never waited for, a loop pause is)
            if abort.is_set():
                raise _CompactionStoppedError
            time.sleep(_YIELD)
        what = f"sink.queued[{i}]"
        try:
            rec = packer.pack(encode_training_sample(ts))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(
                name, f"{what} (group {ts.group_id}, sample {ts.sample_index}): {exc}"
            ) from exc
        body.add(_judge(name, rec, what, _check_training_sample))
    for i, og in enumerate(open_groups):
        what = f"sink.open_groups[{i}]"
        try:
            rec = packer.pack(
                [
                    og.group_id,
                    encode_prompt(og.prompt),
                    og.group_size,
                    og.policy_version_at_start,
                    [encode_sample(m) for m in og.arrived],
                ]
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(
                name,
                f"{what} (group {og.group_id}): label or metadata not MessagePack-able: {exc}",
            ) from exc
        body.add(_judge(name, rec, what, decode_open_group))
    body.flush()
    f.write(_TRAILER.pack(body.length, body.crc, _END))


def _judge(name: str, rec: bytes, what: str, decode: Callable[[Any, str], object]) -> bytes:
    """``rec`` (one packed record), judged by the reader's decoder; a record the reader would
    refuse is a `CheckpointError` here, before it is written."""
    try:
        obj = msgpack.unpackb(rec, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack's zoo of types (an unhashable key read back, say)
        raise CheckpointError(name, f"{what}: would not read back: {exc}") from exc
    try:
        decode(obj, what)
    except CodecError as exc:
        raise _refused(name, exc) from exc
    return rec


def _refused(name: str, exc: CodecError) -> CheckpointError:
    return CheckpointError(
        name, f"{exc.field}: {exc.reason} (refused by the writer: the reader would refuse it)"
    )


def _check_training_sample(obj: object, what: str) -> object:
    return decode_training_sample(obj, what, check=True)


def _judge_meta(obj: object, version: int) -> None:
    meta = decode_meta(obj, 2**62)
    decode_link(obj, delta=version == DELTA_SCHEMA_VERSION, step=meta.step)


def _atomic_write(target: Path, write: Callable[[BinaryIO], None], suffix: str = "tmp") -> int:
    """``write`` into ``<target>.<pid>.<suffix>``, fsync, rename over ``target``, fsync the
    directory; returns the file's size. On any error the temporary file is removed."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{suffix}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return size


def encode_checkpoint(snap: CheckpointSnapshot) -> bytes:
    """A snapshot as checkpoint bytes (the same format as the files)."""
    buf = io.BytesIO()
    _write_stream(buf, snap, "<memory>")
    return buf.getvalue()


def write_checkpoint(path: str | os.PathLike[str], snap: CheckpointSnapshot) -> Path:
    """Serialise and write a snapshot atomically (blocking; run it in a worker thread).

    Writes ``<path>.<pid>.tmp``, fsyncs it, renames it over ``path`` and fsyncs the directory. On
    any error the temporary file is removed and the previous file at ``path`` is untouched.
    """
    target = Path(path)
    _atomic_write(target, lambda f: _write_stream(f, snap, str(target)))
    return target


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
    head = _read_part(p, stop)
    parts = [head]
    while parts[-1].link.parent is not None:
        child = parts[-1]
        assert child.link.parent is not None
        parent_path = p.with_name(f"step_{child.link.parent:08d}.ckpt")
        try:
            parent = _read_part(parent_path, stop)
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


def check_run_bounds(ckpt: Checkpoint, bounds: RunBounds) -> None:
    """Refuse a checkpoint that holds more than the run restoring it could have produced (see
    `RunBounds`): one `CheckpointError` naming the file, the field and both values. Call it
    before restoring anything: it is O(records) and allocates nothing per token."""
    problem = run_bound_problem(ckpt.sink, bounds)
    if problem is not None:
        field, got, allowed, why = problem
        raise CheckpointError(str(ckpt.path), f"{field}: {got} in the checkpoint, {allowed}: {why}")


def file_schema_version(path: str | os.PathLike[str]) -> int:
    """The schema version in a checkpoint file's header (1: full, 2: a delta); call it on a
    file that `read_checkpoint` accepted."""
    with open(path, "rb") as f:
        return int(_HEADER.unpack(f.read(_HEADER.size))[1])


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


@attrs.frozen
class _Part:
    """One decoded file: a full checkpoint (``sink``) or a delta."""

    size: int
    path: Path
    step: int
    progress: Mapping[str, Any]
    cursor: Any
    link: Link
    sink: SinkState | None = None
    delta: SinkDelta | None = None


def _chain_of(parts: list[_Part]) -> tuple[ChainFile, ...]:
    return tuple(
        ChainFile(
            path=part.path,
            parent=None
            if part.link.parent is None
            else part.path.with_name(f"step_{part.link.parent:08d}.ckpt"),
            chain=part.link.chain,
            seq=part.link.seq,
            size=part.size,
        )
        for part in parts
    )


def _read_part(p: Path, stop: threading.Event | None = None) -> _Part:
    name = str(p)
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed in finally
    except OSError as exc:
        raise CheckpointError(name, f"cannot open: {exc.strerror}") from exc
    try:
        return _read_stream(f, os.fstat(f.fileno()).st_size, p, name, stop)
    finally:
        f.close()


def decode_checkpoint(data: bytes, name: str = "<memory>") -> Checkpoint:
    """Decode full-checkpoint bytes; errors name ``name``."""
    part = _read_stream(io.BytesIO(data), len(data), Path(name), name)
    if part.sink is None:
        raise CheckpointError(name, "a delta checkpoint: read it from its directory")
    return Checkpoint(
        path=part.path, step=part.step, progress=part.progress, cursor=part.cursor, sink=part.sink
    )


def _read_stream(
    f: BinaryIO, size: int, p: Path, name: str, stop: threading.Event | None = None
) -> _Part:
    if size < _HEADER.size + _TRAILER.size:
        raise CheckpointError(name, f"truncated ({size} bytes)")
    magic, version, flags, reserved = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC:
        raise CheckpointError(name, "not a trio-rl checkpoint (bad magic)")
    if version not in (SCHEMA_VERSION, DELTA_SCHEMA_VERSION):
        raise CheckpointError(
            name,
            f"unknown schema version {version} (this library reads {SCHEMA_VERSION} and "
            f"{DELTA_SCHEMA_VERSION})",
        )
    if flags or reserved:
        raise CheckpointError(name, f"unsupported header flags {flags:#x}/{reserved:#x}")
    f.seek(size - _TRAILER.size)
    body_len, crc, end = _TRAILER.unpack(f.read(_TRAILER.size))
    if end != _END or body_len != size - _HEADER.size - _TRAILER.size:
        raise CheckpointError(name, "truncated or incomplete (no valid trailer)")
    f.seek(_HEADER.size)
    got, left = 0, body_len
    while left:
        _stopped(stop)
        chunk = f.read(min(left, _FLUSH))
        if not chunk:
            raise CheckpointError(name, "truncated while reading")
        got = zlib.crc32(chunk, got)
        left -= len(chunk)
    if got != crc:
        raise CheckpointError(name, "checksum mismatch (corrupt)")
    f.seek(_HEADER.size)
    unpacker = msgpack.Unpacker(
        f,
        raw=False,
        strict_map_key=False,
        max_buffer_size=max(1, min(body_len, 2**31 - 1)),
    )
    return _decode_body(unpacker, p, body_len, delta=version == DELTA_SCHEMA_VERSION, stop=stop)


def _decode_body(
    unpacker: msgpack.Unpacker,
    p: Path,
    body_len: int,
    *,
    delta: bool,
    stop: threading.Event | None = None,
) -> _Part:
    """Decode and fully validate the records; any fault is a :class:`CheckpointError` naming
    the file, the field path and the byte offset of the record holding it.
    """
    name = str(p)

    def nxt(what: str) -> tuple[Any, int]:
        offset = _HEADER.size + unpacker.tell()
        try:
            return next(unpacker), offset
        except StopIteration:
            raise CheckpointError(name, f"{what}: missing at byte offset {offset}") from None
        except Exception as exc:  # msgpack's unpacker raises a zoo of types on bad bytes
            raise CheckpointError(
                name, f"{what}: undecodable MessagePack at byte offset {offset} ({exc})"
            ) from exc

    def bad(exc: CodecError, offset: int) -> CheckpointError:
        return CheckpointError(name, f"{exc.field}: {exc.reason} (record at byte offset {offset})")

    obj, off = nxt("meta")
    try:
        meta = decode_meta(obj, body_len - unpacker.tell())
        link = decode_link(obj, delta=delta, step=meta.step)
    except CodecError as exc:
        raise bad(exc, off) from exc

    def records(n: int, field: str, decode: Callable[[Any, str], _R]) -> tuple[_R, ...]:
        out = []
        for i in range(n):
            if i % _STOP_EVERY == 0:
                _stopped(stop)
            what = f"sink.{field}[{i}]"
            obj, off = nxt(what)
            try:
                out.append(decode(obj, what))
            except CodecError as exc:
                raise bad(exc, off) from exc
        return tuple(out)

    queued = records(meta.n_queued, "queued", decode_training_sample)
    groups = records(meta.n_open, "open_groups", decode_open_group)
    if unpacker.tell() != body_len:
        raise CheckpointError(
            name,
            f"n_open: {meta.n_queued} queued and {meta.n_open} open-group records declared, but "
            f"more data follows at byte offset {_HEADER.size + unpacker.tell()}",
        )
    common = {
        "size": body_len + _HEADER.size + _TRAILER.size,
        "path": p,
        "step": meta.step,
        "progress": meta.progress,
        "cursor": meta.cursor,
        "link": link,
    }
    if delta:
        return _Part(
            **common,
            delta=SinkDelta(
                step=meta.sink_step,
                next_arrival=meta.next_arrival,
                counters=meta.counters,
                window=meta.window,
                put=queued,
                removed=link.removed,
                groups=groups,
                closed=link.closed,
            ),
        )
    state = SinkState(
        step=meta.sink_step,
        next_arrival=meta.next_arrival,
        counters=meta.counters,
        window=meta.window,
        queued=queued,
        open_groups=groups,
    )
    try:
        check_state(state)
    except CodecError as exc:
        raise CheckpointError(name, f"{exc.field}: {exc.reason}") from exc
    return _Part(**common, sink=state)


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


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

    def state(self) -> SinkState:
        h = self.head
        return SinkState(
            step=h.step,
            next_arrival=h.next_arrival,
            counters=h.counters,
            window=h.window,
            queued=tuple(self.queued[a] for a in sorted(self.queued)),
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


class _Chain:
    """An incremental manager's chain: the snapshots taken and not written yet, the mirror of
    its last file, the links between its files, and the background compaction."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.m = manager
        # snapshots taken on the loop, not written yet: its own lock, never held during I/O
        self.pending_lock = threading.Lock()
        self.pending: list[tuple[int, SinkState | SinkDelta]] = []
        self.mirror: _Mirror | None = None
        self.need_full = False
        self.links: dict[Path, tuple[Path | None, int, int, int]] = {}  # parent, chain, seq, size
        self.compactor: threading.Thread | None = None
        self.abort = threading.Event()

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
        same_dir = ckpt.path.parent.resolve() == self.m.directory.resolve()
        if not self.m.incremental or head is None or head.chain is None or not same_dir:
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
        with self.m._lock:
            for f in ckpt.chain:
                self.links[f.path] = (f.parent, f.chain or 0, f.seq, f.size)
            self.mirror, self.need_full = mirror, False
        return report

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
                full = CheckpointSnapshot(snap.step, snap.progress, snap.cursor, mirror.state())
                link = {"chain": chain, "seq": seq}
                size = _atomic_write(
                    target, lambda f: _write_stream(f, full, str(target), link=link)
                )
                self.links[target] = (None, chain, seq, size)
            else:
                chain, seq = mirror.chain, mirror.seq + 1
                d = delta
                meta = _meta(
                    snap.step, snap.progress, snap.cursor, d, len(d.put), len(d.groups)
                ) | {
                    "kind": "delta",
                    "chain": chain,
                    "seq": seq,
                    "parent": mirror.step,
                    "removed": list(d.removed),
                    "closed": list(d.closed),
                }
                size = _atomic_write(
                    target,
                    lambda f: _write_body(
                        f, DELTA_SCHEMA_VERSION, meta, d.put, d.groups, str(target)
                    ),
                )
                self.links[target] = (parent, chain, seq, size)
        except BaseException:
            self.mirror, self.need_full = None, True
            raise
        mirror.path, mirror.step, mirror.chain, mirror.seq = target, snap.step, chain, seq
        self.mirror = mirror
        self.m._written.add(target)
        self.m.written_bytes.append(size)
        self.maybe_compact()
        return target

    def maybe_compact(self) -> None:
        mirror = self.mirror
        if mirror is None or (self.compactor is not None and self.compactor.is_alive()):
            return
        n, delta_bytes, q = 0, 0, mirror.path
        link = self.links.get(q)
        while link is not None and link[0] is not None:
            n, delta_bytes = n + 1, delta_bytes + link[3]
            q = link[0]
            link = self.links.get(q)
        if link is None or n == 0:
            return
        if delta_bytes <= self.m.compact_ratio * link[3] and n < self.m.max_chain:
            return
        # an owned view of the mirror (samples shared): the writer goes on changing the mirror
        job = (
            mirror.path,
            mirror.chain,
            mirror.seq,
            CheckpointSnapshot(
                mirror.step,
                mirror.progress,
                mirror.cursor,
                SinkState(
                    step=mirror.head.step,
                    next_arrival=mirror.head.next_arrival,
                    counters=mirror.head.counters,
                    window=mirror.head.window,
                    queued=tuple(mirror.queued.values()),
                    open_groups=tuple(mirror.groups.values()),
                ),
            ),
        )
        if not self.m.background_compaction:
            self.compact(*job)
            return
        self.compactor = threading.Thread(
            target=self.compact, args=job, name="trio-rl checkpoint compaction", daemon=True
        )
        self.compactor.start()

    def compact(self, path: Path, chain: int, seq: int, snap: CheckpointSnapshot) -> None:
        """Rewrite the delta ``path`` as a full file with the same content (atomically); the
        files before it are then needed only by older checkpoints, and pruned with them."""
        s = snap.sink
        state = attrs.evolve(s, queued=tuple(sorted(s.queued, key=lambda ts: ts.arrival)))
        full = attrs.evolve(snap, sink=state)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.compact")
        try:
            with open(tmp, "wb") as f:
                _write_stream(
                    f, full, str(path), link={"chain": chain, "seq": seq}, abort=self.abort
                )
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            with self.m._lock:
                link = self.links.get(path)
                if path not in self.m._written or link is None or link[1:3] != (chain, seq):
                    tmp.unlink(missing_ok=True)  # replaced or pruned meanwhile
                    return
                os.replace(tmp, path)
                fsync_dir(path.parent)
                self.links[path] = (None, chain, seq, size)
                self.m.compactions += 1
                mirror = self.mirror
                self.prune(mirror.step if mirror is not None else _step_of(path))
        except _CompactionStoppedError:
            tmp.unlink(missing_ok=True)
        except Exception:
            tmp.unlink(missing_ok=True)
            logger.exception("checkpoint compaction of %s failed (the deltas stay)", path)

    def close(self, timeout: float = 60.0) -> None:
        """Blocking: stop a background compaction (its temporary file is removed; the deltas
        stay valid) and wait for its thread, at most ``timeout`` seconds: it stops between two
        records, so only a hung write (a stalled disk) outlasts that; it is then logged and
        left to finish (a daemon thread: it never holds the interpreter's exit)."""
        t = self.compactor
        if t is not None:
            self.abort.set()
            t.join(timeout)
            if t.is_alive():
                logger.warning(
                    "checkpoint compaction did not stop within %.0f s (a stalled write?); "
                    "leaving it: the deltas it would replace stay valid",
                    timeout,
                )
                return
            self.abort.clear()
            self.compactor = None

    def wait(self) -> None:
        """Blocking: wait for a background compaction to finish (tests, benchmarks)."""
        t = self.compactor
        if t is not None:
            t.join()

    def prune(self, step: int) -> None:
        """Delete own checkpoints newer than ``step`` (an abandoned run's) and all but the newest
        ``keep`` others, except files a kept one depends on."""
        own = [p for p in self.m.list_checkpoints() if p in self.m._written]
        newer = [p for p in own if _step_of(p) > step]
        kept = [p for p in own if p not in newer][-self.m.keep :]
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
                self.m._written.discard(old)
                self.links.pop(old, None)


class _Outboxes:
    """The outbox files next to the checkpoints (see `CheckpointManager`)."""

    directory: Path

    def outbox_path(self, step: int) -> Path:
        """Where the payload bytes of ``step`` wait until their delivery is confirmed."""
        return self.directory / f"outbox_step_{step:08d}.bin"

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
            if (m := _OUTBOX.match(e.name)) is not None
        )


class CheckpointManager(_Outboxes):
    """One checkpoint per step in ``directory``, keeping the last ``keep`` it wrote itself.

    With ``incremental=True`` a checkpoint costs what changed since the previous one: the first
    (and any after a restore) is a full checkpoint, each later one a *delta* file (schema
    version 2) holding only the samples queued and settled, the open groups changed and the
    small books since the file it names as its parent; the snapshot on the loop is O(changes)
    too (the sink's `ChangeLog`). Once the deltas since the last full file exceed
    ``compact_ratio`` times its size (or ``max_chain`` files), the newest delta is *compacted*:
    rewritten, atomically and with the same content, as a full file, in a background thread
    (``background_compaction``) or in the writing thread. Pruning keeps the newest ``keep``
    checkpoints and every file they depend on.

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
        if keep < 1:
            raise ValueError(f"CheckpointManager keep must be >= 1, got {keep}")
        if not compact_ratio > 0 or max_chain < 1:
            raise ValueError("CheckpointManager compact_ratio must be > 0 and max_chain >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self.limiter = limiter
        self.payload_root = Path(payload_root) if payload_root is not None else None
        self.incremental = incremental
        self.compact_ratio = compact_ratio
        self.max_chain = max_chain
        self.background_compaction = background_compaction
        self._written: set[Path] = set()
        # incremental state (the lock guards the files and links: written by worker threads)
        self._lock = threading.RLock()
        self._chain = _Chain(self)
        #: Bytes each `write` put in its checkpoint file (compactions excluded), newest last.
        self.written_bytes: list[int] = []
        #: Compactions completed (a delta rewritten as a full file).
        self.compactions = 0

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.ckpt"

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
        """Blocking: stop a background compaction (its temporary file is removed; the deltas
        stay valid) and wait for its thread, at most ``timeout`` seconds (then logged)."""
        self._chain.close(timeout)

    def wait_compaction(self) -> None:
        """Blocking: wait for a background compaction to finish (tests, benchmarks)."""
        self._chain.wait()

    def write(self, snap: CheckpointSnapshot | IncrementalSnapshot) -> Path:
        """Blocking save: atomic write, then rotation.

        Checkpoints of later steps than ``snap.step`` belong to a run that was abandoned by
        resuming from an older checkpoint: those this manager wrote are deleted, others are moved
        aside (otherwise "latest" would jump back to them); a foreign file of ``snap.step``
        itself is moved aside before it is replaced. Then all but the newest ``keep`` of the
        checkpoints this manager wrote are deleted, and temporary files a crashed writer left
        behind. One writer per directory at a time.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path_for(snap.step)
        with self._lock:
            existing = self.list_checkpoints()
            foreign = [
                p
                for p in existing
                if p not in self._written and (_step_of(p) > snap.step or p == target)
            ]
            if foreign:
                self._move_aside(foreign, "superseded by a resumed run")
            if isinstance(snap, IncrementalSnapshot):
                path = self._chain.write(target, snap)
            else:
                path = write_checkpoint(target, snap)
                self.written_bytes.append(path.stat().st_size)
                self._chain.links.pop(path, None)
            self._written.add(path)
            self._chain.prune(snap.step)
            compactor = self._chain.compactor
            compacting = compactor is not None and compactor.is_alive()
            for entry in os.scandir(self.directory):
                # left behind by a writer (or a compaction) that crashed mid-save
                if _TMP.match(entry.name) or (not compacting and _COMPACT_TMP.match(entry.name)):
                    Path(entry.path).unlink(missing_ok=True)
        return path

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
        if not self.directory.is_dir():
            return []
        found = []
        for entry in os.scandir(self.directory):
            m = _NAME.match(entry.name)
            if m:
                found.append((int(m.group(1)), Path(entry.path)))
        return [p for _, p in sorted(found)]

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
            if i % _STOP_EVERY == 0:
                _stopped(stop)
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
            _stopped(stop)  # cancelled: nothing is moved
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
            if _NAME.match(e.name) or _OUTBOX.match(e.name)
        ]
        return self._move_aside(files, "fresh start") if files else None

    def _move_aside(self, files: list[Path], why: str) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.directory.with_name(f"{self.directory.name}.old-{stamp}")
        n = 1
        while aside.exists() and any(
            (aside / f.name).exists() for f in files
        ):  # same second: never overwrite an earlier move
            n += 1
            aside = self.directory.with_name(f"{self.directory.name}.old-{stamp}-{n}")
        aside.mkdir(parents=True, exist_ok=True)
        for f in files:
            os.replace(f, aside / f.name)
            self._written.discard(f)
        fsync_dir(aside)
        fsync_dir(self.directory)
        logger.warning("moved %d checkpoint file(s) (%s) to %s", len(files), why, aside)
        return aside
