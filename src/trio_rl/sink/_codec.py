"""Compact MessagePack records for checkpoints: samples, prompts, segments.

Per-token lists are packed as raw little-endian arrays in MessagePack ext values (int32 or int64
ids, float64 values, one byte per bool, a (value, length) pair for constant float lists), which
keeps a 2k-token sample around 30 KB and makes packing a C-speed copy. Decoding builds plain
values only; nothing from the file is ever executed.
"""

from __future__ import annotations

import math
import struct
import sys
import typing
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ..samples import Prompt, Sample, SampleStatus
from ..wire import MMImageRef, MMRefs, PayloadSegment, RoutedExperts, SamplingMask
from ._errors import CodecError as CodecError
from ._types import TrainingSample

__all__ = [
    "decode_prompt",
    "decode_sample",
    "decode_training_sample",
    "encode_prompt",
    "encode_sample",
    "encode_training_sample",
]

_I32, _I64, _F64, _BOOL, _CONST = 1, 2, 3, 4, 5
_LITTLE = sys.byteorder == "little"
_CONST_FMT = struct.Struct("<dQ")


def _raw(a: array[Any]) -> bytes:
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def _from_raw(typecode: str, data: bytes) -> array[Any]:
    a = array(typecode)
    a.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a


def enc_ints(values: Sequence[int]) -> msgpack.ExtType:
    try:
        return msgpack.ExtType(_I32, _raw(array("i", values)))
    except OverflowError:
        return msgpack.ExtType(_I64, _raw(array("q", values)))


def enc_floats(values: Sequence[float]) -> msgpack.ExtType:
    # nonzero, non-NaN: equal values are then bit-identical (no -0.0 vs 0.0 ambiguity)
    if values and values[0] != 0.0 and values.count(values[0]) == len(values):
        return msgpack.ExtType(_CONST, _CONST_FMT.pack(float(values[0]), len(values)))
    return msgpack.ExtType(_F64, _raw(array("d", values)))


def enc_bools(values: Sequence[bool]) -> msgpack.ExtType:
    try:
        data = bytes(values)  # C speed for a list of bools
    except (TypeError, ValueError):
        data = bytes(1 if v else 0 for v in values)
    if data.count(0) + data.count(1) != len(data):
        data = bytes(1 if v else 0 for v in values)
    return msgpack.ExtType(_BOOL, data)


def enc_segment(s: PayloadSegment) -> list[Any]:
    return [s.field, s.file, s.offset, s.pos, s.rows, s.dtype, list(s.shape)]


def encode_training_sample(s: TrainingSample) -> list[Any]:
    return [
        enc_ints(s.token_ids),
        enc_bools(s.mask),
        enc_floats(s.logprobs),
        enc_floats(s.temperatures),
        s.env_name,
        None if s.advantages is None else enc_floats(s.advantages),
        None if s.ref_logprobs is None else enc_floats(s.ref_logprobs),
        None if s.mm_refs is None else [[i.url, i.offset, i.length] for i in s.mm_refs.images],
        None
        if s.routed_experts is None
        else [s.routed_experts.data, list(s.routed_experts.shape), s.routed_experts.dtype],
        None if s.mm_token_type_ids is None else enc_ints(s.mm_token_type_ids),
        None if s.rl_weights is None else enc_floats(s.rl_weights),
        None if s.ce_weights is None else enc_floats(s.ce_weights),
        None if s.ref_kl_weights is None else enc_floats(s.ref_kl_weights),
        None if s.sampling_mask is None else [s.sampling_mask.ids, s.sampling_mask.counts],
        s.trace_id,
        s.branch_index,
        None if s.payload is None else [enc_segment(p) for p in s.payload],
        s.policy_version,
        s.group_id,
        s.sample_index,
        s.arrival,
    ]


def encode_prompt(p: Prompt) -> list[Any]:
    return [p.key, enc_ints(p.tokens), p.label, p.env_name, dict(p.metadata)]


