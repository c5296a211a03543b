"""Reading a micro-batch's by-handle payload fields on a trainer rank, and releasing the files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..payloads import delete_files, field_window, read_field, segment_files
from ..wire import MicroBatch

__all__ = ["payload_files", "read_payload_arrays", "release_payload_files"]


def read_payload_arrays(
    mb: MicroBatch,
    *,
    lo: int = 0,
    hi: int | None = None,
    root: str | os.PathLike[str] | None = None,
) -> dict[str, np.ndarray[Any, Any]]:
    """Every payload field of ``mb`` as an array, for a rank training on tokens ``[lo, hi)``.

    Each field is read over its window (:func:`trio_rl.payloads.field_window`): a rank reads
    only its share of each segment. Dense fields are ``[rows, *shape]``, ragged ones ``[rows,
    width]`` padded with the field's fill. Segment files are opened as given; ``root`` resolves
    relative paths of old checkpoints. Blocking file I/O: call it in a worker thread.
    """
    segments = mb.payload or []
    length = len(mb.input_ids)
    end = length if hi is None else hi
    out: dict[str, np.ndarray[Any, Any]] = {}
    for field in dict.fromkeys(s.field for s in segments):
        wlo, whi = field_window(field, lo, end, length)
        arr = read_field(segments, field, wlo, whi, root=root)
        assert arr is not None  # the field has segments
        out[field] = arr
    return out


def payload_files(micro_batches: Iterable[MicroBatch]) -> set[str]:
    """The payload files a step's micro-batches refer to."""
    files: set[str] = set()
    for mb in micro_batches:
        files |= segment_files(mb.payload)
    return files


def release_payload_files(
    micro_batches: Iterable[MicroBatch], root: str | os.PathLike[str] | None = None
) -> int:
    """Delete the payload files of a consumed step (files already gone are fine)."""
    return delete_files(payload_files(micro_batches), root)
