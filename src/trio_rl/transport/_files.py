"""The filesystem transport: ``<dir>/batches/step_<S>/rank_<R>.bin``, one file per step and rank.

A file's content is exactly the payload bytes (no header, no length prefix). The sender writes
each file under a temporary name and renames it into place, so a reader never sees a partial
file. All file I/O runs in worker threads (``trio.to_thread.run_sync``) behind a
`trio.CapacityLimiter`.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import trio

from ._base import BatchSender, Payload, ReceivedPayload, ReceiverTransport
from ._errors import TransportTimeoutError

__all__ = ["FileBatchReceiver", "FileBatchSender", "batch_path"]


def batch_path(directory: str | os.PathLike[str], step: int, rank: int) -> Path:
    """The path of rank ``rank``'s payload for ``step`` under ``directory``."""
    return Path(directory) / "batches" / f"step_{step}" / f"rank_{rank}.bin"


_MMAP_MIN_SIZE = 1 << 20


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class FileBatchSender(BatchSender):
    """Writes each step's payloads as ``<directory>/batches/step_<S>/rank_<R>.bin``.

    Args:
        directory: the shared output directory.
        world_size: the number of trainer ranks.
        fsync: flush each file (and its directory) to disk before the rename is final, so a
            crash never leaves a complete-looking but truncated file.
        limiter: the capacity limiter for the writer thread (default: a private one of 1).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        world_size: int,
        *,
        fsync: bool = True,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._directory = Path(directory)
        self._world_size = world_size
        self._fsync = fsync
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self._closed = False

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def directory(self) -> Path:
        return self._directory

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        """Write every rank's file for ``step`` (in one worker thread), each atomically.

        An existing file for the same step and rank is replaced.

        Cancellation: the thread is not abandoned; the files being written are finished (each
        is then either complete or absent) before `trio.Cancelled` propagates.
        """
        if self._closed:
            raise trio.ClosedResourceError("this FileBatchSender is closed")
        _check_non_negative("step", step)
        if len(payloads) != self._world_size:
            raise ValueError(
                f"step {step}: got {len(payloads)} payloads for world_size {self._world_size}"
            )
        await trio.to_thread.run_sync(self._write_step, step, payloads, limiter=self._limiter)

    def _write_step(self, step: int, payloads: Sequence[Payload]) -> None:
        step_dir = batch_path(self._directory, step, 0).parent
        step_dir.mkdir(parents=True, exist_ok=True)
        for rank, payload in enumerate(payloads):
            final = step_dir / f"rank_{rank}.bin"
            tmp = step_dir / f"rank_{rank}.bin.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(payload)
                    if self._fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        if self._fsync:
            fd = os.open(step_dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def aclose(self) -> None:
        """Nothing to release but the name; later sends raise `trio.ClosedResourceError`."""
        self._closed = True
        await trio.lowlevel.checkpoint()


class FileBatchReceiver(ReceiverTransport):
    """Reads rank ``rank``'s payloads, step after step, from ``<directory>/batches``.

    Waiting for a step's file polls with exponential backoff, from ``poll_interval`` up to
    ``max_poll_interval`` seconds.

    Args:
        directory: the shared output directory.
        rank: this trainer's data-parallel rank.
        start_step: the first step to read.
        timeout: seconds to wait for one step's file before raising `TransportTimeoutError`
            (``None``: wait until cancelled).
        delete: delete each file after reading it (and its step directory once empty).
        use_mmap: map files of at least 1 MiB into memory instead of reading them: no copy,
            and releasing the payload is an unmap that does not hold the GIL (freeing a 64 MiB
            ``bytes`` does, for tens of ms). Only safe if nobody truncates or rewrites a batch
            file *in place* while it is mapped (the sender never does: it renames a new file
            into place); the process would get SIGBUS.
        limiter: the capacity limiter for reader threads (default: a private one of 1).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        start_step: int = 0,
        timeout: float | None = None,
        poll_interval: float = 0.005,
        max_poll_interval: float = 0.5,
        delete: bool = False,
        use_mmap: bool = False,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        _check_non_negative("rank", rank)
        _check_non_negative("start_step", start_step)
        if not 0 < poll_interval <= max_poll_interval:
            raise ValueError("need 0 < poll_interval <= max_poll_interval")
        self._directory = Path(directory)
        self._rank = rank
        self._next_step = start_step
        self._timeout = math.inf if timeout is None else timeout
        self._poll_interval = poll_interval
        self._max_poll_interval = max_poll_interval
        self._delete = delete
        self._use_mmap = use_mmap
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def next_step(self) -> int:
        return self._next_step

    def path(self, step: int) -> Path:
        """The file this receiver reads for ``step``."""
        return batch_path(self._directory, step, self._rank)

    async def receive(self) -> ReceivedPayload:
        """Wait for the next step's file and return its bytes.

        Raises `TransportTimeoutError` (naming the file) if it does not appear within
        ``timeout`` seconds.

        Cancellation: safe at any point. A read in progress completes in its thread, and its
        result is still returned (trio does not abandon the thread), so a file deleted after
        reading is never lost.
        """
        if self._closed:
            raise trio.ClosedResourceError("this FileBatchReceiver is closed")
        step = self._next_step
        path = self.path(step)
        deadline = trio.current_time() + self._timeout
        interval = self._poll_interval
        while True:
            data = await trio.to_thread.run_sync(self._read, path, limiter=self._limiter)
            if data is not None:
                break
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise TransportTimeoutError(
                    f"rank {self._rank}: no batch file {path} for step {step} "
                    f"after waiting {self._timeout:g} s"
                )
            await trio.sleep(min(interval, remaining))
            interval = min(interval * 2, self._max_poll_interval)
        self._next_step = step + 1
        return ReceivedPayload(step=step, rank=self._rank, data=data, source=str(path))

    def _read(self, path: Path) -> Payload | None:
        data: Payload
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self._use_mmap and size >= _MMAP_MIN_SIZE:
                    data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                else:
                    data = f.read()
        except FileNotFoundError:
            return None
        if self._delete:
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass  # other ranks' files are still there
        return data

    async def aclose(self) -> None:
        """Later receives raise `trio.ClosedResourceError`."""
        self._closed = True
        await trio.lowlevel.checkpoint()
