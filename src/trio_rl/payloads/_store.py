"""By-handle payloads: per-token side arrays in files under ``<root>/v<k>/``.

A request (one model call) writes its side arrays into one file in the directory of the policy
version that generated it and hands back :class:`~trio_rl.wire.PayloadSegment` s. Segments move
with the samples; the trainer reads a batch's segments and deletes the files; an orphan sweep
deletes whole ``v<k>`` directories no live holder can still read.

The sync functions here do blocking file I/O: from async code call the ``a``-prefixed wrappers,
which run them in a worker thread under a shared :class:`trio.CapacityLimiter`.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import trio

from ..wire import PayloadSegment
from ._errors import PayloadError, PayloadFileMissing

__all__ = [
    "FIELD_FILLS",
    "PayloadStore",
    "clip_segments",
    "segment_files",
    "shift_segments",
]

#: Fill value of each known field for rows no segment covers. Unknown fields fill with 0.
FIELD_FILLS: Mapping[str, float] = {
    "routed_experts": 0,
    "routed_expert_weights": 0.0,
    "sampling_mask": -1,
    "sampling_mask_logprobs": -math.inf,
}

_VERSION_DIR = re.compile(r"^v(\d+)$")
_READ_ATTEMPTS = 5


def _row_bytes(seg: PayloadSegment) -> int:
    return int(np.dtype(seg.dtype).itemsize) * math.prod(seg.shape)


def clip_segments(segments: Sequence[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """Keep the part of each segment inside positions ``[lo, hi)``; drop empty overlaps.

    Positions stay in the same frame (shift afterwards to re-base them).
    """
    out: list[PayloadSegment] = []
    for seg in segments:
        start, end = max(seg.pos, lo), min(seg.pos + seg.rows, hi)
        if end <= start:
            continue
        out.append(
            PayloadSegment(
                field=seg.field,
                file=seg.file,
                offset=seg.offset + (start - seg.pos) * _row_bytes(seg),
                pos=start,
                rows=end - start,
                dtype=seg.dtype,
                shape=list(seg.shape),
            )
        )
    return out


def shift_segments(segments: Sequence[PayloadSegment], delta: int) -> list[PayloadSegment]:
    """The same segments with ``delta`` added to every position (packing into a micro-batch)."""
    return [
        PayloadSegment(s.field, s.file, s.offset, s.pos + delta, s.rows, s.dtype, list(s.shape))
        for s in segments
    ]


def segment_files(segments: Iterable[PayloadSegment] | None) -> set[str]:
    """The distinct files a list of segments refers to."""
    return {s.file for s in segments} if segments else set()


class PayloadStore:
    """Payload files under ``root``: ``root/v<k>/<request>.bin``.

    Segment ``file`` fields hold paths relative to ``root`` (``"v3/ab12.bin"``), so a checkpoint
    stays valid if the root moves. All methods are synchronous and do blocking I/O; the ``a*``
    methods run them in a worker thread with ``limiter`` (cancellation waits for the thread).
    """

    def __init__(self, root: str | os.PathLike[str], limiter: trio.CapacityLimiter | None = None):
        self.root = Path(root)
        self.limiter = limiter

    def path(self, file: str) -> Path:
        return self.root / file

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    # -- writing --------------------------------------------------------------------------------

    def write_request(
        self,
        version: int,
        fields: Mapping[str, npt.ArrayLike],
        *,
        pos: int = 0,
        request_id: str | None = None,
    ) -> list[PayloadSegment]:
        """Write one request's side arrays (each ``[rows, *shape]``) into one ``v<version>`` file.

        Returns one segment per field, first row at position ``pos``. The file is written to a
        temporary name and renamed, so a reader never sees a partial file.
        """
        name = f"{request_id or uuid.uuid4().hex}.bin"
        rel = f"v{version}/{name}"
        target = self.path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        segments: list[PayloadSegment] = []
        offset = 0
        tmp = target.with_name(f".{name}.tmp")
        with open(tmp, "wb") as f:
            for field, value in fields.items():
                arr = np.ascontiguousarray(np.asarray(value))
                if arr.ndim < 1:
                    raise PayloadError(f"payload field {field!r} must have at least one dimension")
                data = arr.tobytes()
                f.write(data)
                segments.append(
                    PayloadSegment(
                        field=field,
                        file=rel,
                        offset=offset,
                        pos=pos,
                        rows=int(arr.shape[0]),
                        dtype=arr.dtype.str,
                        shape=[int(d) for d in arr.shape[1:]],
                    )
                )
                offset += len(data)
        os.replace(tmp, target)
        return segments

    # -- reading --------------------------------------------------------------------------------

    def _pread(self, file: str, offset: int, size: int) -> bytes:
        path = str(self.path(file))
        got = 0
        for attempt in range(_READ_ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise PayloadFileMissing(path) from None
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

    def read_field(
        self,
        segments: Sequence[PayloadSegment] | None,
        field: str,
        lo: int,
        hi: int,
        *,
        fill: float | None = None,
    ) -> npt.NDArray[np.generic] | None:
        """Rows ``[lo, hi)`` of ``field`` as a ``[hi - lo, *shape]`` array.

        Rows no segment covers hold the field's fill value (:data:`FIELD_FILLS`, or ``fill``);
        later segments win where segments overlap. Returns None when no segment carries the
        field. A missing file raises :class:`PayloadFileMissing` naming it; reads that stay short
        after retries raise :class:`PayloadError`.
        """
        mine = [s for s in segments or () if s.field == field]
        if not mine:
            return None
        dtype, shape = np.dtype(mine[0].dtype), list(mine[0].shape)
        for s in mine:
            if np.dtype(s.dtype) != dtype or list(s.shape) != shape:
                raise PayloadError(
                    f"payload field {field!r}: segment in {s.file!r} has dtype {s.dtype} shape "
                    f"{s.shape}, expected {dtype.str} {shape}"
                )
        fill_value = fill if fill is not None else FIELD_FILLS.get(field, 0)
        out = np.full((hi - lo, *shape), fill_value, dtype=dtype)
        for seg in clip_segments(mine, lo, hi):
            raw = self._pread(seg.file, seg.offset, seg.rows * _row_bytes(seg))
            rows = np.frombuffer(raw, dtype=dtype).reshape(seg.rows, *shape)
            out[seg.pos - lo : seg.pos - lo + seg.rows] = rows
        return out

    # -- deleting -------------------------------------------------------------------------------

    def delete_files(self, files: Iterable[str]) -> int:
        """Delete files a batch read; files already gone are not an error. Returns how many went."""
        n = 0
        for file in files:
            try:
                os.unlink(self.path(file))
                n += 1
            except FileNotFoundError:
                pass
        return n

    def versions_on_disk(self) -> list[int]:
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            m = _VERSION_DIR.match(entry.name)
            if m and entry.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def sweep_orphans(self, live_versions: Iterable[int], current_version: int) -> list[int]:
        """Delete every ``v<k>`` directory with ``k`` below the oldest live version.

        ``live_versions`` must name the version of every holder that may still read a file (see
        :meth:`TrainSink.live_payload_versions`, plus in-flight work the sink does not know of);
        ``current_version`` is always live, since new requests write there. Returns the deleted
        versions.
        """
        floor = min([current_version, *live_versions])
        deleted = []
        for k in self.versions_on_disk():
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
        """:meth:`sweep_orphans` in a worker thread; ``live_versions`` is read on the loop first."""
        live = list(live_versions)
        return await trio.to_thread.run_sync(
            self.sweep_orphans, live, current_version, limiter=self.limiter
        )
