"""Decoding: the inverse of encoding, tolerant like the reference, precise when data is bad."""

from __future__ import annotations

import math
from typing import Any

import attrs
import msgpack
import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from wire_reference import (  # noqa: F401 (both backends)
    REF_DECODER,
    codec_backend,
    micro_batches,
    minimal,
    pytest_generate_tests,
    wire_examples,
)

from trio_rl.wire import (
    MicroBatch,
    RoutedExperts,
    WireFormatError,
    decode,
    encode,
)
from trio_rl.wire._decode import _decode_fast, _Walker

FIELDS = [f.name for f in attrs.fields(MicroBatch)]


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(_has_nan(x) for x in value)
    if hasattr(value, "__attrs_attrs__"):
        return any(_has_nan(getattr(value, a.name)) for a in value.__attrs_attrs__)
    return False


@wire_examples
@given(st.lists(micro_batches, max_size=3))
def test_decode_inverts_encode(mbs: list[MicroBatch]) -> None:
    data = encode(mbs)
    decoded = decode(data)
    assert encode(decoded) == data
    if not _has_nan(mbs):
        assert decoded == mbs
    assert decode(bytearray(data)) == decoded or _has_nan(mbs)
    assert encode(decode(memoryview(data))) == data


def _packed(*items: Any) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


FIRST_NINE = [[1, 2], [True, False], [0.5, 0.0], [-0.1, -0.2], [0, 1], [2], [1.0, 1.0], ["e"], [2]]


def test_shorter_micro_batch_takes_defaults() -> None:
    (mb,) = decode(_packed(FIRST_NINE))
    assert mb == minimal(env_names=["e"])
    (mb,) = decode(_packed([*FIRST_NINE, [-1.0, -2.0], [b"\x01\x02", [2], "uint8"]]))
    assert mb.ref_logprobs == [-1.0, -2.0]
    assert mb.routed_experts == RoutedExperts(b"\x01\x02", [2], "uint8")
    assert mb.payload is None
    assert mb.trace_ids is None


def test_longer_arrays_ignore_extra_trailing_elements() -> None:
    fields = [*FIRST_NINE, None, [b"\x01", [1], "uint8", "extra", {"k": [1, 2]}], *[None] * 9]
    (mb,) = decode(_packed([*fields, "future field", [1, 2, {"x": b"y"}]]))
    assert mb == minimal(
        env_names=["e"], routed_experts=RoutedExperts(data=b"\x01", shape=[1], dtype="uint8")
    )


def test_int_in_float_field_and_float32_accepted() -> None:
    data = bytearray(_packed([*FIRST_NINE[:2], [1, 2.0], *FIRST_NINE[3:]]))
    (mb,) = decode(data)
    assert mb.advantages == [1, 2.0]
    float32 = _packed(FIRST_NINE).replace(
        bytes.fromhex("cb3fe0000000000000"), bytes.fromhex("ca3f000000")
    )
    assert decode(float32)[0].advantages == [0.5, 0.0]


def _error(data: bytes, source: str | None = None) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        decode(data, source=source)
    return info.value


def test_error_names_offset_field_and_source() -> None:
    data = encode([minimal(), minimal()])
    second = 1 + (len(data) - 1) // 2
    # Offset 4 within a micro-batch is input_ids' first element (after 91/dc0014/92).
    bad = data[: second + 4] + b"\xa1x" + data[second + 5 :]
    err = _error(bad, source="step 3 rank 1")
    assert (err.offset, err.micro_batch, err.field) == (second + 4, 1, "input_ids[0]")
    assert err.source == "step 3 rank 1"
    assert str(err).startswith("step 3 rank 1: ")
    assert f"byte offset {second + 4}" in str(err)
    assert "'input_ids[0]'" in str(err)
    assert "expected int, got str" in str(err)


def _at(items: list[Any], marker: bytes, delta: int = 0) -> tuple[bytes, int]:
    """A payload and the offset of ``marker`` (plus ``delta``) in it."""
    data = _packed(*items)
    return data, data.rindex(marker) + delta


NINE = _packed(FIRST_NINE)
MALFORMED = [
    ((b"", 0), None, "truncated"),
    ((b"\x80", 0), None, "expected an array of micro-batches, got map"),
    ((b"\x91\xc0", 1), None, "expected a MicroBatch record (an array), got nil"),
    ((b"\x91\x92\x90\x90", 1), None, "record has 2 fields; its first 9 are required"),
    ((NINE + b"\x00", len(NINE)), None, "1 trailing bytes"),
    ((NINE[:-1], len(NINE) - 2), "seq_lens", "truncated"),
    (
        (NINE[: NINE.index(bytes.fromhex("cb3fe0")) + 4], NINE.index(bytes.fromhex("cb3fe0"))),
        "advantages[0]",
        "the value needs 9 bytes, only 4 remain",
    ),
    (_at([[*FIRST_NINE, [0.0, "x"]]], b"\xa1x"), "ref_logprobs[1]", "expected float, got str"),
    (
        _at([[*FIRST_NINE, None, [b"", [1, 2.5], "u8"]]], b"\xcb"),
        "routed_experts.shape[1]",
        "expected int, got float",
    ),
    (_at([[*FIRST_NINE, None, [b"", [1]]]], b"\x92\xc4"), "routed_experts", "first 3 are"),
    (_at([[*FIRST_NINE, None, None, [[["u", 1]]]]], b"\x92\xa1u"), "mm_refs.images[0]", "3"),
    (_at([[FIRST_NINE[0], [1, 0], *FIRST_NINE[2:]]], b"\x92\x01\x00", 1), "loss_mask[0]", "int"),
    (_at([[*FIRST_NINE[:7], [b"e"], [2]]], b"\xc4\x01e"), "env_names[0]", "expected str, got bin"),
    (_at([[*FIRST_NINE, None, [[1], [1], "x"]]], b"\x93\x91", 1), "routed_experts.data", "array"),
    (_at([[[1, [2]], *FIRST_NINE[1:]]], b"\x92\x01\x91", 2), "input_ids[1]", "got array"),
    (_at([[[True], *FIRST_NINE[1:]]], b"\x91\xc3", 1), "input_ids[0]", "expected int, got bool"),
    ((b"\x91\xdc\x00\x14\x91\xc1" + b"\x90" * 19, 5), "input_ids[0]", "0xc1"),
    ((b"\x91\xdc\x00\x14\xdd\xff\xff\xff\xff" + b"\x90" * 19, 4), "input_ids", "4294967295"),
    (
        (b"\x91\xdc\x00\x14" + b"\x90" * 7 + b"\x91\xa1\xff" + b"\x90" * 12, 12),
        "env_names[0]",
        "UTF-8",
    ),
]


