"""The shape of the wire records, as data: one description drives decoding and validation.

A spec is a scalar kind, ``ListOf``, ``Record`` or ``Optional``. Records decode from arrays of at
least their required fields (missing trailing fields take their defaults, extra trailing
elements are ignored), exactly like the reference decoder.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs

from ..payloads import PayloadSegment
from ._records import MicroBatch, MMImageRef, MMRefs, RoutedExperts, SamplingMask

__all__ = ["MICRO_BATCH", "ListOf", "Optional", "Record", "Scalar", "Spec"]


class Scalar(enum.Enum):
    INT = "int"
    BOOL = "bool"
    FLOAT = "float"
    STR = "str"
    BIN = "bin"


@attrs.frozen
class ListOf:
    item: Spec


@attrs.frozen
class Optional:
    inner: Spec


@attrs.frozen
class Record:
    name: str
    build: Callable[..., Any]
    fields: tuple[tuple[str, Spec], ...]
    required: int


Spec = Scalar | ListOf | Optional | Record


def _record(cls: type[Any], specs: dict[str, Spec]) -> Record:
    """Describe an attrs record; field names and order come from the class itself."""
    fields = attrs.fields(cls)
    names = [f.name for f in fields]
    if names != list(specs):
        raise AssertionError(f"wire schema of {cls.__name__} out of step with its record")
    required = sum(1 for f in fields if f.default is attrs.NOTHING)
    return Record(cls.__name__, cls, tuple(specs.items()), required)


_INTS = ListOf(Scalar.INT)
_FLOATS = ListOf(Scalar.FLOAT)

ROUTED_EXPERTS = _record(RoutedExperts, {"data": Scalar.BIN, "shape": _INTS, "dtype": Scalar.STR})
MM_IMAGE_REF = _record(MMImageRef, {"url": Scalar.STR, "offset": Scalar.INT, "length": Scalar.INT})
MM_REFS = _record(MMRefs, {"images": ListOf(MM_IMAGE_REF)})
SAMPLING_MASK = _record(SamplingMask, {"ids": Scalar.BIN, "counts": Scalar.BIN})
PAYLOAD_SEGMENT = _record(
    PayloadSegment,
    {
        "field": Scalar.STR,
        "file": Scalar.STR,
        "offset": Scalar.INT,
        "pos": Scalar.INT,
        "rows": Scalar.INT,
        "dtype": Scalar.STR,
        "shape": _INTS,
    },
)

MICRO_BATCH = _record(
    MicroBatch,
    {
        "input_ids": _INTS,
        "loss_mask": ListOf(Scalar.BOOL),
        "advantages": _FLOATS,
        "inference_logprobs": _FLOATS,
        "position_ids": _INTS,
        "sequence_lengths": _INTS,
        "temperatures": _FLOATS,
        "env_names": ListOf(Scalar.STR),
        "seq_lens": _INTS,
        "ref_logprobs": Optional(_FLOATS),
        "routed_experts": Optional(ROUTED_EXPERTS),
        "mm_refs": Optional(MM_REFS),
        "mm_token_type_ids": Optional(_INTS),
        "rl_weights": Optional(_FLOATS),
        "ce_weights": Optional(_FLOATS),
        "ref_kl_weights": Optional(_FLOATS),
        "sampling_mask": Optional(SAMPLING_MASK),
        "trace_ids": Optional(ListOf(Scalar.STR)),
        "branch_indices": Optional(_INTS),
        "payload": Optional(ListOf(PAYLOAD_SEGMENT)),
    },
)
