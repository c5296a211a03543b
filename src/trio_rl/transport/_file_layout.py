"""The filesystem transport's directory layout, ``<dir>/batches/step_<S>/rank_<R>.bin`` with its
markers, and the blocking file operations on it (run in worker threads by `FileSender` and
`FileReceiver`).
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path

from .._durable import atomic_write
from ._base import Payload
from ._errors import EndOfStreamError, TransportError, TransportIOError

#: The names :func:`batch_path` gives a step's directory and a rank's file.
STEP_DIR = re.compile(r"^step_(\d+)$")
RANK_FILE = re.compile(r"^rank_(\d+)\.bin$")
#: The name of each receiver's marker file in :func:`consumed_dir`.
CONSUMED_FILE = re.compile(r"^rank_(\d+)$")
#: The transport's directory under the directory a sender or receiver is given.
_BATCHES = "batches"


def batches_dir(directory: str | os.PathLike[str]) -> Path:
    """The file transport's own directory under ``directory``: every step's directory and
    the markers live in it."""
    return Path(directory) / _BATCHES


def batch_path(directory: str | os.PathLike[str], step: int, rank: int) -> Path:
    """The path of rank ``rank``'s payload for ``step`` under ``directory``."""
    return batches_dir(directory) / f"step_{step}" / f"rank_{rank}.bin"


def end_marker_path(directory: str | os.PathLike[str]) -> Path:
    """The end-of-stream marker under ``directory``: it holds the step the stream ended at."""
    return batches_dir(directory) / "END"


def consumed_dir(directory: str | os.PathLike[str]) -> Path:
    """Where the receivers record the last step each acknowledged, one file per rank."""
    return batches_dir(directory) / ".consumed"


def consumed_marker_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank``'s receiver records the last step it acknowledged."""
    return consumed_dir(directory) / f"rank_{rank}"


def staging_dir(directory: str | os.PathLike[str]) -> Path:
    """Where a sender writes its files before it renames them into their step's directory."""
    return batches_dir(directory) / ".staging"


def held_steps(directory: str | os.PathLike[str], rank: int) -> list[int]:
    """The steps whose payload file for rank ``rank`` is still under ``directory``, in order
    (what a deleting receiver of that rank has not consumed yet; blocking);
    `TransportIOError` if ``batches/`` cannot be listed."""
    batches = batches_dir(directory)
    try:
        names = os.listdir(batches)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise io_error("cannot list", batches, exc) from exc
    steps = sorted(int(m.group(1)) for name in names if (m := STEP_DIR.match(name)))
    return [step for step in steps if batch_path(directory, step, rank).exists()]


def oldest_batch_step(directory: str | os.PathLike[str], rank: int) -> int | None:
    """The oldest step with a batch file of rank ``rank`` under ``directory`` (blocking), or
    None when there is none; `TransportIOError` if ``batches/`` cannot be listed."""
    return min(held_steps(directory, rank), default=None)


_MMAP_MIN_SIZE = 1 << 20
#: How often one rename retries after readers removed the emptied step directory under it.
_RENAME_ATTEMPTS = 1000


def io_error(what: str, path: Path, exc: OSError) -> TransportIOError:
    return TransportIOError(f"{what} {path}: {exc.strerror or exc}", str(path))


