"""Damaged checkpoint bytes always give one CheckpointError, never another exception."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import make_group
from trio_rl.samples import Prompt
from trio_rl.sink import (
    CheckpointError,
    CheckpointManager,
    SinkConfig,
    SinkCounters,
    SinkWindow,
    TrainSink,
    decode_checkpoint,
    encode_checkpoint,
)


def _blob() -> bytes:
    sink = TrainSink(SinkConfig(batch_size=99, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0]))
    sink.open_group("g", Prompt("k", (1,)), 3)
    return encode_checkpoint(CheckpointManager("unused").snapshot(sink, cursor={"c": 1}))


BLOB = _blob()


def test_intact_blob_decodes() -> None:
    ck = decode_checkpoint(BLOB)
    assert ck.cursor == {"c": 1}
    assert len(ck.sink.queued) == 2


@given(st.integers(0, len(BLOB) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_reported(pos: int, xor: int) -> None:
    bad = BLOB[:pos] + bytes([BLOB[pos] ^ xor]) + BLOB[pos + 1 :]
    with pytest.raises(CheckpointError, match=r"fuzz\.ckpt"):
        decode_checkpoint(bad, "fuzz.ckpt")


@given(st.integers(0, len(BLOB) - 1))
def test_any_truncation_is_reported(n: int) -> None:
    with pytest.raises(CheckpointError, match=r"fuzz\.ckpt"):
        decode_checkpoint(BLOB[:n], "fuzz.ckpt")


def _file(objs: list[Any]) -> bytes:
    body = b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)
    head = struct.pack("<8sHHI", b"TRIORLCK", 1, 0, 0)
    return head + body + struct.pack("<QI8s", len(body), zlib.crc32(body), b"TRIOEND!")


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=22) | st.dictionaries(st.text(max_size=6), kids, max_size=5)
    ),
    max_leaves=12,
)


@given(st.lists(msgpack_values, max_size=3), st.integers(0, 2), st.integers(0, 1))
def test_well_checksummed_garbage_is_reported(records: list[Any], nq: int, no: int) -> None:
    meta = {
        "step": 1,
        "sink": {"step": 1, "next_arrival": 0, "counters": {}, "window": {}},
        "n_queued": nq,
        "n_open": no,
    }
    for objs in ([meta, *records], records):
        outcome = _decode_or_error(_file(objs))
        # it either decodes into a checkpoint or fails with the library error naming the file
        assert outcome == "ok" or outcome == "fuzz.ckpt"


def _decode_or_error(data: bytes) -> str:
    try:
        decode_checkpoint(data, "fuzz.ckpt")
    except CheckpointError as exc:
        return exc.path
    return "ok"


def test_malformed_record_names_field_and_offset() -> None:
    meta = {
        "step": 3,
        "sink": {
            "step": 4,
            "next_arrival": 1,
            "counters": attrs.asdict(SinkCounters(dispatched=1)),
            "window": attrs.asdict(SinkWindow()),
        },
        "n_queued": 1,
        "n_open": 0,
    }
    record = ["not a packed array", *([None] * 20)]
    offset = 16 + len(msgpack.packb(meta, use_bin_type=True))
    with pytest.raises(CheckpointError) as info:
        decode_checkpoint(_file([meta, record]), "bad.ckpt")
    msg = str(info.value)
    assert msg.startswith("checkpoint bad.ckpt: sink.queued[0].token_ids: expected a packed array")
    assert f"byte offset {offset}" in msg


def test_unencodable_queued_sample_is_named() -> None:
    sink = TrainSink(SinkConfig(batch_size=99, max_off_policy_steps=None))
    sink.add_group(make_group([1.0, 0.0]))
    sink.queued_samples()[1].token_ids = [2**70]
    snap = CheckpointManager("unused").snapshot(sink)
    with pytest.raises(CheckpointError, match=r"queued\[1\] \(group \w+, sample \d+\)"):
        encode_checkpoint(snap)