def encode_sample(s: Sample) -> list[Any]:
    """A sample record: 14 fields, then the payload segments (None when it has none)."""
    return [
        s.index,
        s.group_index,
        enc_ints(s.prompt_tokens),
        enc_ints(s.completion_tokens),
        enc_floats(s.logprobs),
        enc_bools(s.loss_mask),
        s.reward,
        s.status.value,
        list(s.policy_versions),
        s.routing_key,
        s.seed,
        s.label,
        s.env_name,
        dict(s.metadata),
        [enc_segment(seg) for seg in s.payload] if s.payload else None,
    ]


# -- decoding: every value is checked for type, range and length before it is used ---------------

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# a dimension of a per-token side array; far above any real one, far below an overflow
_MAX_DIM = 2**31
_NUMERIC = "biuf"


# checked in order: bool before int, since a boolean is an int to isinstance
_KINDS: tuple[tuple[type, str], ...] = (
    (type(None), "nil"),
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (bytes, "bytes"),
    (list, "an array"),
    (dict, "a map"),
)


def _kind(obj: object) -> str:
    for t, kind in _KINDS:
        if isinstance(obj, t):
            return kind
    if isinstance(obj, msgpack.ExtType):
        return f"a packed array of ext type {obj.code}"
    return type(obj).__name__


def want_int(obj: object, what: str, lo: int = 0, hi: int = _INT64_MAX) -> int:
    """An integer in ``[lo, hi]`` (booleans are not integers here)."""
    if type(obj) is not int:
        raise CodecError(what, f"expected an integer, got {_kind(obj)}")
    if not lo <= obj <= hi:
        raise CodecError(what, f"{obj} is out of range [{lo}, {hi}]")
    return obj


def want_opt_int(obj: object, what: str, lo: int = _INT64_MIN, hi: int = _INT64_MAX) -> int | None:
    return None if obj is None else want_int(obj, what, lo, hi)


def want_number(obj: object, what: str) -> float:
    """A finite int or float."""
    if type(obj) not in (int, float):
        raise CodecError(what, f"expected a number, got {_kind(obj)}")
    value = float(obj)  # type: ignore[arg-type]
    if not math.isfinite(value):
        raise CodecError(what, f"{value!r} is not finite")
    return value


def want_str(obj: object, what: str) -> str:
    if not isinstance(obj, str):
        raise CodecError(what, f"expected a string, got {_kind(obj)}")
    return obj


def want_opt_str(obj: object, what: str) -> str | None:
    return None if obj is None else want_str(obj, what)


def want_bytes(obj: object, what: str) -> bytes:
    if not isinstance(obj, bytes):
        raise CodecError(what, f"expected bytes, got {_kind(obj)}")
    return obj


def want_map(obj: object, what: str) -> dict[Any, Any]:
    if not isinstance(obj, dict):
        raise CodecError(what, f"expected a map, got {_kind(obj)}")
    return obj


def want_list(obj: object, what: str, n: int | None = None) -> list[Any]:
    if not isinstance(obj, list):
        raise CodecError(what, f"expected an array, got {_kind(obj)}")
    if n is not None and len(obj) != n:
        raise CodecError(what, f"expected an array of {n} fields, got {len(obj)}")
    return obj


def _ext(obj: object, what: str, codes: tuple[int, ...], kind: str) -> msgpack.ExtType:
    if not isinstance(obj, msgpack.ExtType):
        raise CodecError(what, f"expected a packed array, got {_kind(obj)}")
    if obj.code not in codes:
        raise CodecError(what, f"expected {kind} array, got ext type {obj.code}")
    return obj


def _count(what: str, got: int, n: int | None) -> None:
    if n is not None and got != n:
        raise CodecError(what, f"has {got} entries, expected {n}")


