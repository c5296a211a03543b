"""Ragged (CSR) fields and windowed reads, on real files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_rl.errors import PayloadError
from trio_rl.payloads import PayloadStore, clip_segments, field_window, read_field, shift_segments


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-5, 50), max_size=5), min_size=1, max_size=12),
    pos=st.integers(0, 4),
    window=st.tuples(st.integers(0, 20), st.integers(0, 20)),
)
def test_ragged_roundtrip_and_windows(
    tmp_path_factory: pytest.TempPathFactory,
    rows: list[list[int]],
    pos: int,
    window: tuple[int, int],
) -> None:
    store = PayloadStore(tmp_path_factory.mktemp("p"))
    segs = store.write_request(1, {}, ragged={"sampling_mask": rows}, pos=pos)
    width = max(len(r) for r in rows)
    lo, hi = min(window), max(window)
    out = read_field(segs, "sampling_mask", lo, hi)
    assert out is not None
    assert out.shape == (hi - lo, width), "width is the widest row of the field, any window"
    for q in range(lo, hi):
        want = rows[q - pos] if pos <= q < pos + len(rows) else []
        assert out[q - lo].tolist() == want + [-1] * (width - len(want))
    if len(rows) < 2:
        return
    # clipping and shifting (packing) keep the rows: ragged rows are fixed-width offsets
    clipped = shift_segments(clip_segments(segs, pos + 1, pos + len(rows)), -1)
    again = read_field(clipped, "sampling_mask", pos, pos + len(rows) - 1)
    assert again is not None
    assert [r[: len(w)].tolist() for r, w in zip(again, rows[1:], strict=True)] == rows[1:]


def test_a_window_reads_only_its_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PayloadStore(tmp_path)
    dense = np.arange(100 * 4, dtype=np.int32).reshape(100, 4)
    segs = store.write_request(2, {"routed_experts": dense})
    reads: list[tuple[int, int]] = []
    real = os.pread

    def spy(fd: int, n: int, off: int) -> bytes:
        reads.append((off, n))
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", spy)  # the module the store reads with
    out = read_field(segs, "routed_experts", 40, 50)
    assert out is not None
    np.testing.assert_array_equal(out, dense[40:50])
    assert reads == [(40 * 16, 10 * 16)], "a rank reads only its window of the segment"


def test_field_windows_follow_prime_rl() -> None:
    assert field_window("routed_experts", 4, 8, 10) == (4, 8)
    assert field_window("sampling_mask", 4, 8, 10) == (5, 9)
    assert field_window("sampling_mask", 6, 10, 10) == (7, 10)
    assert field_window("sampling_mask_logprobs", 4, 8, 10) == (0, 10)


def test_ragged_logprobs_are_float32_with_neg_inf_fill(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    segs = store.write_request(0, {}, ragged={"sampling_mask_logprobs": [[-0.5, -1.5], []]})
    out = read_field(segs, "sampling_mask_logprobs", 0, 3)
    assert out is not None
    assert out.dtype == np.float32
    assert out[0].tolist() == [-0.5, -1.5]
    assert np.isneginf(out[1:].astype(np.float32)).all()


def test_a_corrupt_ragged_index_names_file_and_byte(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    (seg,) = store.write_request(0, {}, ragged={"sampling_mask": [[1, 2], [3]]})
    with open(seg.file, "r+b") as f:  # the second row's start: not on a value boundary
        f.seek(seg.offset + 4)
        f.write(np.asarray([5], "<u4").tobytes())
    with pytest.raises(PayloadError, match=rf"row 0 of the index at byte {seg.offset} of .*"):
        read_field([seg], "sampling_mask", 0, 2)


def test_old_relative_segments_resolve_against_the_root(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    (seg,) = store.write_request(3, {"routed_experts": np.ones((2, 1), np.int32)})
    seg.file = os.path.relpath(seg.file, tmp_path)  # as checkpoints before absolute paths
    assert seg.file.startswith("v3/")
    out = store.read_field([seg], "routed_experts", 0, 2)
    assert out is not None
    assert out.sum() == 2
    assert store.delete_files([seg.file]) == 1
