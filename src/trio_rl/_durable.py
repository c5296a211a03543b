"""Writing files that must survive a crash: one atomic write, one directory fsync.

A reader (or a restart after a crash) sees either the previous file or the whole new one, never
a partial file: `atomic_write` writes a temporary file, fsyncs it, renames it over the target
and fsyncs the directory, so the rename itself is on disk too. Every module that writes a file
the run depends on (checkpoints, outboxes, the transport's markers, stored ids) uses it instead
of its own temp-then-rename block.

This module sits on the ground floor beside :mod:`trio_rl.errors`: every layer may import it,
and it imports nothing of ours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["Contents", "atomic_write", "fsync_dir", "write_synced"]

#: What `atomic_write` writes: bytes, text (UTF-8) or a function that writes into the open file.
Contents = bytes | bytearray | memoryview | str | Callable[[BinaryIO], object]


def fsync_dir(path: str | os.PathLike[str], *, missing_ok: bool = False) -> None:
    """fsync the directory ``path``, so the renames and creations in it are on disk.
    ``missing_ok``: a directory removed meanwhile (by readers that emptied it) is fine."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, contents: Contents, *, fsync: bool = True) -> int:
    """Create ``path`` with ``contents`` and, with ``fsync``, force it to disk before
    returning; returns its size in bytes. Not atomic by itself: write a temporary name and
    rename it (`atomic_write` does both)."""
    with open(path, "wb") as f:
        if callable(contents):
            contents(f)
        else:
            f.write(contents.encode() if isinstance(contents, str) else contents)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
        return f.tell()


def atomic_write(
    target: str | os.PathLike[str],
    contents: Contents,
    *,
    staging: Path | None = None,
    suffix: str = "tmp",
    fsync: bool = True,
) -> int:
    """Replace ``target`` with ``contents`` atomically and durably; returns the file's size.

    Writes ``<staging or target's directory>/<target name>.<pid>.<suffix>``, fsyncs it, renames
    it over ``target`` and fsyncs ``target``'s directory. On any error (of ``contents`` too)
    the temporary file is removed and the previous file at ``target`` is untouched.
    ``staging`` must be on the same filesystem as ``target``. ``fsync=False`` keeps the
    atomicity but not the durability (for files a caller chose not to sync, such as the file
    transport's with its ``fsync`` switch off).
    """
    target = Path(target)
    tmp = (staging or target.parent) / f"{target.name}.{os.getpid()}.{suffix}"
    try:
        size = write_synced(tmp, contents, fsync=fsync)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(target.parent)
    return size