def read_step_marker(path: Path) -> int | None:
    """The step in a marker file (``END``, ``.consumed/rank_R``), or None if it is absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise io_error("cannot read", path, exc) from exc
    try:
        step = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        step = -1
    if step < 0:
        raise TransportError(f"{path}: expected a step number (ASCII decimal), got {raw[:32]!r}")
    return step


def rename_into_step_dir(tmp: Path, final: Path) -> None:
    # Renames ``tmp`` to ``final``, making the step directory again if readers removed it.
    for _ in range(_RENAME_ATTEMPTS):
        try:
            os.mkdir(final.parent)
        except FileExistsError:
            pass  # a file in its place makes the rename fail (NotADirectoryError)
        except OSError as exc:
            raise io_error("cannot create the step directory", final.parent, exc) from exc
        try:
            os.replace(tmp, final)
            return
        except FileNotFoundError as exc:
            if not tmp.exists():
                raise io_error(f"the staged file vanished before {final}:", tmp, exc) from exc
            # A reader removed the emptied step directory after our mkdir: make it again.
        except OSError as exc:
            raise io_error(f"cannot rename {tmp} to", final, exc) from exc
    raise TransportIOError(
        f"cannot rename {tmp} to {final}: the step directory was removed "
        f"{_RENAME_ATTEMPTS} times in a row",
        str(final),
    )


def write_end_marker(directory: Path, staging: Callable[[], Path], step: int, fsync: bool) -> None:
    end = end_marker_path(directory)
    try:
        atomic_write(end, str(step).encode("ascii"), staging=staging(), fsync=fsync)
    except OSError as exc:
        raise io_error("cannot write the end marker", end, exc) from exc


class RankFiles:
    """One rank's files under ``<directory>/batches``, read and acknowledged with blocking calls
    (`FileReceiver` runs each in a worker thread): the on-disk half of the receiver."""

    __slots__ = ("delete", "directory", "rank", "use_mmap")

    def __init__(self, directory: Path, rank: int, *, delete: bool, use_mmap: bool) -> None:
        self.directory = directory
        self.rank = rank
        self.delete = delete
        self.use_mmap = use_mmap

    @property
    def end_marker(self) -> Path:
        return end_marker_path(self.directory)

    @property
    def consumed_marker(self) -> Path:
        return consumed_marker_path(self.directory, self.rank)

    def path(self, step: int) -> Path:
        return batch_path(self.directory, step, self.rank)

    def end_of_stream(self, step: int, end: int) -> EndOfStreamError:
        return EndOfStreamError(
            f"rank {self.rank}: the stream ended before step {end} ({self.end_marker}); "
            f"no step {step}",
            end,
        )

    def resume_step(self) -> int:
        acked = read_step_marker(self.consumed_marker)
        if acked is not None:
            if self.delete:
                # A crash between recording the ack and deleting the file leaves the file.
                self.delete_file(acked)
            return acked + 1
        oldest = oldest_batch_step(self.directory, self.rank)
        if oldest is not None:
            return oldest
        end = read_step_marker(self.end_marker)
        if end is not None:
            return end
        raise TransportError(
            f"rank {self.rank}: start_step=None, but there is no consumer marker "
            f"{self.consumed_marker}, no batch file for this rank and no end marker under "
            f"{batches_dir(self.directory)}: nothing to resume from, pass start_step"
        )

    def read(self, step: int) -> Payload | None:
        """The payload of ``step``, or None while its file is not there yet."""
        path = self.path(step)
        data = self._try_read(path)
        if data is not None:
            return data
        end = read_step_marker(self.end_marker)
        if end is None:
            return None
        if step >= end:
            raise self.end_of_stream(step, end)
        # The marker is written after every earlier step's files: look once more.
        data = self._try_read(path)
        if data is None:
            raise TransportError(
                f"rank {self.rank}: no batch file {path}, but {self.end_marker} says every "
                f"step before {end} was sent: the file was removed by someone else"
            )
        return data

    def _try_read(self, path: Path) -> Payload | None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self.use_mmap and size >= _MMAP_MIN_SIZE:
                    return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise io_error(f"rank {self.rank}: cannot read", path, exc) from exc

    def ack(self, step: int) -> None:
        marker = self.consumed_marker
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(marker, str(step).encode("ascii"), fsync=False)
        except OSError as exc:
            raise io_error("cannot record the consumed step in", marker, exc) from exc
        # Recorded before the deletion, so a crash in between never makes a restart wait for
        # a deleted file (the leftover file is deleted when resuming).
        if self.delete:
            self.delete_file(step)

    def delete_file(self, step: int) -> None:
        path = self.path(step)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise io_error("cannot delete", path, exc) from exc
        try:
            path.parent.rmdir()
        except OSError:
            pass  # other ranks' files are still there (or another reader removed it)
