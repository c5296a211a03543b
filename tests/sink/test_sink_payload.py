"""By-handle payloads: real files under tmp_path."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from operations_waits import documented
from trio_rl.payloads import PayloadStore, clip_segments, segment_files, shift_segments
from trio_rl.sink import PayloadError, PayloadFileMissingError
from trio_rl.wire import PayloadSegment


def test_write_then_read_roundtrip(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    experts = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)
    weights = np.linspace(0, 1, 8, dtype=np.float32).reshape(4, 2)
    segs = store.write_request(
        3, {"routed_experts": experts, "routed_expert_weights": weights}, pos=2
    )
    assert [s.file for s in segs] == [segs[0].file] * 2
    assert os.path.isabs(segs[0].file)
    assert Path(segs[0].file).parent == tmp_path / "v3"
    assert (segs[0].pos, segs[0].rows, segs[0].shape) == (2, 4, [2, 3])
    out = store.read_field(segs, "routed_experts", 0, 7)
    assert out is not None
    assert out.shape == (7, 2, 3)
    assert (out[:2] == 0).all()
    assert (out[6] == 0).all()
    np.testing.assert_array_equal(out[2:6], experts)
    w = store.read_field(segs, "routed_expert_weights", 3, 5)
    np.testing.assert_array_equal(w, weights[1:3])
    assert store.read_field(segs, "sampling_mask", 0, 4) is None


def test_fill_values_and_later_segments_win(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    a = store.write_request(1, {}, ragged={"sampling_mask": [[7, 7]] * 3}, pos=0)
    b = store.write_request(1, {}, ragged={"sampling_mask": [[9, 9]] * 2}, pos=2)
    out = store.read_field(a + b, "sampling_mask", 0, 6)
    assert out is not None
    assert out[:, 0].tolist() == [7, 7, 9, 9, -1, -1]
    lp = store.write_request(1, {}, ragged={"sampling_mask_logprobs": [[0.0]]}, pos=0)
    out2 = store.read_field(lp, "sampling_mask_logprobs", 0, 2)
    assert out2 is not None
    assert out2[0, 0] == 0.0
    assert np.isneginf(out2[1, 0])


@given(
    st.integers(0, 20),
    st.integers(1, 20),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(-5, 5),
)
def test_clip_and_shift_keep_rows_aligned(
    pos: int, rows: int, lo: int, hi: int, delta: int
) -> None:
    seg = PayloadSegment("f", "v0/x.bin", 100, pos, rows, "<i4", [3])
    out = clip_segments([seg], lo, hi)
    start, end = max(pos, lo), min(pos + rows, hi)
    if end <= start:
        assert out == []
        return
    (c,) = out
    assert (c.pos, c.rows) == (start, end - start)
    assert c.offset == 100 + (start - pos) * 12  # row = 3 x int32
    (s,) = shift_segments(out, delta)
    assert (s.pos, s.rows, s.offset) == (start + delta, c.rows, c.offset)


def test_clip_then_read_reads_the_same_rows(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    arr = np.arange(10, dtype=np.int64).reshape(10, 1)
    segs = store.write_request(0, {"routed_experts": arr}, pos=0)
    clipped = shift_segments(clip_segments(segs, 4, 8), -4)
    out = store.read_field(clipped, "routed_experts", 0, 4)
    assert out is not None
    assert out[:, 0].tolist() == [4, 5, 6, 7]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    segs = store.write_request(2, {"routed_experts": np.ones((2, 1), np.int32)})
    store.delete_files(segment_files(segs))
    with pytest.raises(PayloadFileMissingError, match=r"v2/.*\.bin.* does not exist") as info:
        store.read_field(segs, "routed_experts", 0, 2)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path.endswith(segs[0].file)


def test_short_reads_are_retried_then_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PayloadStore(tmp_path)
    segs = store.write_request(0, {"routed_experts": np.arange(4, dtype=np.int32).reshape(4, 1)})
    real = os.pread
    calls = []

    def flaky(fd: int, n: int, off: int) -> bytes:
        calls.append(n)
        data = real(fd, n, off)
        return data[:-1] if len(calls) == 1 else data

    monkeypatch.setattr(os, "pread", flaky)  # the modules the store uses
    monkeypatch.setattr(time, "sleep", lambda s: None)
    out = store.read_field(segs, "routed_experts", 0, 4)
    assert out is not None
    assert out[:, 0].tolist() == [0, 1, 2, 3]
    assert len(calls) == 2
    # a file that really is too short keeps failing and is reported with sizes
    bad = [PayloadSegment("routed_experts", segs[0].file, 0, 0, 40, "<i4", [])]
    monkeypatch.setattr(os, "pread", real)
    with pytest.raises(PayloadError, match="returned 16 of 160 bytes") as info:
        store.read_field(bad, "routed_experts", 0, 40)
    documented("a payload file read short", str(info.value))


def test_delete_after_read_tolerates_already_gone(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    segs = store.write_request(0, {"routed_experts": np.ones((1, 1), np.int32)})
    files = segment_files(segs)
    assert store.delete_files(files) == 1
    assert store.delete_files(files) == 0


def test_sweep_deletes_only_below_the_oldest_live_version(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path)
    for v in (1, 2, 3, 5):
        store.write_request(v, {"routed_experts": np.ones((1, 1), np.int32)})
    (tmp_path / "not-a-version").mkdir()
    assert store.sweep_orphans({3, 5}, current_version=6) == [1, 2]
    assert store.versions_on_disk() == [3, 5]
    # nothing live: the current version still bounds the sweep
    assert store.sweep_orphans(set(), current_version=5) == [3]
    assert store.versions_on_disk() == [5]
    assert (tmp_path / "not-a-version").is_dir()


async def test_async_wrappers_run_in_threads(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path, limiter=trio.CapacityLimiter(2))
    segs = await trio.to_thread.run_sync(
        lambda: store.write_request(4, {"routed_experts": np.ones((3, 2), np.int32)})
    )
    out = await store.aread_field(segs, "routed_experts", 0, 3)
    assert out is not None
    assert out.sum() == 6
    assert await store.adelete_files(segment_files(segs)) == 1
    assert await store.asweep_orphans([], current_version=9) == [4]
