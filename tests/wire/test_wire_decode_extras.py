"""Extra trailing elements are skipped exactly as the reference skips them, and bad payloads
are rejected in time linear in their size.

The reference (msgspec, array-like Structs) skips the extra trailing elements of a record
without building them: it checks only that they are well-formed MessagePack, not that their
str are UTF-8, their map keys hashable or their timestamp extensions valid.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from wire_reference import (  # noqa: F401 (both backends)
    REF_DECODER,
    REF_ENCODER,
    codec_backend,
    micro_batches,
    minimal,
    pytest_generate_tests,
    wire_examples,
)

from conftest import scaled
from trio_rl.wire import MicroBatch, RoutedExperts, WireFormatError, decode, encode
from trio_rl.wire._decode import _Walker


def _array(items: list[bytes]) -> bytes:
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return head + b"".join(items)


def _map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


# Raw MessagePack values, including what msgpack cannot build but msgspec skips: str that are
# not UTF-8, timestamp extensions with bad lengths or nanoseconds, maps with array or map keys.
_LEAF_TABLE = [
    *(b"\xc0", b"\xc3", b"\x05", b"\xcd\x01\x00", b"\xcb" + b"\x00" * 8, b"\xa1a"),
    *(b"\xa2\xff\xfe", b"\xd9\x01\xff", b"\xc4\x01\x00", b"\xd4\x05\x00", b"\x90", b"\x80"),
    *(b"\xd6\xff\x00\x00\x00\x00", b"\xd7\xff" + b"\xff" * 8, b"\xc7\x03\xff\x00\x00\x00"),
    *(b"\x81\x91\x01\x02", b"\x81\x80\x02", b"\xa3\xe2\x82\xac", b"\xff"),
]


_leaves = st.sampled_from(_LEAF_TABLE) | st.floats().map(lambda f: msgpack.packb(f))
raw_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4).map(_array)
        | st.lists(st.tuples(inner, inner), max_size=3).map(_map)
    ),
    max_leaves=8,
)


def _frame(value: Any, extras: st.DrawFn) -> bytes:
    """``value`` (a wire record, list or scalar) framed with drawn extra trailing elements."""
    if attrs.has(type(value)):
        fields = [_frame(getattr(value, f.name), extras) for f in attrs.fields(type(value))]
        return _array(fields + extras(st.lists(raw_values, max_size=2)))
    if isinstance(value, list) and value and attrs.has(type(value[0])):
        return _array([_frame(x, extras) for x in value])
    return msgpack.packb(value, use_bin_type=True)


@st.composite
def payloads_with_extras(draw: st.DrawFn) -> tuple[bytes, list[MicroBatch], bool]:
    mbs = draw(st.lists(micro_batches, min_size=1, max_size=2))
    data = bytearray(_array([_frame(mb, draw) for mb in mbs]))
    corrupted = draw(st.booleans())
    if corrupted:
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[at] = draw(st.sampled_from([0xC1, 0xC0, 0xFF, 0x81, 0xA3, 0xD9, 0xDD, 0x00]))
        else:
            del data[at:]
    return bytes(data), mbs, corrupted


def _reference(data: bytes) -> bytes | None:
    try:
        return REF_ENCODER.encode(REF_DECODER.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


FIRST_NINE = [[1, 2], [True, False], [0.5, 0.0], [-0.1, -0.2], [0, 1], [2], [1.0, 1.0], ["e"], [2]]
_BASE = msgpack.packb([*FIRST_NINE, *[None] * 11])[3:]  # the 20 fields, without their header


def _with_extra(raw: bytes) -> bytes:
    return b"\x91\xdc\x00\x15" + _BASE + raw


@wire_examples
@given(payloads_with_extras())
@example((_with_extra(b"\x81\x91\x01\x02"), [minimal(env_names=["e"])], False))
@example((_with_extra(b"\x81\x80\x02"), [minimal(env_names=["e"])], False))
@example((_with_extra(b"\xa2\xff\xfe"), [minimal(env_names=["e"])], False))
@example((_with_extra(b"\xd7\xff" + b"\xff" * 8), [minimal(env_names=["e"])], False))
@example((_with_extra(b"\x81\xa1\xff\xc7\x03\xff\x00\x00\x00"), [minimal(env_names=["e"])], False))
def test_extra_elements_are_skipped_like_the_reference(
    case: tuple[bytes, list[MicroBatch], bool],
) -> None:
    data, mbs, corrupted = case
    reference = _reference(data)
    ours: bytes | None = None
    offset = 0
    try:
        ours = encode(decode(data, source="fuzz"))
    except WireFormatError as exc:  # nothing else may escape
        offset = exc.offset
    assert 0 <= offset <= len(data)
    assert (ours is None) == (reference is None), (ours, reference)
    if not corrupted:
        # Uncorrupted: both accept, and both decode the values the extras were appended to.
        assert ours == encode(mbs)
        assert reference == _reference(encode(mbs))


def test_nested_record_extras_are_skipped() -> None:
    data = msgpack.packb([[*FIRST_NINE, None, [b"\x01", [1], "uint8"]]], use_bin_type=True)
    at = data.index(b"\x93\xc4")
    data = data[:at] + b"\x94" + data[at + 1 :] + b"\x81\x91\x01\x02"
    (mb,) = decode(data)
    assert mb.routed_experts == RoutedExperts(b"\x01", [1], "uint8")


def test_str_in_a_known_field_must_still_be_utf8() -> None:
    data = msgpack.packb([FIRST_NINE])
    bad = data.replace(b"\xa1e", b"\xa1\xff")
    with pytest.raises(WireFormatError, match="UTF-8") as info:
        decode(bad)
    assert info.value.field == "env_names[0]"


# --- time ----------------------------------------------------------------------------------


def _best_of(runs: int, fn: Any) -> float:
    # CPU time of this process, not wall time (other processes on a busy machine do not count),
    # with the cyclic collector paused: late in a full test run its passes over everything the
    # earlier tests left alive dwarfed the decoder's own cost.
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(runs):
            start = time.process_time()
            fn()
            best = min(best, time.process_time() - start)
    finally:
        gc.enable()
    return best


def _rejects(data: bytes) -> None:
    with pytest.raises(WireFormatError):
        decode(data)


@pytest.mark.parametrize(
    ("extra", "count"), [(b"", 6_000), (b"\xdc\x00\xc8" + b"\xc0" * 200, 2_000)]
)
def test_error_in_a_large_payload_is_found_in_linear_time(extra: bytes, count: int) -> None:
    # Many tiny micro-batches (or ones whose extra element holds 200 nils), the error in the
    # last: finding it costs a few valid decodes of the same size, not a Python walk of every
    # value (which was 2x and 20x).
    tiny = MicroBatch([1], [True], [0.0], [0.0], [0], [1], [1.0], [""], [1])
    one = encode([tiny])[1:]
    if extra:
        one = b"\xdc\x00\x15" + one[3:] + extra
    n = scaled(count)
    valid = b"\xdd" + n.to_bytes(4, "big") + one * n
    assert len(decode(valid)) == n
    # best of several runs: the minimum is what the code costs, the rest is the machine's load
    t_valid = _best_of(5, lambda: decode(valid))
    for bad in (valid[:-1] + b"\xc1", valid[:-1], valid + b"\x00", valid[:-2] + b"\xa1\xff"):
        t_error = _best_of(5, lambda bad=bad: _rejects(bad))
        assert t_error < 5 * t_valid + 0.05, (t_error, t_valid)


# --- the C-speed skip agrees with the Python walk -----------------------------------------


def _wide_container(children: list[bytes], as_map: bool) -> bytes:
    if as_map:
        children = children[: len(children) // 2 * 2]
        return b"\xde" + (len(children) // 2).to_bytes(2, "big") + b"".join(children)
    return b"\xdd" + len(children).to_bytes(4, "big") + b"".join(children)


@st.composite
def wide_values(draw: st.DrawFn) -> tuple[bytes, int]:
    """Containers of 16 or more values (which skip() hands to msgpack), nested up to three
    deep, sometimes corrupted, at a nesting depth near the limit or not. One drawn byte per
    value keeps drawing cheap."""
    value = b""
    for _ in range(draw(st.integers(1, 3))):
        children = [
            _LEAF_TABLE[b % len(_LEAF_TABLE)] for b in draw(st.binary(min_size=16, max_size=24))
        ]
        if value:
            children.insert(draw(st.integers(0, len(children))), value)
        value = _wide_container(children, draw(st.booleans()))
    data = bytearray(value)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[at] = draw(st.sampled_from([0xC1, 0xC0, 0xDD, 0x9F, 0xDC, 0xA5]))
        else:
            del data[at:]
            break
    return bytes(data), draw(st.sampled_from([3, 1000, 1021, 1022, 1023, 1024, 1025]))


@wire_examples
@given(wide_values())
def test_msgpack_skip_agrees_with_the_python_walk(case: tuple[bytes, int]) -> None:
    # skip() lets msgpack skip large containers and bisects with it to find an error; the
    # plain Python walk is the authority: same end, or the same error at the same offset.
    data, depth = case

    def outcome(skip: Callable[[int, int], int]) -> tuple[object, ...]:
        try:
            return ("ok", skip(0, depth))
        except WireFormatError as exc:
            return ("error", exc.offset, exc.reason)

    assert outcome(_Walker(data, None).skip) == outcome(_Walker(data, None)._skip_slow)


def test_bisection_finds_an_error_deep_in_a_wide_extra() -> None:
    width = 5000
    inner = b"\xdd" + (width + 1).to_bytes(4, "big") + b"\xc0" * width + b"\xc1"
    outer = b"\xdc" + (width + 1).to_bytes(2, "big") + b"\x01" * width + inner
    data = _with_extra(outer)
    with pytest.raises(WireFormatError, match="0xc1") as info:
        decode(data)
    assert info.value.offset == len(data) - 1
    assert info.value.field == "<extra element 20>"
    walker = _Walker(data, None)
    with pytest.raises(WireFormatError):
        walker.skip(len(data) - len(outer), 3)
    assert walker.probed < 8 * len(outer)  # bisection, not a probe per child
