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
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import attrs
import msgpack
import trio

from ._checkpoint_schema import check_state, decode_meta, decode_open_group
from ._codec import (
    CodecError,
    decode_training_sample,
    encode_prompt,
    encode_sample,
    encode_training_sample,
)
from ._errors import CheckpointError
from ._outbox import fsync_dir, read_outbox_file, write_outbox_file
from ._sink import TrainSink
from ._sink_state import SinkState, payload_files_of_state

__all__ = [
    "SCHEMA_VERSION",
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
_MAGIC = b"TRIORLCK"
_END = b"TRIOEND!"
_HEADER = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<QI8s")
_NAME = re.compile(r"^step_(\d+)\.ckpt$")
_TMP = re.compile(r"^step_\d+\.ckpt\.\d+\.tmp$")
_FLUSH = 8 << 20
_OUTBOX = re.compile(r"^outbox_step_(\d+)\.bin$")


@attrs.frozen
class CheckpointSnapshot:
    """An owned copy of everything a checkpoint records, taken on the event loop."""

    step: int
    progress: Mapping[str, Any]
    cursor: Any
    sink: SinkState


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


def _write_stream(f: BinaryIO, snap: CheckpointSnapshot, name: str) -> None:
    packer = msgpack.Packer(use_bin_type=True)
    sink = snap.sink
    meta = {
        "step": snap.step,
        "progress": dict(snap.progress),
        "cursor": snap.cursor,
        "sink": {
            "step": sink.step,
            "next_arrival": sink.next_arrival,
            "counters": attrs.asdict(sink.counters),
            "window": attrs.asdict(sink.window),
        },
        "n_queued": len(sink.queued),
        "n_open": len(sink.open_groups),
    }
    f.write(_HEADER.pack(_MAGIC, SCHEMA_VERSION, 0, 0))
    body = _Body(f)
    try:
        body.add(packer.pack(meta))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(name, f"progress or cursor is not MessagePack-able: {exc}") from exc
    for i, ts in enumerate(sink.queued):
        try:
            body.add(packer.pack(encode_training_sample(ts)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(
                name, f"queued[{i}] (group {ts.group_id}, sample {ts.sample_index}): {exc}"
            ) from exc
    for og in sink.open_groups:
        try:
            rec = [
                og.group_id,
                encode_prompt(og.prompt),
                og.group_size,
                og.policy_version_at_start,
                [encode_sample(m) for m in og.arrived],
            ]
            body.add(packer.pack(rec))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(
                name, f"open group {og.group_id}: label or metadata not MessagePack-able: {exc}"
            ) from exc
    body.flush()
    f.write(_TRAILER.pack(body.length, body.crc, _END))


def encode_checkpoint(snap: CheckpointSnapshot) -> bytes:
    """A snapshot as checkpoint bytes (the same format as the files)."""
    buf = io.BytesIO()
    _write_stream(buf, snap, "<memory>")
    return buf.getvalue()


def decode_checkpoint(data: bytes, name: str = "<memory>") -> Checkpoint:
    """Decode checkpoint bytes; errors name ``name``."""
    return _read_stream(io.BytesIO(data), len(data), Path(name), name)


def write_checkpoint(path: str | os.PathLike[str], snap: CheckpointSnapshot) -> Path:
    """Serialise and write a snapshot atomically (blocking; run it in a worker thread).

    Writes ``<path>.<pid>.tmp``, fsyncs it, renames it over ``path`` and fsyncs the directory. On
    any error the temporary file is removed and the previous file at ``path`` is untouched.
    """
    target = Path(path)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            _write_stream(f, snap, str(target))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Verify and decode a checkpoint file (blocking; run it in a worker thread).

    Raises :class:`CheckpointError` naming the file when it is missing, truncated, corrupt, of an
    unknown schema version, or malformed.
    """
    p = Path(path)
    name = str(p)
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed in finally
    except OSError as exc:
        raise CheckpointError(name, f"cannot open: {exc.strerror}") from exc
    try:
        return _read_stream(f, os.fstat(f.fileno()).st_size, p, name)
    finally:
        f.close()


def _read_stream(f: BinaryIO, size: int, p: Path, name: str) -> Checkpoint:
    if size < _HEADER.size + _TRAILER.size:
        raise CheckpointError(name, f"truncated ({size} bytes)")
    magic, version, flags, reserved = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC:
        raise CheckpointError(name, "not a trio-rl checkpoint (bad magic)")
    if version != SCHEMA_VERSION:
        raise CheckpointError(
            name, f"unknown schema version {version} (this library reads {SCHEMA_VERSION})"
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
    return _decode_body(unpacker, p, body_len)


def _decode_body(unpacker: msgpack.Unpacker, p: Path, body_len: int) -> Checkpoint:
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
    except CodecError as exc:
        raise bad(exc, off) from exc

    def records(n: int, field: str, decode: Callable[[Any, str], _R]) -> tuple[_R, ...]:
        out = []
        for i in range(n):
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
    return Checkpoint(
        path=p, step=meta.step, progress=meta.progress, cursor=meta.cursor, sink=state
    )


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


class CheckpointManager:
    """One checkpoint per step in ``directory``, keeping the last ``keep`` it wrote itself.

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
    ) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointManager keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.limiter = limiter
        self.payload_root = Path(payload_root) if payload_root is not None else None
        self._written: set[Path] = set()

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}.ckpt"

    def outbox_path(self, step: int) -> Path:
        """Where the payload bytes of ``step`` wait until their delivery is confirmed."""
        return self.directory / f"outbox_step_{step:08d}.bin"

    def snapshot(
        self,
        sink: TrainSink,
        *,
        step: int | None = None,
        cursor: Any = None,
        progress: Mapping[str, Any] | None = None,
    ) -> CheckpointSnapshot:
        """Snapshot on the loop (no await): later mutation of the sink cannot tear it.

        ``step`` defaults to the last shipped step (``sink.step - 1``); ``cursor`` is the data
        source's opaque, MessagePack-able state (deep-copied).
        """
        return CheckpointSnapshot(
            step=sink.step - 1 if step is None else step,
            progress=copy.deepcopy(dict(progress or {})),
            cursor=copy.deepcopy(cursor),
            sink=sink.state_dict(),
        )

    def write(self, snap: CheckpointSnapshot) -> Path:
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
        existing = self.list_checkpoints()
        foreign = [
            p
            for p in existing
            if p not in self._written and (_step_of(p) > snap.step or p == target)
        ]
        if foreign:
            self._move_aside(foreign, "superseded by a resumed run")
        path = write_checkpoint(target, snap)
        self._written.add(path)
        own = [p for p in self.list_checkpoints() if p in self._written]
        newer = [p for p in own if _step_of(p) > snap.step]
        for old in newer + [p for p in own if p not in newer][: -self.keep]:
            old.unlink(missing_ok=True)
            self._written.discard(old)
        for entry in os.scandir(self.directory):
            if _TMP.match(entry.name):  # left behind by a writer that crashed mid-save
                Path(entry.path).unlink(missing_ok=True)
        return path

    async def save(self, snap: CheckpointSnapshot) -> Path:
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

    def read(self, path: str | os.PathLike[str]) -> Checkpoint:
        """Blocking load of one checkpoint, with its missing payload files."""
        ckpt = read_checkpoint(path)
        if self.payload_root is None:
            return ckpt
        missing = frozenset(
            f for f in payload_files_of_state(ckpt.sink) if not (self.payload_root / f).exists()
        )
        return attrs.evolve(ckpt, missing_files=missing)

    def read_latest(self, *, require_usable: bool = False) -> Checkpoint | None:
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
                ckpt = self.read(path)
            except CheckpointError as exc:
                broken.append(path)
                reasons.append(str(exc))
                continue
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

        Cancellation: once the thread has started the read completes and its result is
        returned; `trio.Cancelled` arrives at the caller's next checkpoint.
        """
        return await trio.to_thread.run_sync(self.read, path, limiter=self.limiter)

    async def load_latest(self, *, require_usable: bool = False) -> Checkpoint | None:
        """:meth:`read_latest` in a worker thread.

        Cancellation: as for `load`.
        """
        return await trio.to_thread.run_sync(
            functools.partial(self.read_latest, require_usable=require_usable),
            limiter=self.limiter,
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
