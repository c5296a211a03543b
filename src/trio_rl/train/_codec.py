"""Compact MessagePack records for checkpoints: samples, prompts, segments.

Per-token lists are packed as raw little-endian arrays in MessagePack ext values (int32 or int64
ids, float64 values, one byte per bool, a (value, length) pair for constant float lists), which
keeps a 2k-token sample around 30 KB and makes packing a C-speed copy. Decoding builds plain
values only; nothing from the file is ever executed.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from ..samples import Prompt, Sample, SampleStatus
from ..wire import MMImageRef, MMRefs, PayloadSegment, RoutedExperts, SamplingMask
from ._scoring import PAYLOAD_METADATA_KEY
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


class CodecError(ValueError):
    """A record does not have the expected shape; the caller adds the file and offset."""


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


def _ext(obj: object, what: str) -> msgpack.ExtType:
    if not isinstance(obj, msgpack.ExtType):
        raise CodecError(f"{what}: expected a packed array, got {type(obj).__name__}")
    return obj


def dec_ints(obj: object, what: str) -> list[int]:
    e = _ext(obj, what)
    if e.code == _I32:
        return _from_raw("i", e.data).tolist()
    if e.code == _I64:
        return _from_raw("q", e.data).tolist()
    raise CodecError(f"{what}: expected an int array, got ext type {e.code}")


def dec_floats(obj: object, what: str) -> list[float]:
    e = _ext(obj, what)
    if e.code == _F64:
        return _from_raw("d", e.data).tolist()
    if e.code == _CONST:
        value, n = _CONST_FMT.unpack(e.data)
        return [value] * n
    raise CodecError(f"{what}: expected a float array, got ext type {e.code}")


def dec_bools(obj: object, what: str) -> list[bool]:
    e = _ext(obj, what)
    if e.code != _BOOL:
        raise CodecError(f"{what}: expected a bool array, got ext type {e.code}")
    return [b != 0 for b in e.data]


def _opt(fn: Any, obj: Any, what: str) -> Any:
    return None if obj is None else fn(obj, what)


def enc_segment(s: PayloadSegment) -> list[Any]:
    return [s.field, s.file, s.offset, s.pos, s.rows, s.dtype, list(s.shape)]


def dec_segment(obj: Any, what: str) -> PayloadSegment:
    if not isinstance(obj, list) or len(obj) != 7:
        raise CodecError(f"{what}: a payload segment must be a 7-element array")
    field, file, offset, pos, rows, dtype, shape = obj
    return PayloadSegment(field, file, int(offset), int(pos), int(rows), dtype, list(shape))


def _check(obj: Any, n: int, what: str) -> list[Any]:
    if not isinstance(obj, list) or len(obj) != n:
        got = len(obj) if isinstance(obj, list) else type(obj).__name__
        raise CodecError(f"{what}: expected an array of {n} fields, got {got}")
    return obj


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


def decode_training_sample(obj: Any, what: str) -> TrainingSample:
    f = _check(obj, 21, what)
    mm = f[7]
    re_ = f[8]
    sm = f[13]
    return TrainingSample(
        token_ids=dec_ints(f[0], f"{what}.token_ids"),
        mask=dec_bools(f[1], f"{what}.mask"),
        logprobs=dec_floats(f[2], f"{what}.logprobs"),
        temperatures=dec_floats(f[3], f"{what}.temperatures"),
        env_name=f[4],
        advantages=_opt(dec_floats, f[5], f"{what}.advantages"),
        ref_logprobs=_opt(dec_floats, f[6], f"{what}.ref_logprobs"),
        mm_refs=None if mm is None else MMRefs([MMImageRef(u, o, n) for u, o, n in mm]),
        routed_experts=None if re_ is None else RoutedExperts(re_[0], list(re_[1]), re_[2]),
        mm_token_type_ids=_opt(dec_ints, f[9], f"{what}.mm_token_type_ids"),
        rl_weights=_opt(dec_floats, f[10], f"{what}.rl_weights"),
        ce_weights=_opt(dec_floats, f[11], f"{what}.ce_weights"),
        ref_kl_weights=_opt(dec_floats, f[12], f"{what}.ref_kl_weights"),
        sampling_mask=None if sm is None else SamplingMask(sm[0], sm[1]),
        trace_id=f[14],
        branch_index=f[15],
        payload=None
        if f[16] is None
        else [dec_segment(p, f"{what}.payload[{i}]") for i, p in enumerate(f[16])],
        policy_version=int(f[17]),
        group_id=f[18],
        sample_index=int(f[19]),
        arrival=int(f[20]),
    )


def encode_prompt(p: Prompt) -> list[Any]:
    return [p.key, enc_ints(p.tokens), p.label, p.env_name, dict(p.metadata)]


def decode_prompt(obj: Any, what: str) -> Prompt:
    f = _check(obj, 5, what)
    return Prompt(
        key=f[0], tokens=dec_ints(f[1], f"{what}.tokens"), label=f[2], env_name=f[3], metadata=f[4]
    )


def encode_sample(s: Sample) -> list[Any]:
    meta: Mapping[str, Any] = s.metadata
    payload = meta.get(PAYLOAD_METADATA_KEY)
    if isinstance(payload, list):
        meta = {k: v for k, v in meta.items() if k != PAYLOAD_METADATA_KEY}
        payload = [enc_segment(seg) for seg in payload]
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
        dict(meta),
        payload,
    ]


def decode_sample(obj: Any, what: str) -> Sample:
    f = _check(obj, 15, what)
    meta = dict(f[13])
    if f[14] is not None:
        meta[PAYLOAD_METADATA_KEY] = [
            dec_segment(p, f"{what}.payload[{i}]") for i, p in enumerate(f[14])
        ]
    try:
        status = SampleStatus(f[7])
    except ValueError:
        raise CodecError(f"{what}.status: unknown status {f[7]!r}") from None
    return Sample(
        index=int(f[0]),
        group_index=int(f[1]),
        prompt_tokens=dec_ints(f[2], f"{what}.prompt_tokens"),
        completion_tokens=dec_ints(f[3], f"{what}.completion_tokens"),
        logprobs=dec_floats(f[4], f"{what}.logprobs"),
        loss_mask=dec_bools(f[5], f"{what}.loss_mask"),
        reward=f[6],
        status=status,
        policy_versions=[int(v) for v in f[8]],
        routing_key=f[9],
        seed=f[10],
        label=f[11],
        env_name=f[12],
        metadata=meta,
    )
