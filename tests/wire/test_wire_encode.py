"""The encoder is byte-identical to the reference (msgspec's MessagePack, array-like structs)."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_reference import (  # noqa: F401 (both backends)
    REF_DECODER,
    REF_ENCODER,
    accelerated_only,
    codec_backend,
    micro_batches,
    minimal,
    pytest_generate_tests,
    reference_encode,
    to_ref,
    wire_examples,
)

from trio_rl.wire import (
    MicroBatch,
    MMImageRef,
    MMRefs,
    PayloadSegment,
    RoutedExperts,
    SamplingMask,
    WireEncodeError,
    decode,
    encode,
    encode_into,
)

WORKED_EXAMPLE = bytes.fromhex(
    "dc0014"
    "920102"
    "92c3c2"
    "92cb3fe0000000000000cb0000000000000000"
    "92cbbfb999999999999acbbfc999999999999a"
    "920001"
    "9102"
    "92cb3ff0000000000000cb3ff0000000000000"
    "91a3656e76"
    "9102" + "c0" * 11
)


def test_spec_worked_example_is_literal() -> None:
    assert encode([minimal()]) == b"\x91" + WORKED_EXAMPLE
    assert encode([minimal()]) == reference_encode([minimal()])


@wire_examples
@given(st.lists(micro_batches, max_size=3))
def test_encode_and_encode_into_equal_reference(mbs: list[MicroBatch]) -> None:
    expected = reference_encode(mbs)
    assert encode(mbs) == expected
    out = io.BytesIO()
    written = encode_into(mbs, out)
    assert out.getvalue() == expected
    assert written == len(expected)


def test_int_in_float_list_encodes_as_int() -> None:
    mb = minimal(advantages=[1, 0.5], temperatures=[1, 1.0])
    data = encode([mb])
    assert data == reference_encode([mb])
    assert bytes.fromhex("9201cb3fe0000000000000") in data  # advantages: 1 as fixint
    assert bytes.fromhex("9201cb3ff0000000000000") in data


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "00"),
        (127, "7f"),
        (128, "cc80"),
        (255, "ccff"),
        (256, "cd0100"),
        (65535, "cdffff"),
        (65536, "ce00010000"),
        (2**32 - 1, "ceffffffff"),
        (2**32, "cf0000000100000000"),
        (2**64 - 1, "cfffffffffffffffff"),
        (-1, "ff"),
        (-32, "e0"),
        (-33, "d0df"),
        (-128, "d080"),
        (-129, "d1ff7f"),
        (-32768, "d18000"),
        (-32769, "d2ffff7fff"),
        (-(2**31), "d280000000"),
        (-(2**31) - 1, "d3ffffffff7fffffff"),
        (-(2**63), "d38000000000000000"),
    ],
)
def test_int_widths(value: int, expected: str) -> None:
    mb = minimal(input_ids=[value])
    data = encode([mb])
    assert data == reference_encode([mb])
    assert data.startswith(bytes.fromhex("91dc0014") + b"\x91" + bytes.fromhex(expected))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (float("nan"), "cb7ff8000000000000"),
        (float("inf"), "cb7ff0000000000000"),
        (float("-inf"), "cbfff0000000000000"),
        (-0.0, "cb8000000000000000"),
        (1.5, "cb3ff8000000000000"),
    ],
)
def test_floats_are_float64(value: float, expected: str) -> None:
    mb = minimal(advantages=[value])
    data = encode([mb])
    assert data == reference_encode([mb])
    assert bytes.fromhex("91" + expected) in data


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65535, 65536])
def test_array_length_boundaries(n: int) -> None:
    mb = minimal(input_ids=list(range(n)) if n else [], env_names=["e"] * n)
    data = encode([mb])
    assert data == reference_encode([mb])
    header = {0: "90", 1: "91", 15: "9f", 16: "dc0010", 17: "dc0011"}.get(
        n, "dcffff" if n == 65535 else "dd00010000"
    )
    assert data.startswith(bytes.fromhex("91dc0014" + header))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65535, 65536])
def test_micro_batch_count_boundaries(n: int) -> None:
    mbs = [minimal(), minimal(input_ids=[300, -40])] * (n // 2) + [minimal()] * (n % 2)
    data = encode(mbs)
    assert data == REF_ENCODER.encode(
        [to_ref(mb) for mb in mbs[:2]] * (n // 2) + [to_ref(minimal())] * (n % 2)
    )
    out = io.BytesIO()
    encode_into(mbs, out)
    assert out.getvalue() == data


@pytest.mark.parametrize("n", [0, 31, 32, 255, 256, 65535, 65536])
def test_str_length_boundaries(n: int) -> None:
    mb = minimal(env_names=["é" * (n // 2) + "x" * (n % 2)], trace_ids=["t" * n])
    assert encode([mb]) == reference_encode([mb])
    assert (b"\xa0" if n == 0 else b"t" * n) in encode([mb])


@pytest.mark.parametrize("n", [0, 1, 255, 256, 4095, 4096, 65535, 65536, 70000])
def test_bin_length_boundaries(n: int) -> None:
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    mb = minimal(
        routed_experts=RoutedExperts(data=data, shape=[n], dtype="uint8"),
        # any bytes-like object encodes as bin, though the record's fields say bytes
        sampling_mask=SamplingMask(
            ids=bytearray(data),  # type: ignore[arg-type]
            counts=memoryview(data),  # type: ignore[arg-type]
        ),
    )
    encoded = encode([mb])
    assert encoded == reference_encode([mb])
    header = {0: "c400", 1: "c401", 255: "c4ff", 256: "c50100", 4095: "c50fff"}.get(
        n, f"c5{n:04x}" if n < 65536 else f"c6{n:08x}"
    )
    assert bytes.fromhex("93" + header) + data in encoded


def test_every_nested_record_and_optional_stream() -> None:
    mb = minimal(
        ref_logprobs=[-1.0, -2.0],
        routed_experts=RoutedExperts(data=b"\x01\x02", shape=[2, 1, 1], dtype="uint8"),
        mm_refs=MMRefs(images=[MMImageRef(url="s3://x", offset=3, length=4)]),
        mm_token_type_ids=[0, 1],
        rl_weights=[1.0, 0.0],
        ce_weights=[0.0, 1],
        ref_kl_weights=[0.0, 0.0],
        sampling_mask=SamplingMask(ids=b"\x05\x00\x00\x00", counts=b"\x01\x00\x00\x00" * 2),
        trace_ids=["a", "b"],
        branch_indices=[0, 3],
        payload=[PayloadSegment("f", "v0/a.bin", 0, 1, 2, "float32", [4])],
    )
    data = encode([mb, minimal()])
    assert data == reference_encode([mb, minimal()])
    assert bytes.fromhex("93c4020102930201 01a575696e7438".replace(" ", "")) in data
    assert bytes.fromhex("919193a6") in data  # mm_refs: [[ [url, offset, length] ]]


def test_large_bins_stream_without_a_second_copy(tmp_path: object) -> None:
    # 16 MiB of routed-expert bytes written to a file: the encoder itself allocates next to
    # nothing (the bytes go from the record's own buffer to the file).
    data = bytes(16 << 20)
    mb = minimal(routed_experts=RoutedExperts(data=data, shape=[16 << 20], dtype="uint8"))
    path = tmp_path / "rank_0.bin"  # type: ignore[operator]
    with open(path, "wb") as f:
        tracemalloc.start()
        try:
            written = encode_into([mb], f)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20
    assert path.read_bytes() == encode([mb]) == reference_encode([mb])
    assert written == path.stat().st_size


def test_encode_builds_one_buffer_without_a_second_copy() -> None:
    data = bytes(16 << 20)
    mbs = [
        minimal(routed_experts=RoutedExperts(data=data[: 12 << 20], shape=[12 << 20], dtype="u1")),
        minimal(routed_experts=RoutedExperts(data=data[: 4 << 20], shape=[4 << 20], dtype="u1")),
    ]
    tracemalloc.start()
    try:
        encoded = encode(mbs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(encoded) > 16 << 20
    assert peak < len(encoded) + (2 << 20)  # the output itself, plus small change
    assert encoded == reference_encode(mbs)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"input_ids": [np.int64(1)]}, "input_ids"),
        ({"advantages": [object()]}, "advantages"),
        ({"input_ids": [2**64]}, "input_ids"),
        ({"routed_experts": "not a record"}, "routed_experts"),
        ({"payload": [None]}, "payload"),
    ],
)
def test_unencodable_values_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(WireEncodeError) as info:
        encode([minimal(), minimal(**overrides)])
    assert info.value.micro_batch == 1
    assert info.value.field == field
    assert f"micro-batch 1, field {field!r}" in str(info.value)


def test_values_msgspec_refuses_are_packed_by_msgpack_to_the_same_bytes() -> None:
    # numpy.float64 is a float subclass: msgpack packs it as float64, msgspec refuses it.
    mb = minimal(advantages=[np.float64(0.5), 1.5], rl_weights=[np.float64(2.0)])
    expected = reference_encode([minimal(advantages=[0.5, 1.5], rl_weights=[2.0])])
    assert encode([mb]) == expected
    out = io.BytesIO()
    encode_into([mb], out)
    assert out.getvalue() == expected


@accelerated_only
def test_list_heavy_micro_batches_are_packed_and_read_in_bulk_by_msgspec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Speed is shown by benchmarks/bench_encode.py (figures side by side with msgspec); here the
    # structure that gives it: list-heavy data goes to msgspec's C encoder and typed decoder in
    # one call per encode/decode, never value by value through msgpack, with identical bytes.
    from trio_rl.wire import _accel

    n = 5_000
    floats = [i * 0.001 - 3.0 for i in range(n)]
    mbs = [
        minimal(
            input_ids=list(range(1000, 1000 + n)),
            loss_mask=[i % 3 != 0 for i in range(n)],
            advantages=floats,
            inference_logprobs=floats,
            position_ids=list(range(n)),
            temperatures=[1.0] * n,
            env_names=["env"] * n,
            ref_logprobs=floats,
        )
        for _ in range(4)
    ]
    calls: list[str] = []
    real_encoder, real_decode = _accel.encoder, _accel.typed_decode

    class CountingEncoder:
        def encode(self, obj: object) -> bytes:
            calls.append("encode")
            return real_encoder.encode(obj)

        def encode_into(self, obj: object, buffer: bytearray, offset: int = 0) -> None:
            calls.append("encode_into")
            real_encoder.encode_into(obj, buffer, offset)

    def counting_decode(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
        calls.append("decode")
        return real_decode(data)

    monkeypatch.setattr(_accel, "encoder", CountingEncoder())
    monkeypatch.setattr(_accel, "typed_decode", counting_decode)
    data = encode(mbs)
    assert data == REF_ENCODER.encode([to_ref(mb) for mb in mbs])
    assert calls == ["encode"]
    calls.clear()
    assert decode(data) == mbs
    assert calls == ["decode"]


def test_encode_into_holds_about_one_micro_batch_of_lists(tmp_path: object) -> None:
    n = 20_000
    mbs = [
        minimal(
            input_ids=list(range(n)),
            advantages=[i * 0.5 for i in range(n)],
            inference_logprobs=[-0.1] * n,
            temperatures=[1.0] * n,
            env_names=["env"] * n,
        )
        for _ in range(4)
    ]
    one = len(encode(mbs[:1]))
    path = tmp_path / "rank_0.bin"  # type: ignore[operator]
    with open(path, "wb") as f:
        tracemalloc.start()
        try:
            encode_into(mbs, f)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 2 * one, f"peak {peak} B for micro-batches of {one} B"
    assert path.read_bytes() == encode(mbs) == reference_encode(mbs)