@pytest.mark.parametrize(("case", "field", "reason"), MALFORMED)
def test_malformed_payloads(case: tuple[bytes, int], field: str | None, reason: str) -> None:
    data, offset = case
    err = _error(data)
    assert (err.offset, err.field) == (offset, field), str(err)
    assert reason in str(err)


def test_str_lists_are_checked_item_by_item() -> None:
    good = _packed([*FIRST_NINE[:7], ["a", "b", "\u00e9"], [2]])
    assert decode(good)[0].env_names == ["a", "b", "\u00e9"]
    bad = good.replace(b"\xa2\xc3\xa9", b"\xa2\xc3\x28")
    err = _error(bad)
    assert (err.offset, err.field) == (good.index(b"\xa2\xc3\xa9"), "env_names[2]")
    assert "not valid UTF-8" in str(err)


def test_extra_elements_must_still_be_well_formed() -> None:
    good = _packed([*FIRST_NINE, *[None] * 11, "extra"])
    assert decode(good)[0].env_names == ["e"]
    bad = good[:-6] + b"\xa5ab\xc1"  # truncated, and a byte MessagePack never uses
    err = _error(bad)
    assert err.field == "<extra element 20>"
    assert err.offset == len(good) - 6
    # Only well-formed: like the reference, the skipped str need not be UTF-8.
    assert decode(good[:-6] + b"\xa5ab\xffde")[0].env_names == ["e"]


def test_nesting_limit_matches_msgpack() -> None:
    # The payload array and the micro-batch are depths 1 and 2; msgpack allows 1024 in all.
    header = b"\x91\xdc\x00\x15"
    ok = header + _packed([*FIRST_NINE, *[None] * 11])[4:] + b"\x91" * 1021 + b"\x90"
    assert decode(ok)[0].env_names == ["e"]
    _Walker(ok, None).walk()  # the careful pass accepts it too
    too_deep = header + _packed([*FIRST_NINE, *[None] * 11])[4:] + b"\x91" * 1022 + b"\x90"
    assert "nested deeper" in str(_error(too_deep))


# --- fuzzing -----------------------------------------------------------------------------


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    data = bytearray(encode(draw(st.lists(micro_batches, min_size=1, max_size=2))))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "byte"]))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        elif data:
            data[at] = draw(st.sampled_from([0xC0, 0xC1, 0xC2, 0xCB, 0xDC, 0xDD, 0x90, 0xA1, 0xFF]))
    return bytes(data)


def _outcome(data: bytes) -> tuple[str, bytes | WireFormatError]:
    try:
        return "ok", encode(decode(data, source="fuzz"))
    except WireFormatError as exc:
        return "error", exc


@wire_examples
@given(mutated_payloads())
@example(b"\x91\xdc\x00\x15" + b"\x90" * 20 + b"\xd5\xff\x00\x00")
def test_fuzzed_payloads_decode_or_raise_wire_format_error(data: bytes) -> None:
    outcome, result = _outcome(data)
    if isinstance(result, WireFormatError):
        assert 0 <= result.offset <= len(data)
        assert str(result).startswith("fuzz: malformed micro-batch payload at byte offset ")
    # The careful pass (which finds offsets) accepts whatever the fast path accepts (and more:
    # extra elements that msgpack cannot build)...
    try:
        _Walker(data, None).walk()
        careful = "ok"
    except WireFormatError:
        careful = "error"
    try:
        _decode_fast(data)
        fast = "ok"
    except Exception:
        fast = "error"
    assert careful == "ok" or fast == "error"
    # ...and decode accepts exactly what the reference decoder accepts.
    try:
        REF_DECODER.decode(data)
        reference = "ok"
    except (msgspec.DecodeError, msgspec.ValidationError):
        reference = "error"
    assert careful == outcome == reference


@wire_examples
@given(
    micro_batches,
    st.integers(9, 20),
    st.lists(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3), max_size=3),
)
def test_any_prefix_of_fields_decodes_with_defaults(
    mb: MicroBatch, keep: int, extra: list[Any]
) -> None:
    # Re-frame the micro-batch with only its first `keep` fields (an older writer), or with
    # extra trailing elements (a newer writer).
    (full,) = msgpack.unpackb(encode([mb]), raw=False)
    expected = encode([MicroBatch(*[getattr(mb, f) for f in FIELDS[:keep]])])
    assert encode(decode(_packed(full[:keep]))) == expected
    assert encode(decode(_packed([*full, *extra]))) == encode([mb])
