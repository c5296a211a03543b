"""The filesystem transport: ``<dir>/batches/step_<S>/rank_<R>.bin``, one file per step and rank.

A file's content is exactly the payload bytes (no header, no length prefix). Next to the step
directories, ``batches/`` holds:

- ``.staging/``: the sender writes each file here first, then renames it into its step
  directory, so a reader never sees a partial file and readers that remove emptied step
  directories cannot pull the directory out from under a write;
- ``END``: the end-of-stream marker (`FileSender.end_stream`), the ASCII decimal step
  before which the stream ended; a prime-rl file receiver never looks at it;
- ``.consumed/rank_<R>``: the last step rank ``R``'s receiver acknowledged (ASCII decimal),
  where a restarted receiver with ``start_step=None`` resumes.

All file I/O runs in worker threads (``trio.to_thread.run_sync``) behind a
`trio.CapacityLimiter`. The threads are never abandoned: a cancellation that arrives while a
thread runs does not interrupt it; the call returns its result as if not cancelled, and
`trio.Cancelled` arrives at the caller's next checkpoint. Only a cancellation that arrives
before the thread started (waiting for the limiter) makes the call raise, having done nothing.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import trio

from .._durable import fsync_dir, write_synced
from ..errors import InvalidArgumentError
from ._base import Payload, ReceivedPayload, Receiver, Sender
from ._errors import EndOfStreamError, TransportIOError
from ._file_layout import (
    RankFiles,
    io_error,
    read_step_marker,
    rename_into_step_dir,
    staging_dir,
    write_end_marker,
)

# The layout's paths are imported from here by the package and its tools: re-exported.
from ._file_layout import batch_path as batch_path
from ._file_layout import batches_dir as batches_dir
from ._file_layout import consumed_dir as consumed_dir
from ._file_layout import consumed_marker_path as consumed_marker_path
from ._file_layout import end_marker_path as end_marker_path
from ._file_layout import held_steps as held_steps
from ._wait import Wait, timeout_seconds

T = TypeVar("T")


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")


def _write_payload(payload: Payload, f: BinaryIO) -> None:
    f.write(payload)


class FileSender(Sender):
    """Writes each step's payloads as ``<directory>/batches/step_<S>/rank_<R>.bin``.

    Each file is written under ``batches/.staging/`` and then renamed into its step directory
    (created if needed; again if a reader removed it in between), so readers that delete
    consumed files and emptied step directories never make a send fail. Any other file
    error raises `TransportIOError` naming the path.

    Besides `send` (payloads already in memory), a step can be *streamed*: `stage` writes one
    rank's staged file through a callback (the publisher encodes straight into it with
    `trio_rl.wire.encode_into`, one rank at a time), and `commit` renames every staged file of
    the step into place, which is the delivery. So the sender never needs a whole step in
    memory.

    Args:
        directory: the shared output directory.
        world_size: the number of trainer ranks.
        fsync: flush each file (and its directory) to disk before the rename is final, so a
            crash never leaves a complete-looking but truncated file.
        limiter: the capacity limiter for the writer thread. Default: the pipeline's, which
            the publisher passes down (`use_limiter`); until then a private one of 1.
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
            raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
        self._directory = Path(directory)
        self._world_size = world_size
        self._fsync = fsync
        self._threads = _Threads(limiter)
        self._closed = False
        self._stale_end_removed = False
        self._last_step: int | None = None
        self._ended_at: int | None = None

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def limiter(self) -> trio.CapacityLimiter | None:
        return self._threads.given

    def use_limiter(self, limiter: trio.CapacityLimiter) -> None:
        super().use_limiter(limiter)
        self._threads.given = limiter

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this FileSender is closed")
        if self._ended_at is not None:
            raise RuntimeError(f"the stream was ended at step {self._ended_at} (end_stream)")

    async def send(self, step: int, payloads: Sequence[Payload]) -> None:
        """Write every rank's file for ``step`` (in one worker thread), each atomically.

        An existing file for the same step and rank is replaced. The first send removes an
        ``END`` marker left by an earlier run in the same directory. Raises `TransportIOError`
        naming the path if a file cannot be written or renamed into place.

        Cancellation: all or nothing. If `trio.Cancelled` is raised (before the writer thread
        started), no file of this step was written. Once the thread has started, every rank's
        file is written and the call returns normally; the cancellation arrives at the caller's
        next checkpoint. (A file error, unlike a cancellation, can leave the ranks before the
        failing one written.)
        """
        self._check_open()
        _check_non_negative("step", step)
        if len(payloads) != self._world_size:
            raise InvalidArgumentError(
                f"step {step}: got {len(payloads)} payloads for world_size {self._world_size}"
            )
        await self._threads.run(self._write_step, step, payloads)
        self._sent(step)

    def _sent(self, step: int) -> None:
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def _staging(self) -> Path:
        staging = staging_dir(self._directory)
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise io_error("cannot create the staging directory", staging, exc) from exc
        if not self._stale_end_removed:
            end = end_marker_path(self._directory)
            try:
                end.unlink(missing_ok=True)
            except OSError as exc:
                raise io_error("cannot remove the stale end marker", end, exc) from exc
            self._stale_end_removed = True
        return staging

    @property
    def can_stage(self) -> bool:
        """Whether a step may be delivered by `stage` + `commit` instead of `send`: true unless
        a subclass overrides `send` (a hook around delivery), which then stays the one path."""
        return type(self).send is FileSender.send

    def staged_path(self, step: int, rank: int) -> Path:
        """Where `stage` writes rank ``rank``'s file of ``step`` before `commit` renames it."""
        return staging_dir(self._directory) / f"step_{step}.rank_{rank}.{os.getpid()}.tmp"

    def stage(self, step: int, rank: int, write: Callable[[BinaryIO], object]) -> int:
        """Blocking (call it in a worker thread): write rank ``rank``'s file of ``step`` into
        the staging directory by calling ``write(file)``; return the file's size in bytes.

        Nothing is visible to receivers until `commit`. With ``fsync`` the file is on disk when
        this returns. On error (of ``write`` or of the file) the staged file is removed and the
        error propagates (a file error as `TransportIOError` naming the path).
        """
        self._check_open()
        _check_non_negative("step", step)
        if not 0 <= rank < self._world_size:
            raise InvalidArgumentError(f"rank must be in 0..{self._world_size - 1}, got {rank}")
        self._staging()
        tmp = self.staged_path(step, rank)
        try:
            return write_synced(tmp, write, fsync=self._fsync)
        except BaseException as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the error being raised says more
            if isinstance(exc, OSError):
                raise io_error(f"step {step} rank {rank}: cannot write", tmp, exc) from exc
            raise

    def open_staged(self, step: int, rank: int) -> Payload:
        """Blocking: rank ``rank``'s staged bytes of ``step`` (memory-mapped when not empty, so
        reading them back does not copy them onto the heap). `TransportIOError` if absent."""
        path = self.staged_path(step, rank)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except OSError as exc:
            raise io_error(
                f"step {step} rank {rank}: cannot read the staged file", path, exc
            ) from exc

    def unstage(self, step: int) -> None:
        """Blocking: remove every staged file of ``step`` (a streamed step that will not be
        committed). Missing files are fine."""
        for rank in range(self._world_size):
            path = self.staged_path(step, rank)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise io_error("cannot remove the staged file", path, exc) from exc

    async def commit(self, step: int) -> None:
        """Deliver a step written with `stage`: rename every rank's staged file into place.

        The delivery guarantee of `send` holds once this returns. Idempotent, so a failed or
        cancelled commit is retried by calling it again: a rank whose staged file is gone but
        whose batch file is in place (or which a receiver already acknowledged) was committed
        before. A rank with neither raises `TransportIOError` naming the staged path.

        Cancellation: as `send`, all or nothing.
        """
        self._check_open()
        _check_non_negative("step", step)
        await self._threads.run(self._commit_step, step)
        self._sent(step)

    def _commit_step(self, step: int) -> None:
        step_dir = batch_path(self._directory, step, 0).parent
        for rank in range(self._world_size):
            tmp, final = self.staged_path(step, rank), step_dir / f"rank_{rank}.bin"
            if not tmp.exists():
                consumed = read_step_marker(consumed_marker_path(self._directory, rank))
                if final.exists() or (consumed is not None and consumed >= step):
                    continue  # committed by an earlier call
                raise TransportIOError(
                    f"step {step} rank {rank}: nothing to commit: no staged file {tmp} "
                    f"and no batch file {final}",
                    str(tmp),
                )
            rename_into_step_dir(tmp, final)
        if self._fsync:
            fsync_dir(step_dir, missing_ok=True)

    def _write_step(self, step: int, payloads: Sequence[Payload]) -> None:
        try:
            for rank, payload in enumerate(payloads):
                self.stage(step, rank, functools.partial(_write_payload, payload))
            self._commit_step(step)
        except BaseException:
            try:
                self.unstage(step)
            except TransportIOError:
                pass  # the error being raised says more
            raise

    async def end_stream(self, step: int) -> None:
        """Write the end marker ``batches/END`` holding ``step``: no step ``>= step`` will come.

        Receivers waiting for ``step`` or later raise `EndOfStreamError`. ``step`` must be greater
        than every step sent. Written like a batch file (staged, fsynced, renamed), after every
        earlier step's files. Later sends raise `RuntimeError`.

        Cancellation: if `trio.Cancelled` is raised (before the writer thread started), no
        marker was written; once the thread has started, the marker is written and the call
        returns normally, the cancellation arriving at the caller's next checkpoint.
        """
        self._check_open()
        _check_non_negative("step", step)
        if self._last_step is not None and step <= self._last_step:
            raise InvalidArgumentError(
                f"end_stream({step}): step {self._last_step} was already sent"
            )
        await self._threads.run(write_end_marker, self._directory, self._staging, step, self._fsync)
        self._ended_at = step

    async def aclose(self) -> None:
        """Nothing to release but the name; later sends raise `trio.ClosedResourceError`.

        Cancellation: the sender is closed even if `trio.Cancelled` is raised.
        """
        self._closed = True
        await trio.lowlevel.checkpoint()


