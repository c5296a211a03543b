"""By-handle payloads: per-token side arrays in files under ``<root>/v<k>/``.

A request (one model call) writes its side arrays into one file in the directory of the policy
version that generated it and hands back :class:`PayloadSegment` s whose ``file`` is an
absolute path. Segments move with the samples; the trainer reads a batch's segments (opening
``segment.file`` as given, as prime-rl's ``read_field`` does) and deletes the files; an orphan
sweep deletes whole ``v<k>`` directories no live holder can still read.

The sync functions here do blocking file I/O: from async code call the ``a``-prefixed wrappers,
which run them in a worker thread under a shared :class:`trio.CapacityLimiter`.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Literal

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .._durable import atomic_write
from ..errors import PayloadError, PayloadFileMissingError
from ._segment import PayloadSegment, clip_segments, row_bytes

__all__ = [
    "FIELDS",
    "FIELD_FILLS",
    "FieldSpec",
    "PayloadStore",
    "delete_files",
    "field_window",
    "read_field",
]

Window = Literal["inputs", "labels", "sequence"]


@attrs.frozen
class FieldSpec:
    """How a payload field is read.

    ``fill`` fills rows no segment covers. A ``ragged`` field has a variable number of values
    per position (CSR, see :class:`PayloadSegment`), stored as int32 when ``fill`` is an int and
    float32 otherwise, and read as ``[rows, width]`` with ``width`` the widest row of all the
    field's segments, so every rank reading a window gets the same width. ``window`` says which
    positions a rank reading token chunk ``[lo, hi)`` needs (:func:`field_window`).
    """

    fill: float
    ragged: bool = False
    window: Window = "inputs"

    @property
    def value_dtype(self) -> np.dtype[np.generic]:
        """The dtype of a ragged field's values."""
        return np.dtype("<i4") if isinstance(self.fill, int) else np.dtype("<f4")


#: The known fields. Unknown fields are dense, fill with 0 and use the "inputs" window.
FIELDS: Mapping[str, FieldSpec] = {
    "routed_experts": FieldSpec(0),
    "routed_expert_weights": FieldSpec(0.0),
    "sampling_mask": FieldSpec(-1, ragged=True, window="labels"),
    "sampling_mask_logprobs": FieldSpec(-math.inf, ragged=True, window="sequence"),
}

#: Fill value of each known field for rows no segment covers. Unknown fields fill with 0.
FIELD_FILLS: Mapping[str, float] = {name: spec.fill for name, spec in FIELDS.items()}

_DEFAULT_SPEC = FieldSpec(0)
_OFFSET_DTYPE = np.dtype("<u4")
_VERSION_DIR = re.compile(r"^v(\d+)$")
_READ_ATTEMPTS = 5


def _spec(field: str) -> FieldSpec:
    return FIELDS.get(field, _DEFAULT_SPEC)


def field_window(field: str, lo: int, hi: int, length: int) -> tuple[int, int]:
    """The positions a rank that trains on token chunk ``[lo, hi)`` of a ``length``-token
    sequence reads of ``field``: "inputs" the chunk itself, "labels" the chunk shifted one
    ahead (clipped to the sequence), "sequence" the whole sequence."""
    window = _spec(field).window
    if window == "sequence":
        return 0, length
    if window == "labels":
        return min(lo + 1, length), min(hi + 1, length)
    return lo, hi


def _resolve(file: str, root: str | os.PathLike[str] | None) -> str:
    # Absolute paths (what PayloadStore writes) are opened as given; relative ones, from old
    # checkpoints, against ``root`` when the caller knows it, else against the working directory.
    if root is None or os.path.isabs(file):
        return file
    return os.path.join(root, file)


