"""The checkpoint file format: progress, the data-source cursor and the sink state, written as
one unit into one file.

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
incremental manager carries ``chain`` and ``seq`` too. See docs/sink.md.
"""

from __future__ import annotations

import io
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import attrs
import msgpack

from .._durable import atomic_write
from ..samples import OpenGroup
from ._checkpoint_schema import (
    Link,
    Meta,
    check_state,
    decode_link,
    decode_meta,
    decode_open_group,
)
from ._codec import (
    CodecError,
    decode_training_sample,
    encode_prompt,
    encode_sample,
    encode_training_sample,
)
from ._errors import CheckpointError, TrainError
from ._sink_state import SinkDelta, SinkState
from ._types import TrainingSample

_R = TypeVar("_R")

SCHEMA_VERSION = 1
#: Delta checkpoints (written by an incremental `CheckpointManager`) are schema version 2.
DELTA_SCHEMA_VERSION = 2
#: The first bytes of every checkpoint file.
CHECKPOINT_MAGIC = b"TRIORLCK"
_END = b"TRIOEND!"
_HEADER = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<QI8s")
CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.ckpt$")
_FLUSH = 8 << 20
#: A background compaction sleeps this long every 8 records (GIL handed to the loop).
_YIELD = 0.0005


def checkpoint_name(step: int) -> str:
    """The file name of step ``step``'s checkpoint (what `CHECKPOINT_NAME` matches)."""
    return f"step_{step:08d}.ckpt"


@attrs.frozen
class CheckpointSnapshot:
    """An owned copy of everything a checkpoint records, taken on the event loop."""

    step: int
    progress: Mapping[str, Any]
    cursor: Any
    sink: SinkState


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
STOP_EVERY = 64


def stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise _ReadStoppedError


def write_stream(
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
    write_body(
        f,
        SCHEMA_VERSION,
        encode_meta(
            snap.step, snap.progress, snap.cursor, sink, len(sink.queued), len(sink.open_groups)
        )
        | dict(link or {}),
        sink.queued,
        sink.open_groups,
        name,
        abort,
    )


def encode_meta(
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


def write_body(
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
    f.write(_HEADER.pack(CHECKPOINT_MAGIC, version, 0, 0))
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


def encode_checkpoint(snap: CheckpointSnapshot) -> bytes:
    """A snapshot as checkpoint bytes (the same format as the files)."""
    buf = io.BytesIO()
    write_stream(buf, snap, "<memory>")
    return buf.getvalue()


def write_checkpoint(path: str | os.PathLike[str], snap: CheckpointSnapshot) -> Path:
    """Serialise and write a snapshot atomically (blocking; run it in a worker thread).

    Writes ``<path>.<pid>.tmp``, fsyncs it, renames it over ``path`` and fsyncs the directory. On
    any error the temporary file is removed and the previous file at ``path`` is untouched.
    """
    target = Path(path)
    atomic_write(target, lambda f: write_stream(f, snap, str(target)))
    return target


def file_schema_version(path: str | os.PathLike[str]) -> int:
    """The schema version in a checkpoint file's header (1: full, 2: a delta); call it on a
    file that `read_checkpoint` accepted."""
    with open(path, "rb") as f:
        return int(_HEADER.unpack(f.read(_HEADER.size))[1])


@attrs.frozen
class Part:
    """One decoded file: a full checkpoint (``sink``) or a delta."""

    size: int
    path: Path
    step: int
    progress: Mapping[str, Any]
    cursor: Any
    link: Link
    sink: SinkState | None = None
    delta: SinkDelta | None = None


def read_part(p: Path, stop: threading.Event | None = None) -> Part:
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
) -> Part:
    if size < _HEADER.size + _TRAILER.size:
        raise CheckpointError(name, f"truncated ({size} bytes)")
    magic, version, flags, reserved = _HEADER.unpack(f.read(_HEADER.size))
    if magic != CHECKPOINT_MAGIC:
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
        stopped(stop)
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
) -> Part:
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
            if i % STOP_EVERY == 0:
                stopped(stop)
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
    return _part(p, body_len + _HEADER.size + _TRAILER.size, meta, link, queued, groups)


def _part(
    p: Path,
    size: int,
    meta: Meta,
    link: Link,
    queued: tuple[TrainingSample, ...],
    groups: tuple[OpenGroup, ...],
) -> Part:
    """A decoded file's records as a delta (``link`` names a parent) or a full checkpoint,
    whose state is checked against the sink's invariants."""
    common = {
        "size": size,
        "path": p,
        "step": meta.step,
        "progress": meta.progress,
        "cursor": meta.cursor,
        "link": link,
    }
    if link.parent is not None:
        return Part(
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
        raise CheckpointError(str(p), f"{exc.field}: {exc.reason}") from exc
    return Part(**common, sink=state)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete-named checkpoint files in ``directory``, oldest first (temporary files are
    ignored)."""
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        m = CHECKPOINT_NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), Path(entry.path)))
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    m = CHECKPOINT_NAME.match(path.name)
    return int(m.group(1)) if m else -1
