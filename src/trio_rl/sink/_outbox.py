"""The outbox file format: the exact payload bytes of one step, kept until its delivery is
confirmed (``outbox_step_<N>.bin`` next to the checkpoints).

File format (version 1)::

    header   b"TRIORLOB"  u16 version  u16 ranks  u64 step                          20 bytes
    body     per rank: u64 size, then that many payload bytes
    trailer  u32 crc32 of header and body  b"OBOXEND!"                              12 bytes

All integers little-endian. Writes are atomic and durable (temporary file, fsync, rename,
fsync of the directory); a truncated or corrupt file raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from .._durable import atomic_write
from ._errors import CheckpointError

__all__ = ["read_outbox_file", "write_outbox_file"]

#: The first bytes of every outbox file, and the name of step N's.
OUTBOX_MAGIC = b"TRIORLOB"
OUTBOX_NAME = re.compile(r"^outbox_step_(\d+)\.bin$")


def outbox_name(step: int) -> str:
    """The file name of step ``step``'s outbox (what `OUTBOX_NAME` matches)."""
    return f"outbox_step_{step:08d}.bin"


_VERSION = 1
_END = b"OBOXEND!"
_HEADER = struct.Struct("<8sHHQ")
_TRAILER = struct.Struct("<I8s")
_U64 = struct.Struct("<Q")


def write_outbox_file(
    target: Path, step: int, payloads: Sequence[bytes | bytearray | memoryview]
) -> Path:
    """Blocking: write step ``step``'s payloads (one per rank) to ``target`` atomically."""

    def write(f: BinaryIO) -> None:
        head = _HEADER.pack(OUTBOX_MAGIC, _VERSION, len(payloads), step)
        f.write(head)
        crc = zlib.crc32(head)
        for payload in payloads:
            size = _U64.pack(memoryview(payload).nbytes)
            f.write(size)
            f.write(payload)
            crc = zlib.crc32(payload, zlib.crc32(size, crc))
        f.write(_TRAILER.pack(crc, _END))

    atomic_write(target, write)
    return target


def read_outbox_file(path: Path, step: int) -> list[bytes] | None:
    """Blocking: the payloads of step ``step`` in ``path``, or None when there is no file.

    A truncated or corrupt outbox raises `CheckpointError` naming the file and offset.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    name = str(path)
    end = len(data) - _TRAILER.size
    if end < _HEADER.size:
        raise CheckpointError(name, f"outbox truncated ({len(data)} bytes)")
    crc, tail = _TRAILER.unpack_from(data, end)
    if tail != _END:
        raise CheckpointError(name, f"outbox truncated: no end marker at byte {end + 4}")
    if zlib.crc32(memoryview(data)[:end]) != crc:
        raise CheckpointError(name, "outbox checksum mismatch (corrupt)")
    magic, version, ranks, got_step = _HEADER.unpack_from(data, 0)
    if magic != OUTBOX_MAGIC or version != _VERSION or got_step != step:
        raise CheckpointError(
            name, f"not an outbox of step {step} (magic {magic!r}, version {version})"
        )
    pos, out = _HEADER.size, []
    for rank in range(ranks):
        if pos + _U64.size > end:
            raise CheckpointError(name, f"outbox rank {rank}: truncated at byte {pos}")
        (size,) = _U64.unpack_from(data, pos)
        pos += _U64.size
        if pos + size > end:
            raise CheckpointError(name, f"outbox rank {rank}: truncated at byte {pos}")
        out.append(data[pos : pos + size])
        pos += size
    if pos != end:
        raise CheckpointError(name, f"outbox: {end - pos} stray bytes at byte {pos}")
    return out
