"""The one atomic writer: a reader sees the old file or the whole new one, never a part, and a
failed write leaves no temporary file behind."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import pytest

from trio_rl._durable import atomic_write, fsync_dir, write_synced


def test_bytes_text_and_a_writer_each_replace_the_file(tmp_path: Path) -> None:
    target = tmp_path / "state"
    assert atomic_write(target, b"one") == 3
    assert target.read_bytes() == b"one"
    assert atomic_write(target, "twö\n") == len("twö\n".encode())
    assert target.read_text(encoding="utf-8") == "twö\n"

    def write(f: BinaryIO) -> None:
        f.write(b"a")
        f.write(b"bc")

    assert atomic_write(target, write, fsync=False) == 3
    assert target.read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state"
    target.write_bytes(b"old")

    def fail(f: BinaryIO) -> None:
        f.write(b"half")
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="the writer broke"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_staging_writes_the_temporary_elsewhere_on_the_same_filesystem(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "END"
    atomic_write(target, b"7", staging=staging, suffix="end")
    assert target.read_bytes() == b"7"
    assert list(staging.iterdir()) == []


def test_write_synced_is_not_atomic_and_says_its_size(tmp_path: Path) -> None:
    assert write_synced(tmp_path / "f", bytearray(b"xyz")) == 3
    assert (tmp_path / "f").read_bytes() == b"xyz"


def test_fsync_dir_of_a_missing_directory(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "gone")
    fsync_dir(tmp_path / "gone", missing_ok=True)
