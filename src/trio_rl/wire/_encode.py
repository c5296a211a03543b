"""Byte-exact MessagePack encoding of micro-batches (the format: docs/wire.md).

The bytes equal those of the reference encoder (msgspec's MessagePack, array-like structs) for
the same Python values: records are arrays of all their fields in order, unset optional fields
are nil, floats are float64, ints take their smallest form, ``bytes`` are bin. msgpack's
``Packer(use_bin_type=True)`` with default options encodes every one of those types exactly so.

Payloads are written one micro-batch at a time, and large raw byte arrays (routed experts,
sampling masks) go from their own buffer straight to the output, so the encoder never holds a
second copy of the payload.

With msgspec installed (:mod:`._accel`), values are packed by msgspec's encoder, which emits
the same bytes several times faster for lists of numbers; a payload without large raw arrays
is then encoded in one msgspec call, exactly as the reference does.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import msgpack

from ._errors import WireEncodeError
from ._records import MicroBatch

try:
    from . import _accel
except ImportError:  # msgspec is optional: msgpack alone is the baseline
    _accel = None  # type: ignore[assignment]

__all__ = ["encode", "encode_into"]

# Bins at least this long bypass the packer buffer and are written from their own memory.
_DIRECT_BIN = 1 << 12
# Flush the packer buffer to the output once it holds this much.
_FLUSH_AT = 1 << 20

_FIELDS = tuple(f.name for f in attrs.fields(MicroBatch))
_N_FIELDS = len(_FIELDS)


class Writable(Protocol):
    def write(self, data: bytes | bytearray | memoryview, /) -> Any: ...


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
    """A packer whose buffer is flushed to ``out`` between values; counts bytes written.

    ``pack``, ``pack_array_header`` and ``buffered`` are what `_pack_micro_batch` needs of a
    packer; `_FastStream` provides the same on msgspec.
    """

    def __init__(self, out: Writable) -> None:
        self.out = out
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self.pack: Callable[[Any], object] = self.packer.pack
        self.pack_array_header: Callable[[int], object] = self.packer.pack_array_header
        self.written = 0

    def buffered(self) -> int:
        view = self.packer.getbuffer()
        size = view.nbytes
        view.release()
        return size

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
        if self.buffered() >= _FLUSH_AT:
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
            self.pack(view)
        else:
            if view.nbytes >= 1 << 32:
                raise ValueError(f"bin of {view.nbytes} bytes exceeds the MessagePack limit")
            # msgpack's Packer has no bare bin header: write header and memory ourselves.
            self.write_raw(_bin_header(view.nbytes))
            self.write_raw(view)


class _FastStream(_Stream):
    """`_Stream` packing with msgspec into a bytearray; msgpack packs what msgspec refuses."""

    def __init__(self, out: Writable) -> None:
        super().__init__(out)
        assert _accel is not None
        self.buf = bytearray()
        self.encode_into = _accel.encoder.encode_into
        self.pack = self._pack
        self.pack_array_header = self._pack_array_header

    def _pack(self, value: Any) -> None:
        buf = self.buf
        start = len(buf)
        try:
            self.encode_into(value, buf, start)
        except TypeError:  # e.g. numpy.float64, which msgpack packs as a float
            del buf[start:]
            buf += msgpack.packb(value, use_bin_type=True)

    def _pack_array_header(self, n: int) -> None:
        self.buf += array_header(n)

    def buffered(self) -> int:
        return len(self.buf)

    def flush(self) -> None:
        if self.buf:
            self.out.write(self.buf)
            self.written += len(self.buf)
            self.buf = bytearray()


def _pack_micro_batch(stream: _Stream, mb: MicroBatch) -> None:
    pack = stream.pack
    pack_array_header = stream.pack_array_header
    pack_array_header(_N_FIELDS)
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
        pack_array_header(3)
        stream.bin(re.data)
        pack(re.shape)
        pack(re.dtype)
    mm = mb.mm_refs
    if mm is None:
        pack(None)
    else:
        pack_array_header(1)
        pack_array_header(len(mm.images))
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
        pack_array_header(2)
        stream.bin(sm.ids)
        stream.bin(sm.counts)
    pack(mb.trace_ids)
    pack(mb.branch_indices)
    segments = mb.payload
    if segments is None:
        pack(None)
    else:
        pack_array_header(len(segments))
        for s in segments:
            pack((s.field, s.file, s.offset, s.pos, s.rows, s.dtype, s.shape))
    stream.maybe_flush()


def _values(mb: MicroBatch) -> tuple[Any, ...]:
    """``mb`` as the nested tuples msgspec encodes to its wire form (records are arrays)."""
    re, mm, sm, segments = mb.routed_experts, mb.mm_refs, mb.sampling_mask, mb.payload
    return (
        mb.input_ids,
        mb.loss_mask,
        mb.advantages,
        mb.inference_logprobs,
        mb.position_ids,
        mb.sequence_lengths,
        mb.temperatures,
        mb.env_names,
        mb.seq_lens,
        mb.ref_logprobs,
        None if re is None else (_bin(re.data), re.shape, re.dtype),
        None if mm is None else ([(i.url, i.offset, i.length) for i in mm.images],),
        mb.mm_token_type_ids,
        mb.rl_weights,
        mb.ce_weights,
        mb.ref_kl_weights,
        None if sm is None else (_bin(sm.ids), _bin(sm.counts)),
        mb.trace_ids,
        mb.branch_indices,
        None
        if segments is None
        else [(s.field, s.file, s.offset, s.pos, s.rows, s.dtype, s.shape) for s in segments],
    )


def _bin(data: Any) -> Any:
    if type(data) is bytes or type(data) is bytearray:
        return data
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
    fast = _accel is not None and _accel.ENABLED
    stream = _FastStream(out) if fast else _Stream(out)
    stream.write_raw(array_header(len(micro_batches)))
    for index, mb in enumerate(micro_batches):
        if fast and not _direct_bin_bytes((mb,)):
            # Nothing to stream: one msgspec call for the whole micro-batch.
            try:
                whole = _accel.encoder.encode(_values(mb))
            except Exception:
                pass  # what msgspec refuses, or an error to name: packed value by value
            else:
                stream.write_raw(whole)
                del whole  # before the next micro-batch's buffer is built
                continue
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
            sizes = [memoryview(b).nbytes for b in bins]  # bytes, whatever the item format
            total += sum(n for n in sizes if n >= _DIRECT_BIN)
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
    reserve = _direct_bin_bytes(micro_batches)
    if not reserve and _accel is not None and _accel.ENABLED:
        # No large raw arrays to stream: one msgspec call, as fast as the reference.
        try:
            return _accel.encoder.encode([_values(mb) for mb in micro_batches])
        except Exception:
            pass  # what msgspec refuses, or an error to name: the streaming path decides
    buffer = io.BytesIO()
    if reserve:
        # Growing by the raw arrays' size in one step avoids BytesIO's over-allocation.
        reserve += _FLUSH_AT
        buffer.seek(reserve - 1)
        buffer.write(b"\0")
        buffer.seek(0)
    written = encode_into(micro_batches, buffer)
    buffer.truncate(written)
    return buffer.getvalue()
