"""`Sample.payload`: the typed payload field, its checkpoint record and old-record migration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builders import make_sample
from trio_rl.errors import PayloadError
from trio_rl.payloads import PayloadSegment, PayloadStore
from trio_rl.samples import Prompt, Sample
from trio_rl.sink import CheckpointError, CheckpointManager, SinkConfig, TrainSink
from trio_rl.sink import _checkpoint_format as checkpoint_mod
from trio_rl.sink._codec import CodecError, decode_sample, enc_segment, encode_sample


def _seg(file: str = "/tmp/p/v1/a.bin", pos: int = 0, rows: int = 3) -> PayloadSegment:
    return PayloadSegment("routed_experts", file, 16, pos, rows, "<i4", [2])


def test_payload_is_a_typed_tuple_field() -> None:
    s = Sample(7, 0, (1, 2), payload=[_seg()])
    assert s.payload == (_seg(),)
    assert "payload" not in s.metadata
    assert Sample(8, 0, (1,)).payload == ()
    with pytest.raises(PayloadError, match=r"sample 9: payload\[1\] must be a PayloadSegment"):
        Sample(9, 0, (1,), payload=[_seg(), {"file": "x"}])  # type: ignore[list-item]
    with pytest.raises(PayloadError, match=r"sample 7: payload\[0\] must be a PayloadSegment"):
        s.payload = ["x"]  # type: ignore[list-item]
    with pytest.raises(PayloadError, match="list or tuple of PayloadSegment, got NoneType"):
        s.payload = None  # type: ignore[assignment]
    assert s.payload == (_seg(),)  # a rejected assignment leaves the field as it was
    s.completion_tokens = [5]
    s.reset_for_retry()
    after: tuple[PayloadSegment, ...] = s.payload  # read as declared: the reset changed it
    assert after == ()  # its segments described the forgotten tokens


def test_record_carries_payload_field_and_leaves_metadata_alone() -> None:
    s = make_sample(3, 1.0)
    s.payload = (_seg(), _seg("/tmp/p/v1/b.bin", pos=3, rows=2))
    s.metadata["payload"] = {"user": "data"}  # no longer a reserved key
    rec = encode_sample(s)
    assert len(rec) == 15
    assert rec[13] == {"payload": {"user": "data"}}
    back = decode_sample(rec, "m")
    assert back.payload == s.payload
    assert back.metadata == {"payload": {"user": "data"}}
    plain = decode_sample(encode_sample(make_sample(4, 0.0)), "m")
    assert plain.payload == ()


def _legacy_record(s: Sample, segments: list[PayloadSegment]) -> list[Any]:
    """A sample record as written before the payload field: 14 fields, segments in metadata."""
    rec = encode_sample(s)[:14]
    rec[13] = {**rec[13], "payload": [enc_segment(g) for g in segments]}
    return rec


def test_old_record_migrates_metadata_payload_into_the_field() -> None:
    s = make_sample(5, 1.0)
    s.metadata["note"] = "kept"
    segs = [_seg(), _seg("v1/rel.bin", pos=3, rows=1)]  # old checkpoints held relative paths
    back = decode_sample(_legacy_record(s, segs), "m")
    assert back.payload == tuple(segs)
    assert all(isinstance(g, PayloadSegment) for g in back.payload)
    assert back.metadata == {"note": "kept"}
    # an old record without payload loads with an empty field
    assert decode_sample(encode_sample(s)[:14], "m").payload == ()


def test_old_record_with_malformed_payload_names_the_field() -> None:
    rec = _legacy_record(make_sample(5, 1.0), [_seg()])
    rec[13]["payload"][0][1] = "../../etc/passwd"
    with pytest.raises(CodecError, match=r"m\.metadata\.payload\[0\]\.file"):
        decode_sample(rec, "m")
    rec[13]["payload"] = "nope"
    with pytest.raises(CodecError, match=r"m\.metadata\.payload"):
        decode_sample(rec, "m")
    with pytest.raises(CodecError, match="14 or 15 fields, got 13"):
        decode_sample(rec[:13], "m")


async def test_old_checkpoint_file_restores_typed_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PayloadStore(tmp_path / "payload")
    sink = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    sink.open_group("g", Prompt("k", (1, 2, 3)), 3, 1)
    members = [make_sample(0, r, version=1) for r in (1.0, 0.0)]
    for m in members:
        m.payload = tuple(store.write_request(1, {"routed_experts": np.ones((7, 1), np.int32)}))
        sink.add_member("g", m)
    mgr = CheckpointManager(tmp_path / "ckpt", payload_root=store.root)
    # write the members the way the writer did before the payload field existed
    monkeypatch.setattr(
        checkpoint_mod, "encode_sample", lambda s: _legacy_record(s, list(s.payload))
    )
    path = await mgr.save(mgr.snapshot(sink))
    monkeypatch.undo()
    ck = await mgr.load(path)
    assert ck.missing_files == frozenset()
    (og,) = ck.sink.open_groups
    assert [m.payload for m in og.arrived] == [m.payload for m in members]
    assert all("payload" not in m.metadata for m in og.arrived)
    restored = TrainSink(SinkConfig(batch_size=8, max_off_policy_steps=None))
    (r,) = restored.load_state_dict(ck.sink).resumed
    assert [m.payload for m in r.arrived] == [m.payload for m in members]
    assert restored.live_payload_versions() >= {1}
    # a corrupt old record: today's writer refuses it (the reader would) before writing ...
    monkeypatch.setattr(
        checkpoint_mod,
        "encode_sample",
        lambda s: [*_legacy_record(s, [])[:13], {"payload": [["routed_experts"]]}],
    )
    with pytest.raises(CheckpointError, match=r"metadata\.payload\[0\].*refused by the writer"):
        await mgr.save(mgr.snapshot(sink, step=5))
    assert not mgr.path_for(5).exists()
    # ... and in a file an older writer left, it is a CheckpointError naming file and field
    monkeypatch.setattr(checkpoint_mod, "_judge", lambda name, rec, what, decode: rec)
    bad = await mgr.save(mgr.snapshot(sink))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"metadata\.payload\[0\]"):
        await mgr.load(bad)