class _Threads:
    """A transport's worker threads: the limiter it was given (or adopted from the pipeline
    with ``use_limiter``), else a private limiter of 1."""

    __slots__ = ("_private", "given")

    def __init__(self, given: trio.CapacityLimiter | None) -> None:
        self.given = given
        self._private: trio.CapacityLimiter | None = None

    @property
    def limiter(self) -> trio.CapacityLimiter:
        if self.given is not None:
            return self.given
        if self._private is None:
            self._private = trio.CapacityLimiter(1)
        return self._private

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)


class FileReceiver(Receiver):
    """Reads rank ``rank``'s payloads, step after step, from ``<directory>/batches``.

    Waiting for a step's file polls with exponential backoff, from ``poll_interval`` up to
    ``max_poll_interval`` seconds, and logs what it waits for (``trio_rl.transport``, WARNING;
    INFO without a ``timeout``) every 10 s, with the time left.

    A returned payload stays on disk until it is acknowledged: by `ack`, or implicitly by the
    next `receive` (`BatchReceiver` acks each payload once decoded, right before handing it
    out). Acknowledging records the step in ``batches/.consumed/rank_<R>`` and, with
    ``delete=True``, deletes the file (and its step directory once empty). So a receiver that
    is cancelled or closed between reading and handing out a payload leaves it on disk for
    the next receiver.

    Args:
        directory: the shared output directory.
        rank: this trainer's data-parallel rank.
        start_step: the first step to read. ``None`` resumes where an earlier receiver of this
            rank stopped: the step after the last acknowledged one (from
            ``batches/.consumed/rank_<R>``); if nothing was ever acknowledged, the lowest
            step whose file for this rank is there; else the step of the ``END`` marker;
            else `TransportError` (nothing to resume from: pass a step). It is resolved when
            entering ``async with`` (or by the first `receive`).
        timeout: seconds to wait for one step's file before raising `TransportTimeoutError`
            (``None``: wait until cancelled).
        delete: delete each file once acknowledged (and its step directory once empty).
        use_mmap: map files of at least 1 MiB into memory instead of reading them: no copy,
            and releasing the payload is an unmap that does not hold the GIL (freeing a 64 MiB
            ``bytes`` does, for tens of ms). Only safe if nobody truncates or rewrites a batch
            file *in place* while it is mapped (the sender never does: it renames a new file
            into place); the process would get SIGBUS.
        limiter: the capacity limiter for reader threads. Default: the one `use_limiter`
            passes down (`BatchReceiver` passes its decoding limiter); until then a private
            one of 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        *,
        start_step: int | None = 0,
        timeout: float | None = None,
        poll_interval: float = 0.005,
        max_poll_interval: float = 0.5,
        delete: bool = False,
        use_mmap: bool = False,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        _check_non_negative("rank", rank)
        if start_step is not None:
            _check_non_negative("start_step", start_step)
        if not 0 < poll_interval <= max_poll_interval:
            raise InvalidArgumentError(
                f"poll_interval must be > 0 and <= max_poll_interval ({max_poll_interval}), "
                f"got {poll_interval}"
            )
        self._files = RankFiles(Path(directory), rank, delete=delete, use_mmap=use_mmap)
        self._next_step = start_step
        self._timeout = timeout_seconds(timeout)
        self._poll_interval = poll_interval
        self._max_poll_interval = max_poll_interval
        self._threads = _Threads(limiter)
        self._closed = False
        self._unacked: int | None = None
        self._ended_at: int | None = None

    @property
    def rank(self) -> int:
        return self._files.rank

    @property
    def limiter(self) -> trio.CapacityLimiter | None:
        return self._threads.given

    def use_limiter(self, limiter: trio.CapacityLimiter) -> None:
        super().use_limiter(limiter)
        self._threads.given = limiter

    @property
    def next_step(self) -> int:
        """The step the next `receive` returns.

        Raises `RuntimeError` while ``start_step=None`` is unresolved (enter the receiver).
        """
        if self._next_step is None:
            raise RuntimeError(
                "start_step=None is resolved when entering `async with` or by the first receive"
            )
        return self._next_step

    @property
    def end_marker(self) -> Path:
        return self._files.end_marker

    @property
    def consumed_marker(self) -> Path:
        return self._files.consumed_marker

    def path(self, step: int) -> Path:
        """The file this receiver reads for ``step``."""
        return self._files.path(step)

    async def __aenter__(self) -> FileReceiver:
        """Resolve the start step (``start_step=None``: from the files on disk, in a worker
        thread).

        Cancellation: cancelled while waiting for the worker thread's limiter, it raises
        `trio.Cancelled` with nothing resolved (the first `receive` resolves the step); once
        the thread runs it completes, the call returns normally and the cancellation arrives at
        the caller's next checkpoint. With the step already known it is a plain checkpoint.
        """
        await self._resolve()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the receiver (`aclose`); a payload not yet acknowledged stays on disk.

        Cancellation: the receiver is closed even if `trio.Cancelled` is raised.
        """
        await self.aclose()

    async def _resolve(self) -> int:
        if self._next_step is None:
            self._next_step = await self._threads.run(self._files.resume_step)
        else:
            await trio.lowlevel.checkpoint()
        return self._next_step

    async def receive(self) -> ReceivedPayload:
        """Wait for the next step's file and return its bytes (the file stays until acked).

        First acknowledges the step it returned last, if not yet acknowledged (shielded).
        Raises `TransportTimeoutError` (naming the file) if it does not appear within
        ``timeout`` seconds, `EndOfStreamError` if the ``END`` marker says the stream ended at or
        before this step, `TransportError` if the marker says the step was sent but its file
        is gone, and `TransportIOError` if the file cannot be read.

        Cancellation: safe at any point. A read in progress completes in its thread and this
        call returns its payload normally (the cancellation arrives at the caller's next
        checkpoint); a receive that raises `trio.Cancelled` has not advanced `next_step` and
        leaves the file on disk for the next receive.
        """
        if self._closed:
            raise trio.ClosedResourceError("this FileReceiver is closed")
        if self._unacked is not None:
            with trio.CancelScope(shield=True):
                await self.ack(self._unacked)
        step = await self._resolve()
        path = self.path(step)
        if self._ended_at is not None and step >= self._ended_at:
            raise self._files.end_of_stream(step, self._ended_at)
        wait = Wait(self._timeout, f"rank {self.rank}: no batch file {path} for step {step}")
        interval = self._poll_interval
        while True:
            try:
                data = await self._threads.run(self._files.read, step)
            except EndOfStreamError as exc:
                self._ended_at = exc.step
                raise
            if data is not None:
                break
            await trio.sleep(min(interval, wait.remaining()))
            interval = min(interval * 2, self._max_poll_interval)
        self._next_step = step + 1
        self._unacked = step
        return ReceivedPayload(step=step, rank=self.rank, data=data, source=str(path))

    async def ack(self, step: int) -> None:
        """Record ``step`` as consumed (``batches/.consumed/rank_<R>``); with ``delete=True``,
        delete its file and then its step directory if empty.

        Only the step last returned by `receive` can be acknowledged (again: a no-op); raises
        `ValueError` for a step not returned yet and `TransportIOError` if a file operation
        fails.

        Cancellation: if `trio.Cancelled` is raised (before the thread started), the step is
        not acknowledged (the next `receive` acknowledges it); once the thread has started, the
        acknowledgement completes and the call returns normally, the cancellation arriving at
        the caller's next checkpoint.
        """
        if self._unacked is None or step != self._unacked:
            if self._next_step is not None and step < self._next_step:
                await trio.lowlevel.checkpoint()
                return
            raise InvalidArgumentError(
                f"rank {self.rank}: cannot ack step {step}: not received yet"
            )
        await self._threads.run(self._files.ack, step)
        self._unacked = None

    async def aclose(self) -> None:
        """Later receives raise `trio.ClosedResourceError`. A payload returned but not yet
        acknowledged is not acknowledged: its file stays for the next receiver.

        Cancellation: the receiver is closed even if `trio.Cancelled` is raised.
        """
        self._closed = True
        await trio.lowlevel.checkpoint()
