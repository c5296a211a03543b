"""msgspec as an optional accelerator of the codec (same API, same bytes, same values).

msgspec (the reference's own codec) encodes Python lists of numbers several times faster than
msgpack's generic packer, and its typed decoder validates while it decodes. When it is
importable, the encoder packs values with it and the decoder tries it first; msgpack stays the
baseline and decides every case msgspec does not take:

- encoding: a value msgspec refuses (a ``numpy.float64`` in a float list, say) is packed by
  msgpack instead, so whatever msgpack encodes is still encoded, to the same bytes;
- decoding: the typed decoder's structs mirror the schema, float fields as ``int | float`` so
  an int in a float list stays an int as in the baseline; a payload it rejects goes to the
  baseline's careful pass, which says where and why.

``TRIO_RL_WIRE_MSGSPEC=0`` in the environment disables it (the baseline alone).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec

from ._records import MicroBatch
from ._schema import MICRO_BATCH, ListOf, Optional, Record, Scalar, Spec

__all__ = ["ENABLED", "encoder", "typed_decode"]

ENABLED = os.environ.get("TRIO_RL_WIRE_MSGSPEC", "1") != "0"

_SCALAR_TYPES: dict[Scalar, Any] = {
    Scalar.INT: int,
    Scalar.BOOL: bool,
    Scalar.FLOAT: int | float,  # keeps ints as ints, as the baseline decoder does
    Scalar.STR: str,
    Scalar.BIN: bytes,
}

Convert = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _mirror(spec: Spec) -> tuple[Any, Convert]:
    """The msgspec type of ``spec`` and the function turning a decoded value into ours."""
    if type(spec) is Scalar:
        return _SCALAR_TYPES[spec], _identity
    if type(spec) is ListOf:
        item_type, item_convert = _mirror(spec.item)
        if item_convert is _identity:
            return list[item_type], _identity  # type: ignore[valid-type]
        return list[item_type], lambda v: [item_convert(x) for x in v]  # type: ignore[valid-type]
    if type(spec) is Optional:
        inner_type, inner_convert = _mirror(spec.inner)
        if inner_convert is _identity:
            return inner_type | None, _identity
        return inner_type | None, lambda v: None if v is None else inner_convert(v)
    assert type(spec) is Record
    return _mirror_record(spec)


def _mirror_record(spec: Record) -> tuple[Any, Convert]:
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    converts: list[tuple[str, Convert]] = []
    for i, (name, field_spec) in enumerate(spec.fields):
        field_type, convert = _mirror(field_spec)
        fields.append((name, field_type) if i < spec.required else (name, field_type, None))
        converts.append((name, convert))
    struct = msgspec.defstruct(f"_{spec.name}Mirror", fields, array_like=True, gc=False)
    build = spec.build
    if all(convert is _identity for _, convert in converts):
        names = [name for name, _ in converts]
        return struct, lambda s: build(*[getattr(s, n) for n in names])
    return struct, lambda s: build(*[convert(getattr(s, n)) for n, convert in converts])


_MICRO_BATCH_STRUCT, _TO_MICRO_BATCH = _mirror(MICRO_BATCH)
_DECODER = msgspec.msgpack.Decoder(list[_MICRO_BATCH_STRUCT])  # type: ignore[valid-type]

encoder = msgspec.msgpack.Encoder()


def typed_decode(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
    """Decode with msgspec's typed decoder; raises msgspec's errors when it rejects ``data``."""
    convert = _TO_MICRO_BATCH
    return [convert(s) for s in _DECODER.decode(data)]
