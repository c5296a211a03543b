"""The reference encoder, for differential tests: msgspec Structs built from the SPEC 4.3 table.

msgspec is a test-only dependency; these Structs mirror the reference's (array_like=True).
Also Hypothesis strategies for micro-batches with values at every encoding boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs
import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from trio_rl.wire import (
    MicroBatch,
    MMImageRef,
    MMRefs,
    PayloadSegment,
    RoutedExperts,
    SamplingMask,
    _accel,
)


class RefRoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class RefMMImageRef(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    url: str
    offset: int
    length: int


class RefMMRefs(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    images: list[RefMMImageRef]


class RefSamplingMask(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    ids: bytes
    counts: bytes


class RefPayloadSegment(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


class RefMicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RefRoutedExperts | None = None
    mm_refs: RefMMRefs | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    sampling_mask: RefSamplingMask | None = None
    trace_ids: list[str] | None = None
    branch_indices: list[int] | None = None
    payload: list[RefPayloadSegment] | None = None


REF_ENCODER = msgspec.msgpack.Encoder()
REF_DECODER = msgspec.msgpack.Decoder(list[RefMicroBatch])

_REF_OF: dict[type[Any], type[msgspec.Struct]] = {
    MicroBatch: RefMicroBatch,
    RoutedExperts: RefRoutedExperts,
    MMImageRef: RefMMImageRef,
    MMRefs: RefMMRefs,
    SamplingMask: RefSamplingMask,
    PayloadSegment: RefPayloadSegment,
}


def to_ref(value: Any) -> Any:
    """The msgspec mirror of an attrs wire record (recursively), keeping every Python value."""
    ref = _REF_OF.get(type(value))
    if ref is not None:
        return ref(*(to_ref(getattr(value, f.name)) for f in attrs.fields(type(value))))
    if isinstance(value, list):
        return [to_ref(x) for x in value]
    return value


def reference_encode(micro_batches: list[MicroBatch]) -> bytes:
    return REF_ENCODER.encode([to_ref(mb) for mb in micro_batches])


# --- strategies ----------------------------------------------------------------------------

INT_BOUNDARIES = sorted(
    {
        b + d
        for b in (0, 2**7, 2**8, 2**15, 2**16, 2**31, 2**32, 2**63, 2**64)
        for d in (-1, 0)
        if 0 <= b + d < 2**64
    }
    | {
        -b + d
        for b in (32, 33, 2**7, 2**15, 2**31, 2**63)
        for d in (0, 1, -1)
        if -(2**63) <= -b + d < 0
    }
)

ints = st.sampled_from(INT_BOUNDARIES) | st.integers(-(2**63), 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)
# The Python type of each value decides its encoding: an int in a float list stays an int.
float_items = floats | st.integers(-(2**63), 2**64 - 1)
texts = st.text(max_size=8) | st.sampled_from(["é" * 15, "x" * 31, "x" * 32, "€" * 86])
blobs = st.binary(max_size=64) | st.sampled_from([b"\x00" * n for n in (255, 256, 4095, 4096)])


def _lists(elements: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    # Small lists keep examples cheap; lists of 15/16 repeat one drawn value (the fixarray/array16
    # boundary), and the large boundaries have their own explicit tests.
    boundary = st.builds(
        lambda head, x, n: [head] + [x] * n, elements, elements, st.sampled_from([14, 15])
    )
    return st.lists(elements, max_size=3) | boundary


routed = st.builds(RoutedExperts, data=blobs, shape=_lists(ints), dtype=texts)
mm_refs = st.builds(
    MMRefs, images=st.lists(st.builds(MMImageRef, url=texts, offset=ints, length=ints), max_size=3)
)
sampling = st.builds(SamplingMask, ids=blobs, counts=blobs)
segments = st.builds(
    PayloadSegment,
    field=texts,
    file=texts,
    offset=ints,
    pos=ints,
    rows=ints,
    dtype=texts,
    shape=_lists(ints),
)

micro_batches = st.builds(
    MicroBatch,
    input_ids=_lists(ints),
    loss_mask=_lists(st.booleans()),
    advantages=_lists(float_items),
    inference_logprobs=_lists(float_items),
    position_ids=_lists(ints),
    sequence_lengths=_lists(ints),
    temperatures=_lists(float_items),
    env_names=_lists(texts),
    seq_lens=_lists(ints),
    ref_logprobs=st.none() | _lists(float_items),
    routed_experts=st.none() | routed,
    mm_refs=st.none() | mm_refs,
    mm_token_type_ids=st.none() | _lists(ints),
    rl_weights=st.none() | _lists(float_items),
    ce_weights=st.none() | _lists(float_items),
    ref_kl_weights=st.none() | _lists(float_items),
    sampling_mask=st.none() | sampling,
    trace_ids=st.none() | _lists(texts),
    branch_indices=st.none() | _lists(ints),
    payload=st.none() | st.lists(segments, max_size=3),
)


def minimal(**overrides: Any) -> MicroBatch:
    """The SPEC 4.3 worked example, with fields replaced as given."""
    fields: dict[str, Any] = {
        "input_ids": [1, 2],
        "loss_mask": [True, False],
        "advantages": [0.5, 0.0],
        "inference_logprobs": [-0.1, -0.2],
        "position_ids": [0, 1],
        "sequence_lengths": [2],
        "temperatures": [1.0, 1.0],
        "env_names": ["env"],
        "seq_lens": [2],
    }
    fields.update(overrides)
    return MicroBatch(**fields)


# --- how many examples ---------------------------------------------------------------------
#: The wire properties' examples: each property runs twice (both backends below), so the ``ci``
#: profile gives each case 200 of its 500 (derandomized: the same examples every run), which
#: keeps the CI suite under its 8 minutes; ``thorough`` and ``dev`` keep their own counts.
_profile = settings().max_examples  # the loaded profile's (tests/conftest.py)
# thorough (over 500): every example it asks for
wire_examples = settings(max_examples=_profile if _profile > 500 else min(200, _profile))


# --- both codec backends -------------------------------------------------------------------
# A wire test module that imports ``codec_backend`` and ``pytest_generate_tests`` from here
# runs each test twice: with msgspec as the codec's accelerator, and on msgpack alone (the
# baseline, as without msgspec installed). Both must give the same bytes and values. Tests
# decorated with ``accelerated_only`` (the speed goals) run with msgspec only.

F = TypeVar("F", bound=Callable[..., Any])


def accelerated_only(test: F) -> F:
    test.accelerated_only = True  # type: ignore[attr-defined]
    return test


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "codec_backend" in metafunc.fixturenames:
        only = getattr(metafunc.function, "accelerated_only", False)
        metafunc.parametrize(
            "codec_backend", ["msgspec"] if only else ["msgspec", "msgpack"], indirect=True
        )


@pytest.fixture(autouse=True)
def codec_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    enabled = _accel.ENABLED
    _accel.ENABLED = request.param == "msgspec"
    try:
        yield request.param
    finally:
        _accel.ENABLED = enabled
