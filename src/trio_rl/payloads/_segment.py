"""`PayloadSegment` and the pure position arithmetic on segments."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

__all__ = ["PayloadSegment", "clip_segments", "row_bytes", "segment_files", "shift_segments"]


@attrs.define(slots=True)
class PayloadSegment:
    """A by-handle run of rows of a per-token side array stored in a payload file.

    ``rows`` rows of ``shape``-shaped ``dtype`` elements start at byte ``offset`` of ``file``
    and belong to token positions ``pos .. pos + rows - 1`` of the sequence that carries the
    segment. ``file`` is opened as given (:class:`~trio_rl.payloads.PayloadStore` writes
    absolute paths), so any reader on the same filesystem can open it from any working
    directory.

    A ragged field (see :data:`~trio_rl.payloads.FIELDS`) stores, instead of the values, a
    CSR index: its rows are ``uint32`` absolute file offsets where each position's values start,
    and the file holds one more offset after the last row marking where the last row ends.
    """

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


def row_bytes(seg: PayloadSegment) -> int:
    """Bytes of one row of ``seg`` (``itemsize(dtype) * prod(shape)``)."""
    return int(np.dtype(seg.dtype).itemsize) * math.prod(seg.shape)


def clip_segments(segments: Sequence[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """Keep the part of each segment inside positions ``[lo, hi)``; drop empty overlaps.

    Positions stay in the same frame (shift afterwards to re-base them). Ragged segments clip
    the same way: their rows are fixed-width offsets.
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
                offset=seg.offset + (start - seg.pos) * row_bytes(seg),
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