def _sized(what: str, data: bytes, size: int, n: int | None) -> int:
    if len(data) % size:
        raise CodecError(what, f"{len(data)} bytes are not a whole number of {size}-byte items")
    _count(what, len(data) // size, n)
    return len(data) // size


def dec_ints(obj: object, what: str, n: int | None = None, *, check: bool = False) -> list[int]:
    """An int array; ``n`` is the required length, if known. ``check``: the writer's check of
    a record it packed: the same rules, a read-only view instead of a new list."""
    e = _ext(obj, what, (_I32, _I64), "an int")
    code = "i" if e.code == _I32 else "q"
    _sized(what, e.data, 4 if e.code == _I32 else 8, n)
    if check and _LITTLE:
        view = memoryview(e.data)
        return typing.cast("list[int]", view.cast("i") if e.code == _I32 else view.cast("q"))
    return _from_raw(code, e.data).tolist()


def dec_floats(obj: object, what: str, n: int, *, check: bool = False) -> list[float]:
    """A float array of exactly ``n`` elements (a constant list is checked before it is built);
    ``check`` as for `dec_ints`."""
    e = _ext(obj, what, (_F64, _CONST), "a float")
    if e.code == _F64:
        _sized(what, e.data, 8, n)
        if check and _LITTLE:
            return typing.cast("list[float]", memoryview(e.data).cast("d"))
        return _from_raw("d", e.data).tolist()
    if len(e.data) != _CONST_FMT.size:
        raise CodecError(what, f"a constant list takes {_CONST_FMT.size} bytes, got {len(e.data)}")
    value, count = _CONST_FMT.unpack(e.data)
    _count(what, count, n)
    return [value] * count


def dec_bools(obj: object, what: str, n: int, *, check: bool = False) -> list[bool]:
    """``check`` as for `dec_ints` (the bytes: each is true exactly when its bool is)."""
    e = _ext(obj, what, (_BOOL,), "a bool")
    _count(what, len(e.data), n)
    if check:
        return typing.cast("list[bool]", e.data)
    return [b != 0 for b in e.data]


def _opt_floats(obj: object, what: str, n: int, check: bool = False) -> list[float] | None:
    return None if obj is None else dec_floats(obj, what, n, check=check)


def numeric_dtype(obj: object, what: str, kinds: str = _NUMERIC) -> np.dtype[Any]:
    """A plain numeric numpy dtype named by a string (no structured, object or datetime ones)."""
    name = want_str(obj, what)
    try:
        dtype = np.dtype(name)
    except Exception:  # numpy raises TypeError, ValueError or SyntaxError for a bad name
        raise CodecError(what, f"unknown dtype {name!r}") from None
    if dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
        raise CodecError(what, f"dtype {name!r} is not a plain numeric dtype")
    return dtype


def _shape(obj: object, what: str, min_dims: int = 0) -> list[int]:
    dims = want_list(obj, what)
    if len(dims) < min_dims or len(dims) > 32:
        raise CodecError(what, f"expected {min_dims} to 32 dimensions, got {len(dims)}")
    return [want_int(d, f"{what}[{i}]", 0, _MAX_DIM) for i, d in enumerate(dims)]


def _payload_file(obj: object, what: str) -> str:
    # Absolute (what PayloadStore writes) or, from older checkpoints, relative to the payload
    # root; never climbing with "..": the trainer reads and deletes it.
    file = want_str(obj, what)
    parts = file.replace("\\", "/").split("/")
    if not file or "\x00" in file or ".." in parts:
        raise CodecError(what, f"{file!r} is not a payload file path")
    return file


def dec_segment(obj: Any, what: str, length: int | None = None) -> PayloadSegment:
    """A payload segment; with ``length``, its rows must lie inside a sequence that long."""
    field, file, offset, pos, rows, dtype, shape = want_list(obj, what, 7)
    itemsize = numeric_dtype(dtype, f"{what}.dtype", _NUMERIC + "c").itemsize
    dims = _shape(shape, f"{what}.shape")
    seg = PayloadSegment(
        want_str(field, f"{what}.field"),
        _payload_file(file, f"{what}.file"),
        want_int(offset, f"{what}.offset"),
        want_int(pos, f"{what}.pos"),
        want_int(rows, f"{what}.rows"),
        dtype,
        dims,
    )
    if seg.offset + seg.rows * itemsize * math.prod(dims) > _INT64_MAX:
        raise CodecError(f"{what}.rows", "the rows end beyond any possible file offset")
    if length is not None and seg.pos + seg.rows > length:
        raise CodecError(
            f"{what}.rows",
            f"rows {seg.pos}..{seg.pos + seg.rows} run past the sequence of {length} tokens",
        )
    return seg


def _segments(obj: object, what: str, length: int | None) -> list[PayloadSegment] | None:
    if obj is None:
        return None
    return [dec_segment(p, f"{what}[{i}]", length) for i, p in enumerate(want_list(obj, what))]


def _mm_refs(obj: object, what: str) -> MMRefs | None:
    if obj is None:
        return None
    images = []
    for i, ref in enumerate(want_list(obj, what)):
        w = f"{what}[{i}]"
        url, offset, length = want_list(ref, w, 3)
        images.append(
            MMImageRef(
                want_str(url, f"{w}.url"),
                want_int(offset, f"{w}.offset"),
                want_int(length, f"{w}.length"),
            )
        )
    return MMRefs(images)


def _routed(obj: object, what: str, n: int) -> RoutedExperts | None:
    if obj is None:
        return None
    data, shape, dtype = want_list(obj, what, 3)
    data = want_bytes(data, f"{what}.data")
    dims = _shape(shape, f"{what}.shape", 1)
    if dims[0] != n:
        raise CodecError(f"{what}.shape", f"has {dims[0]} rows for {n} tokens")
    itemsize = numeric_dtype(dtype, f"{what}.dtype").itemsize
    if len(data) != math.prod(dims) * itemsize:
        raise CodecError(f"{what}.data", f"{len(data)} bytes do not hold shape {dims} of {dtype}")
    return RoutedExperts(data, dims, dtype)


def _sampling_mask(obj: object, what: str, n: int) -> SamplingMask | None:
    if obj is None:
        return None
    ids, counts = want_list(obj, what, 2)
    ids = want_bytes(ids, f"{what}.ids")
    counts = want_bytes(counts, f"{what}.counts")
    if len(counts) != 4 * n:
        raise CodecError(f"{what}.counts", f"{len(counts)} bytes for {n} int32 counts")
    per_token = _from_raw("i", counts)
    if n and min(per_token) < 0:
        raise CodecError(f"{what}.counts", "a count is negative")
    if len(ids) != 4 * sum(per_token):
        raise CodecError(f"{what}.ids", f"{len(ids)} bytes for {sum(per_token)} int32 ids")
    return SamplingMask(ids, counts)


def decode_training_sample(obj: Any, what: str, *, check: bool = False) -> TrainingSample:
    """A queued training sample; every per-token list has the length of ``token_ids``.

    ``check``: the writer's check of a record it packed (the same rules; per-token arrays are
    read-only views, not lists: the result is for judging, never kept)."""
    f = want_list(obj, what, 21)
    token_ids = dec_ints(f[0], f"{what}.token_ids", check=check)
    n = len(token_ids)
    if not n:
        raise CodecError(f"{what}.token_ids", "a training sample has at least one token")
    ts = TrainingSample(
        token_ids=token_ids,
        mask=dec_bools(f[1], f"{what}.mask", n, check=check),
        logprobs=dec_floats(f[2], f"{what}.logprobs", n, check=check),
        temperatures=dec_floats(f[3], f"{what}.temperatures", n, check=check),
        env_name=want_str(f[4], f"{what}.env_name"),
        advantages=_opt_floats(f[5], f"{what}.advantages", n, check),
        ref_logprobs=_opt_floats(f[6], f"{what}.ref_logprobs", n, check),
        mm_refs=_mm_refs(f[7], f"{what}.mm_refs"),
        routed_experts=_routed(f[8], f"{what}.routed_experts", n),
        mm_token_type_ids=None
        if f[9] is None
        else dec_ints(f[9], f"{what}.mm_token_type_ids", n, check=check),
        rl_weights=_opt_floats(f[10], f"{what}.rl_weights", n, check),
        ce_weights=_opt_floats(f[11], f"{what}.ce_weights", n, check),
        ref_kl_weights=_opt_floats(f[12], f"{what}.ref_kl_weights", n, check),
        sampling_mask=_sampling_mask(f[13], f"{what}.sampling_mask", n),
        trace_id=want_opt_str(f[14], f"{what}.trace_id"),
        branch_index=want_opt_int(f[15], f"{what}.branch_index"),
        payload=_segments(f[16], f"{what}.payload", n),
        policy_version=want_int(f[17], f"{what}.policy_version"),
        group_id=want_str(f[18], f"{what}.group_id"),
        sample_index=want_int(f[19], f"{what}.sample_index", -1),
        # counted up by the sink: bounded as the checkpoint schema's GROWS (2**62)
        arrival=want_int(f[20], f"{what}.arrival", 0, 2**62),
    )
    if ts.advantages is None:
        rl = ts.rl_weights
        if any(m and (rl is None or rl[i] != 0.0) for i, m in enumerate(ts.mask)):
            raise CodecError(f"{what}.advantages", "missing, but some tokens train")
    return ts


def decode_prompt(obj: Any, what: str) -> Prompt:
    f = want_list(obj, what, 5)
    return Prompt(
        key=want_str(f[0], f"{what}.key"),
        tokens=dec_ints(f[1], f"{what}.tokens"),
        label=f[2],
        env_name=want_str(f[3], f"{what}.env_name"),
        metadata=want_map(f[4], f"{what}.metadata"),
    )


def policy_versions(obj: object, what: str) -> list[int]:
    """Versions of a sample's engine calls: non-negative and, as versions only grow, in order."""
    versions = [want_int(v, f"{what}[{i}]") for i, v in enumerate(want_list(obj, what))]
    for i in range(1, len(versions)):
        if versions[i] < versions[i - 1]:
            raise CodecError(
                f"{what}[{i}]", f"version {versions[i]} after {versions[i - 1]} (out of order)"
            )
    return versions


#: The metadata key under which records without a payload field (14 fields, before the field
#: was added) kept a sample's payload segments; such records are migrated on load.
_LEGACY_PAYLOAD_KEY = "payload"


def decode_sample(obj: Any, what: str) -> Sample:
    """A sample record; a 14-field record (no payload field) has its segments migrated out of
    ``metadata["payload"]`` into :attr:`Sample.payload`."""
    f = want_list(obj, what)
    if len(f) not in (14, 15):
        raise CodecError(what, f"expected an array of 14 or 15 fields, got {len(f)}")
    completion = dec_ints(f[3], f"{what}.completion_tokens")
    n = len(completion)
    meta = dict(want_map(f[13], f"{what}.metadata"))
    if len(f) == 15:
        payload = _segments(f[14], f"{what}.payload", None)
    else:
        payload = _segments(meta.pop(_LEGACY_PAYLOAD_KEY, None), f"{what}.metadata.payload", None)
    status = want_str(f[7], f"{what}.status")
    try:
        status_ = SampleStatus(status)
    except ValueError:
        raise CodecError(f"{what}.status", f"unknown status {status!r}") from None
    return Sample(
        index=want_int(f[0], f"{what}.index"),
        group_index=want_int(f[1], f"{what}.group_index"),
        prompt_tokens=dec_ints(f[2], f"{what}.prompt_tokens"),
        completion_tokens=completion,
        logprobs=dec_floats(f[4], f"{what}.logprobs", n),
        loss_mask=dec_bools(f[5], f"{what}.loss_mask", n),
        reward=None if f[6] is None else want_number(f[6], f"{what}.reward"),
        status=status_,
        policy_versions=policy_versions(f[8], f"{what}.policy_versions"),
        routing_key=want_opt_str(f[9], f"{what}.routing_key"),
        seed=want_opt_int(f[10], f"{what}.seed"),
        label=f[11],
        env_name=want_str(f[12], f"{what}.env_name"),
        metadata=meta,
        payload=payload or (),
    )
