"""Byte-exact MessagePack encoding of micro-batches (the format: docs/wire.md).

The bytes equal those of the reference encoder (msgspec's MessagePack, array-like structs) for
the same Python values: records are arrays of all their fields in order, unset optional fields
are nil, floats are float64, ints take their smallest form, ``bytes`` are bin. msgpack's
``Packer(use_bin_type=True)`` with default options encodes every one of those types exactly so.

Payloads are written one micro-batch at a time, and large raw byte arrays (routed experts,
sampling masks) go from their own buffer straight to the output, so the encoder never holds a
second copy of the payload.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import msgpack

from ._errors import WireEncodeError
from ._records import MicroBatch

__all__ = ["encode", "encode_into"]

# Bins at least this long bypass the packer buffer and are written from their own memory.
_DIRECT_BIN = 1 << 12
# Flush the packer buffer to the output once it holds this much.
_FLUSH_AT = 1 << 20

_FIELDS = tuple(f.name for f in attrs.fields(MicroBatch))
_N_FIELDS = len(_FIELDS)


class Writable(Protocol):
    def write(self, data: bytes | memoryview, /) -> Any: ...


def array_header(n: int) -> bytes:
    """The MessagePack header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class _Stream:
    """A packer whose buffer is flushed to ``out`` between values; counts bytes written."""

    def __init__(self, out: Writable) -> None:
        self.out = out
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self.written = 0

    def flush(self) -> None:
        view = self.packer.getbuffer()
        try:
            if view.nbytes:
                self.out.write(view)
                self.written += view.nbytes
        finally:
            view.release()
        self.packer.reset()

    def maybe_flush(self) -> None:
        view = self.packer.getbuffer()
        size = view.nbytes
        view.release()
        if size >= _FLUSH_AT:
            self.flush()

    def write_raw(self, data: bytes | memoryview) -> None:
        self.flush()
        self.out.write(data)
        self.written += len(data)

    def bin(self, data: Any) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes < _DIRECT_BIN:
            self.packer.pack(view)
        else:
            if view.nbytes >= 1 << 32:
                raise ValueError(f"bin of {view.nbytes} bytes exceeds the MessagePack limit")
            # msgpack's Packer has no bare bin header: write header and memory ourselves.
            self.write_raw(_bin_header(view.nbytes))
            self.write_raw(view)


def _pack_micro_batch(stream: _Stream, mb: MicroBatch) -> None:
    packer = stream.packer
    pack = packer.pack
    packer.pack_array_header(_N_FIELDS)
    # Fields 1-10 are plain lists (or nil): one pack call each.
    pack(mb.input_ids)
    pack(mb.loss_mask)
    pack(mb.advantages)
    pack(mb.inference_logprobs)
    pack(mb.position_ids)
    pack(mb.sequence_lengths)
    pack(mb.temperatures)
    pack(mb.env_names)
    pack(mb.seq_lens)
    pack(mb.ref_logprobs)
    stream.maybe_flush()
    re = mb.routed_experts
    if re is None:
        pack(None)
    else:
        packer.pack_array_header(3)
        stream.bin(re.data)
        pack(re.shape)
        pack(re.dtype)
    mm = mb.mm_refs
    if mm is None:
        pack(None)
    else:
        packer.pack_array_header(1)
        packer.pack_array_header(len(mm.images))
        for image in mm.images:
            pack((image.url, image.offset, image.length))
    pack(mb.mm_token_type_ids)
    pack(mb.rl_weights)
    pack(mb.ce_weights)
    pack(mb.ref_kl_weights)
    sm = mb.sampling_mask
    if sm is None:
        pack(None)
    else:
        packer.pack_array_header(2)
        stream.bin(sm.ids)
        stream.bin(sm.counts)
    pack(mb.trace_ids)
    pack(mb.branch_indices)
    segments = mb.payload
    if segments is None:
        pack(None)
    else:
        packer.pack_array_header(len(segments))
        for s in segments:
            pack((s.field, s.file, s.offset, s.pos, s.rows, s.dtype, s.shape))
    stream.maybe_flush()


def _blame(mb: Any, index: int, exc: Exception) -> WireEncodeError:
    """Find the field of ``mb`` that failed to encode, for the error message."""
    if not isinstance(mb, MicroBatch):
        return WireEncodeError(
            f"expected a MicroBatch, got {type(mb).__name__}", micro_batch=index, field="<record>"
        )
    for name in _FIELDS:
        try:
            encode([MicroBatch(**_only(name, mb))])
        except Exception as field_exc:
            return WireEncodeError(
                f"{type(field_exc).__name__}: {field_exc}", micro_batch=index, field=name
            )
    return WireEncodeError(f"{type(exc).__name__}: {exc}", micro_batch=index, field="<unknown>")


def _only(name: str, mb: MicroBatch) -> dict[str, Any]:
    """``mb``'s fields with every field except ``name`` replaced by an always-valid value."""
    blank: dict[str, Any] = {f: ([] if i < 9 else None) for i, f in enumerate(_FIELDS)}
    blank[name] = getattr(mb, name)
    return blank


def encode_into(micro_batches: Sequence[MicroBatch], out: Writable) -> int:
    """Write the payload for ``micro_batches`` to ``out`` and return the number of bytes written.

    The bytes equal ``encode(micro_batches)``. The array header is written first, then each
    micro-batch in turn; large raw arrays are handed to ``out.write`` as views of their own
    memory. On error (:class:`WireEncodeError`) ``out`` may hold a partial payload. Pure and
    synchronous; meant for worker threads.
    """
    stream = _Stream(out)
    stream.write_raw(array_header(len(micro_batches)))
    for index, mb in enumerate(micro_batches):
        try:
            _pack_micro_batch(stream, mb)
        except (TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise _blame(mb, index, exc) from exc
        stream.flush()
    return stream.written


def _direct_bin_bytes(micro_batches: Sequence[MicroBatch]) -> int:
    """Bytes of the raw arrays that will be written straight from their own buffers."""
    total = 0
    for mb in micro_batches:
        try:
            bins = []
            if mb.routed_experts is not None:
                bins.append(mb.routed_experts.data)
            if mb.sampling_mask is not None:
                bins += [mb.sampling_mask.ids, mb.sampling_mask.counts]
            total += sum(n for n in map(len, bins) if n >= _DIRECT_BIN)
        except (AttributeError, TypeError):
            pass  # encode_into reports it
    return total


def encode(micro_batches: Sequence[MicroBatch]) -> bytes:
    """The MessagePack payload for ``micro_batches``: one array of 20-field arrays.

    Byte-identical to the reference encoder. Built in one buffer, one micro-batch at a time:
    the buffer is sized up front for the raw arrays (routed experts, sampling masks) and grows
    for the rest; the returned ``bytes`` is that buffer, trimmed (no final copy). Raises
    :class:`WireEncodeError` naming the micro-batch and field when a value cannot be encoded.
    """
    buffer = io.BytesIO()
    reserve = _direct_bin_bytes(micro_batches)
    if reserve:
        # Growing by the raw arrays' size in one step avoids BytesIO's over-allocation.
        reserve += _FLUSH_AT
        buffer.seek(reserve - 1)
        buffer.write(b"\0")
        buffer.seek(0)
    written = encode_into(micro_batches, buffer)
    buffer.truncate(written)
    return buffer.getvalue()