def _pread(path: str, offset: int, size: int) -> bytes:
    got = 0
    for attempt in range(_READ_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise PayloadFileMissingError(path) from None
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        got = len(data)
        if got == size:
            return data
        if attempt + 1 < _READ_ATTEMPTS:
            time.sleep(0.05 * 2**attempt)
    raise PayloadError(
        f"payload file {path!r} returned {got} of {size} bytes at offset {offset} "
        f"after {_READ_ATTEMPTS} attempts"
    )


def _check_uniform(
    field: str, mine: Sequence[PayloadSegment]
) -> tuple[np.dtype[np.generic], list[int]]:
    dtype, shape = np.dtype(mine[0].dtype), list(mine[0].shape)
    for s in mine:
        if np.dtype(s.dtype) != dtype or list(s.shape) != shape:
            raise PayloadError(
                f"payload field {field!r}: segment in {s.file!r} at byte {s.offset} has dtype "
                f"{s.dtype} shape {s.shape}, expected {dtype.str} {shape}"
            )
    return dtype, shape


def _read_dense(
    mine: Sequence[PayloadSegment], field: str, lo: int, hi: int, fill: float, root: str | None
) -> npt.NDArray[np.generic]:
    dtype, shape = _check_uniform(field, mine)
    out = np.full((hi - lo, *shape), fill, dtype=dtype)
    for seg in clip_segments(mine, lo, hi):
        raw = _pread(_resolve(seg.file, root), seg.offset, seg.rows * row_bytes(seg))
        out[seg.pos - lo : seg.pos - lo + seg.rows] = np.frombuffer(raw, dtype=dtype).reshape(
            seg.rows, *shape
        )
    return out


def _read_ragged(
    mine: Sequence[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    spec: FieldSpec,
    fill: float,
    root: str | None,
) -> npt.NDArray[np.generic]:
    values = spec.value_dtype
    item = values.itemsize
    # Every segment's offsets (small), so the width is the same for every window.
    indexes: list[tuple[PayloadSegment, str, npt.NDArray[np.uint32]]] = []
    width = 0
    for seg in mine:
        path = _resolve(seg.file, root)
        if np.dtype(seg.dtype) != _OFFSET_DTYPE or list(seg.shape):
            raise PayloadError(
                f"ragged payload field {field!r}: segment in {path!r} at byte {seg.offset} has "
                f"dtype {seg.dtype} shape {seg.shape}, expected {_OFFSET_DTYPE.str} []"
            )
        offs = np.frombuffer(_pread(path, seg.offset, 4 * (seg.rows + 1)), dtype=_OFFSET_DTYPE)
        sizes = offs[1:].astype(np.int64) - offs[:-1].astype(np.int64)
        broken = (sizes < 0) | (np.remainder(sizes, item) != 0)
        if broken.any():
            bad = int(np.flatnonzero(broken)[0])
            raise PayloadError(
                f"ragged payload field {field!r}: row {bad} of the index at byte "
                f"{seg.offset + 4 * bad} of {path!r} spans {int(sizes[bad])} bytes, not a "
                f"whole number of {values.str} values"
            )
        if seg.rows:
            width = max(width, int(sizes.max()) // item)
        indexes.append((seg, path, offs))
    out = np.full((hi - lo, width), fill, dtype=values)
    for seg, path, offs in indexes:
        start, end = max(seg.pos, lo), min(seg.pos + seg.rows, hi)
        if end <= start:
            continue
        a, b = start - seg.pos, end - seg.pos
        first = int(offs[a])
        raw = np.frombuffer(_pread(path, first, int(offs[b]) - first), dtype=values)
        for i in range(a, b):
            row = raw[(int(offs[i]) - first) // item : (int(offs[i + 1]) - first) // item]
            target = out[seg.pos + i - lo]
            target[:] = fill
            target[: len(row)] = row
    return out


def read_field(
    segments: Sequence[PayloadSegment] | None,
    field: str,
    lo: int,
    hi: int,
    *,
    fill: float | None = None,
    root: str | os.PathLike[str] | None = None,
) -> npt.NDArray[np.generic] | None:
    """Rows ``[lo, hi)`` of ``field`` as a ``[hi - lo, *shape]`` array (ragged: ``[hi - lo,
    width]``), reading only the bytes of that window.

    Files are opened as given (``os.open(segment.file)``); a relative ``file`` (written before
    paths were absolute) is resolved against ``root`` if given. Rows no segment covers hold the
    field's fill value (:data:`FIELDS`, or ``fill``); later segments win where segments overlap.
    Returns None when no segment carries the field. A missing file raises
    :class:`~trio_rl.errors.PayloadFileMissingError` naming it; reads that stay short after
    retries, and segments that disagree on dtype or shape, raise
    :class:`~trio_rl.errors.PayloadError`.
    """
    mine = [s for s in segments or () if s.field == field]
    if not mine:
        return None
    spec = _spec(field)
    fill_value = fill if fill is not None else spec.fill
    base = None if root is None else os.fspath(root)
    if spec.ragged:
        return _read_ragged(mine, field, lo, hi, spec, fill_value, base)
    return _read_dense(mine, field, lo, hi, fill_value, base)


def delete_files(files: Iterable[str], root: str | os.PathLike[str] | None = None) -> int:
    """Delete payload files (opened as given; relative ones against ``root``); files already
    gone are not an error. Returns how many went."""
    n = 0
    base = None if root is None else os.fspath(root)
    for file in files:
        try:
            os.unlink(_resolve(file, base))
            n += 1
        except FileNotFoundError:
            pass
    return n


class PayloadStore:
    """Payload files under ``root``: ``root/v<k>/<request>.bin``.

    Segment ``file`` fields hold absolute paths (``root`` is made absolute here), so a trainer
    opens them as given from any working directory. Segments from older checkpoints may hold
    paths relative to ``root``; the store's readers resolve those against ``root``. All methods
    are synchronous and do blocking I/O; the ``a*`` methods run them in a worker thread with
    ``limiter``. The thread is never abandoned: cancelled while waiting for the limiter, an
    ``a*`` call raises ``Cancelled`` having done nothing; cancelled once its thread runs, it
    returns the thread's result and ``Cancelled`` arrives at the caller's next checkpoint.
    """

    def __init__(self, root: str | os.PathLike[str], limiter: trio.CapacityLimiter | None = None):
        self.root = Path(root).absolute()
        self.limiter = limiter

    def path(self, file: str) -> Path:
        return self.root / file  # an absolute ``file`` replaces the root

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    # -- writing --------------------------------------------------------------------------------

    def write_request(
        self,
        version: int,
        fields: Mapping[str, npt.ArrayLike],
        *,
        ragged: Mapping[str, Sequence[npt.ArrayLike]] | None = None,
        pos: int = 0,
        positions: Mapping[str, int] | None = None,
        request_id: str | None = None,
    ) -> list[PayloadSegment]:
        """Write one request's side arrays into one ``v<version>`` file.

        ``fields`` are dense ``[rows, *shape]`` arrays; ``ragged`` fields are one 1-D array per
        position (any lengths), stored as values then a CSR index of absolute file offsets (see
        :class:`PayloadSegment`). Returns one segment per field, first row at position
        ``positions[field]`` (default ``pos``). The file is written to a temporary name and
        renamed, so a reader never sees a partial file.
        """
        name = f"{request_id or uuid.uuid4().hex}.bin"
        target = self.version_dir(version) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        file = str(target)
        where = positions or {}
        segments: list[PayloadSegment] = []
        offset = 0

        def write(f: BinaryIO) -> None:
            nonlocal offset
            for field, value in fields.items():
                arr = np.ascontiguousarray(np.asarray(value))
                if arr.ndim < 1:
                    raise PayloadError(f"payload field {field!r} must have at least one dimension")
                data = arr.tobytes()
                f.write(data)
                segments.append(
                    PayloadSegment(
                        field=field,
                        file=file,
                        offset=offset,
                        pos=where.get(field, pos),
                        rows=int(arr.shape[0]),
                        dtype=arr.dtype.str,
                        shape=[int(d) for d in arr.shape[1:]],
                    )
                )
                offset += len(data)
            for field, rows in (ragged or {}).items():
                values = _spec(field).value_dtype
                starts = []
                for i, row in enumerate(rows):
                    arr = np.asarray(row)
                    if arr.ndim != 1:
                        raise PayloadError(
                            f"ragged payload field {field!r}: row {i} has {arr.ndim} dimensions, "
                            "expected 1"
                        )
                    data = np.ascontiguousarray(arr, dtype=values).tobytes()
                    starts.append(offset)
                    f.write(data)
                    offset += len(data)
                starts.append(offset)
                if offset > np.iinfo(_OFFSET_DTYPE).max:
                    raise PayloadError(
                        f"ragged payload field {field!r}: file offset {offset} does not fit the "
                        "uint32 index"
                    )
                index = np.asarray(starts, dtype=_OFFSET_DTYPE).tobytes()
                f.write(index)
                segments.append(
                    PayloadSegment(
                        field=field,
                        file=file,
                        offset=offset,
                        pos=where.get(field, pos),
                        rows=len(starts) - 1,
                        dtype=_OFFSET_DTYPE.str,
                        shape=[],
                    )
                )
                offset += len(index)

        atomic_write(target, write, fsync=False)
        return segments

    # -- reading --------------------------------------------------------------------------------

    def read_field(
        self,
        segments: Sequence[PayloadSegment] | None,
        field: str,
        lo: int,
        hi: int,
        *,
        fill: float | None = None,
    ) -> npt.NDArray[np.generic] | None:
        """:func:`read_field`, with relative (old) segment paths resolved against the root."""
        return read_field(segments, field, lo, hi, fill=fill, root=self.root)

    # -- deleting -------------------------------------------------------------------------------

    def delete_files(self, files: Iterable[str]) -> int:
        """Delete files a batch read; files already gone are not an error. Returns how many went."""
        return delete_files(files, self.root)

    def versions_on_disk(self) -> list[int]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            m = _VERSION_DIR.match(entry.name)
            if m and entry.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def sweep_orphans(
        self,
        live_versions: Iterable[int],
        current_version: int,
        *,
        stop: threading.Event | None = None,
    ) -> list[int]:
        """Delete every ``v<k>`` directory with ``k`` below the oldest live version.

        ``live_versions`` must name the version of every holder that may still read a file (the
        sink's live payload versions, plus in-flight work the sink does not know of);
        ``current_version`` is always live, since new requests write there. Returns the deleted
        versions. ``stop`` set, it stops before the next directory (one is never left
        half-deleted); the next sweep deletes what it left.
        """
        floor = min([current_version, *live_versions])
        deleted = []
        for k in self.versions_on_disk():
            if stop is not None and stop.is_set():
                break
            if k < floor:
                shutil.rmtree(self.version_dir(k), ignore_errors=True)
                deleted.append(k)
        return deleted

    # -- async wrappers (worker threads) --------------------------------------------------------

    async def aread_field(
        self,
        segments: Sequence[PayloadSegment] | None,
        field: str,
        lo: int,
        hi: int,
        *,
        fill: float | None = None,
    ) -> npt.NDArray[np.generic] | None:
        """:meth:`read_field` in a worker thread. On cancellation the read finishes first."""
        return await trio.to_thread.run_sync(
            lambda: self.read_field(segments, field, lo, hi, fill=fill), limiter=self.limiter
        )

    async def adelete_files(self, files: Iterable[str]) -> int:
        """:meth:`delete_files` in a worker thread. On cancellation the deletes finish first."""
        todo = list(files)
        return await trio.to_thread.run_sync(self.delete_files, todo, limiter=self.limiter)

    async def asweep_orphans(self, live_versions: Iterable[int], current_version: int) -> list[int]:
        """:meth:`sweep_orphans` in a worker thread; ``live_versions`` is read on the loop first.

        Cancellation arrives at once, however many directories there are: the thread is told
        to stop and abandoned; it finishes the directory it is deleting (never left
        half-deleted) and deletes no other. The next sweep deletes what it left.
        """
        live = list(live_versions)
        stop = threading.Event()
        try:
            return await trio.to_thread.run_sync(
                functools.partial(self.sweep_orphans, live, current_version, stop=stop),
                limiter=self.limiter,
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            stop.set()
            raise
