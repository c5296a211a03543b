"""Decoding and validation of micro-batch payloads.

The happy path is one ``msgpack.unpackb`` of the whole buffer (C speed) followed by a type check
of every field against the schema (``set(map(type, values))`` per list, so also C speed). When
that rejects the payload, the careful pass goes micro-batch by micro-batch, still at C speed
(msgpack's ``Unpacker.skip`` finds where each ends, ``unpackb`` and the type check judge it);
only a micro-batch rejected there is walked byte by byte in Python, to find the first malformed
value, its byte offset and its field, or to build it when msgpack could not (below). So finding
an error costs a few valid decodes of the same size, whatever the payload's shape.

Tolerance is the reference decoder's (msgspec, array-like Structs): a record array shorter than
the record (but holding every required field) gives the missing trailing fields their defaults;
a longer one has its extra trailing elements skipped, which checks only that they are
well-formed MessagePack (not that their str are UTF-8, their map keys hashable or their
timestamp extensions valid, none of which msgpack can build); an int is accepted in a float
list, a float32 in a float field. Everything else raises :class:`WireFormatError`.
"""

from __future__ import annotations

from typing import Any, NoReturn

import msgpack

from ..errors import TrioRLError
from ._errors import WireFormatError
from ._records import MicroBatch
from ._schema import MICRO_BATCH, ListOf, Optional, Record, Scalar, Spec

try:
    from . import _accel
except ImportError:  # msgspec is optional: msgpack alone is the baseline
    _accel = None  # type: ignore[assignment]

__all__ = ["decode"]

# msgpack's C unpacker refuses containers nested deeper than this (counting the payload's own
# array as depth 1); the careful pass enforces the same limit so both agree.
_MAX_DEPTH = 1024

_ALLOWED: dict[Scalar, frozenset[type]] = {
    Scalar.INT: frozenset({int}),
    Scalar.BOOL: frozenset({bool}),
    Scalar.FLOAT: frozenset({float, int}),
    Scalar.STR: frozenset({str}),
    Scalar.BIN: frozenset({bytes}),
}


class _RejectError(TrioRLError):
    """The fast path found the payload invalid; the careful pass says where and why."""


def _convert(value: Any, spec: Spec) -> Any:
    if type(spec) is ListOf:
        if type(value) is not list:
            raise _RejectError
        item = spec.item
        if type(item) is Scalar:
            if value and not set(map(type, value)) <= _ALLOWED[item]:
                raise _RejectError
            return value
        return [_convert(x, item) for x in value]
    if type(spec) is Optional:
        return None if value is None else _convert(value, spec.inner)
    if type(spec) is Record:
        if type(value) is not list or len(value) < spec.required:
            raise _RejectError
        # zip stops at the shorter: extra elements are ignored, missing ones take defaults.
        return spec.build(*[_convert(x, f[1]) for x, f in zip(value, spec.fields, strict=False)])
    assert type(spec) is Scalar
    if type(value) not in _ALLOWED[spec]:
        raise _RejectError
    return value


def _decode_fast(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
    """Decode ``data``; raise ``_RejectError`` or msgpack's own errors when it is invalid."""
    top = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    if type(top) is not list:
        raise _RejectError
    return [_convert(mb, MICRO_BATCH) for mb in top]


def decode(data: bytes | bytearray | memoryview, *, source: str | None = None) -> list[MicroBatch]:
    """The micro-batches of one payload (the inverse of :func:`encode`).

    Raises :class:`WireFormatError` naming the byte offset, micro-batch and field of the first
    malformed value, with ``source`` (a file name or ``"step S rank R"``) in the message. Pure
    and synchronous; decoding a large payload is CPU work for a worker thread.
    """
    try:
        if _accel is not None and _accel.ENABLED:
            return _accel.typed_decode(data)
        return _decode_fast(data)
    except Exception:
        # Includes MemoryError: a corrupt header can claim more items than any real payload;
        # the careful pass checks every count against the bytes left before msgpack sees it.
        pass
    return _decode_careful(bytes(data), source)


_UNPACK_OPTIONS: dict[str, Any] = {"raw": False, "strict_map_key": False, "use_list": True}


def _decode_careful(buf: bytes, source: str | None) -> list[MicroBatch]:
    walker = _Walker(buf, source)
    n, pos = walker.array(0, "an array of micro-batches", 1)
    # One copy of the rest into an Unpacker whose limits (which default to its buffer size)
    # cannot reject anything that fits in the payload.
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(buf), 1), **_UNPACK_OPTIONS)
    unpacker.feed(buf[pos:])
    base = pos
    in_step = True  # the unpacker is positioned at ``pos``
    out: list[MicroBatch] = []
    for i in range(n):
        walker.micro_batch = i
        end = -1
        if in_step:
            try:
                unpacker.skip()
                end = base + unpacker.tell()
            except Exception:
                in_step = False  # malformed: the walker below says where
        if end >= 0:
            try:
                # Under a one-item array, so msgpack counts nesting depth as in the payload.
                (top,) = msgpack.unpackb(b"\x91" + buf[pos:end], **_UNPACK_OPTIONS)
                out.append(_convert(top, MICRO_BATCH))
                pos = end
                continue
            except Exception:
                pass
        # Malformed (the walker raises), or valid but beyond msgpack (extras it cannot build).
        after, mb = walker.build(pos, MICRO_BATCH, "", 2)
        if end >= 0 and after != end:
            in_step = False  # the two disagree on where it ends: trust the walker from here
        pos = after
        out.append(mb)
    walker.micro_batch = None
    walker.path = ""
    if pos != len(buf):
        walker.fail(pos, f"{len(buf) - pos} trailing bytes after the array of {n} micro-batches")
    return out


def _describe(b: int) -> str:
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return "int"
    if b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if b <= 0xBF or 0xD9 <= b <= 0xDB:
        return "str"
    return {
        0xC0: "nil",
        0xC1: "the never-used byte 0xc1",
        0xC2: "bool",
        0xC3: "bool",
        0xC4: "bin",
        0xC5: "bin",
        0xC6: "bin",
        0xCA: "float",
        0xCB: "float",
    }.get(b, "ext")


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_SCALAR_OF = {"int": Scalar.INT, "bool": Scalar.BOOL, "float": Scalar.FLOAT, "str": Scalar.STR}
_SCALAR_OF["bin"] = Scalar.BIN


# Containers with fewer children are walked in Python (cheap); larger ones are skipped by
# msgpack, reading through ``_Reader`` in chunks of ``_PROBE_READ`` bytes.
_PROBE_MIN = 16
_PROBE_READ = 16 * 1024


class _Reader:
    """A file-like view of ``buf`` from ``pos`` to ``end``, after the bytes ``head``: lets a
    msgpack ``Unpacker`` start anywhere and copy only what it reads."""

    __slots__ = ("buf", "chunk", "end", "head", "pos")

    def __init__(self, buf: bytes, pos: int, end: int, head: bytes) -> None:
        self.buf, self.pos, self.end, self.head = buf, pos, end, head
        self.chunk = 256  # doubling: a probe of a few values copies little more than them

    def read(self, n: int) -> bytes:
        if self.head:
            out, self.head = self.head, b""
            return out
        size = min(n, self.chunk)
        self.chunk *= 2
        out = self.buf[self.pos : min(self.end, self.pos + size)]
        self.pos += len(out)
        return out


class _Scanner:
    """The careful pass's byte level: reads headers and skips values of any type, checking
    only that they are well-formed MessagePack, and reports where they are not
    (:class:`WireFormatError` with the offset and the current micro-batch and field)."""

    def __init__(self, data: bytes | bytearray | memoryview, source: str | None) -> None:
        self.buf = bytes(data)
        self.end = len(self.buf)
        self.source = source
        self.micro_batch: int | None = None
        self.path = ""
        self.probed = 0  # bytes msgpack has read for :meth:`_probe`

    def fail(self, pos: int, reason: str) -> NoReturn:
        raise WireFormatError(
            reason,
            offset=pos,
            field=self.path or None,
            micro_batch=self.micro_batch,
            source=self.source,
        )

    def need(self, start: int, stop: int) -> None:
        if stop > self.end:
            self.fail(
                start,
                f"data truncated: the value needs {stop - start} bytes, "
                f"only {self.end - start} remain",
            )

    def code(self, pos: int) -> int:
        if pos >= self.end:
            self.fail(pos, "data truncated: a value is missing at the end of the payload")
        return self.buf[pos]

    def uint(self, pos: int, width: int) -> int:
        return int.from_bytes(self.buf[pos : pos + width], "big")

    def head(self, pos: int) -> tuple[int, int, int]:
        """``(header length, payload length, child values)`` of the value at ``pos``."""
        b = self.code(pos)
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            return 1, 0, 0
        if b <= 0x8F:
            return 1, 0, 2 * (b & 0x0F)
        if b <= 0x9F:
            return 1, 0, b & 0x0F
        if b <= 0xBF:
            return 1, b & 0x1F, 0
        if b == 0xC1:
            self.fail(pos, "invalid MessagePack: the never-used byte 0xc1")
        if b in (0xCA, 0xCB):
            return 1, 4 if b == 0xCA else 8, 0
        if 0xCC <= b <= 0xD3:
            return 1, 1 << ((b - 0xCC) & 3), 0
        if 0xD4 <= b <= 0xD8:
            return 2, 1 << (b - 0xD4), 0
        if b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):
            width = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}[b]
            self.need(pos, pos + 1 + width)
            return 1 + width, self.uint(pos + 1, width), 0
        if b in (0xC7, 0xC8, 0xC9):
            width = 1 << (b - 0xC7)
            self.need(pos, pos + 2 + width)
            return 2 + width, self.uint(pos + 1, width), 0
        width = 2 if b in (0xDC, 0xDE) else 4
        self.need(pos, pos + 1 + width)
        n = self.uint(pos + 1, width)
        return 1 + width, 0, (2 * n if b in (0xDE, 0xDF) else n)

    def skip(self, pos: int, depth: int) -> int:
        """Check the well-formedness of the (any-typed) value at ``pos``; return its end.

        Structure only, as the reference skips extra elements: str bodies, map keys and
        extension bodies are not looked at. A large container is skipped by msgpack (C speed);
        only if msgpack rejects it is the bad part found, by bisecting over its children with
        msgpack, before walking bytes in Python.
        """
        header, _, children = self.head(pos)
        if children < _PROBE_MIN:
            return self._skip_slow(pos, depth)
        end = self._probe(pos, depth, None)
        if end is not None:
            return end
        # Each level bisected costs about the bytes up to the error; nested levels would cost
        # that again each, so past a budget linear in the size the Python walk takes over.
        budget = self.probed + 8 * (self.end - pos) + 16 * _PROBE_READ
        at, level = pos, depth
        while True:
            header, _, children = self.head(at)
            if children < _PROBE_MIN or self.probed > budget:
                break
            b = self.buf[at]
            if level > _MAX_DEPTH:
                self.fail(at, f"containers nested deeper than {_MAX_DEPTH}")
            if children > self.end - at - header:
                self.fail(
                    at,
                    f"data truncated: {_describe(b)} of {children} values "
                    f"but only {self.end - at - header} bytes remain",
                )
            bad = self._first_bad_child(at + header, level, children)
            if bad is None:
                break
            at, level = bad, level + 1
        self._skip_slow(at, level)  # raises: msgpack rejected the value there
        # msgpack and this walk disagree (they should not): this walk decides.
        return self._skip_slow(pos, depth)

    def _probe(self, pos: int, level: int, count: int | None) -> int | None:
        """Where msgpack ends the value at ``pos`` (nesting level ``level``) or, with
        ``count``, the ``count`` values from ``pos`` on (children of a container at
        ``level``); None if it rejects them. Costs the bytes it reads, at C speed."""
        head = b"\x91" * (level - 1)
        if count is not None:
            head += b"\xdd" + count.to_bytes(4, "big")
        reader = _Reader(self.buf, pos, self.end, head)
        unpacker = msgpack.Unpacker(
            reader, read_size=_PROBE_READ, max_buffer_size=self.end + len(head) + _PROBE_READ
        )
        try:
            unpacker.skip()
        except Exception:
            return None
        finally:
            self.probed += reader.pos - pos
        return pos + unpacker.tell() - len(head)

    def _first_bad_child(self, first: int, level: int, children: int) -> int | None:
        """The start of the first of ``children`` values from ``first`` that msgpack
        rejects (gallop, then bisect: O(log n) probes); None if it rejects none."""
        good, good_end, step = 0, first, 1
        while True:  # gallop: windows of 1, 2, 4, ... children after the good ones
            window = min(step, children - good)
            if window == 0:
                return None
            end = self._probe(good_end, level, window)
            if end is None:
                break
            good, good_end, step = good + window, end, step * 2
        while window > 1:  # the bad child is among ``window`` children from ``good_end``
            half = window // 2
            end = self._probe(good_end, level, half)
            if end is None:
                window = half
            else:
                good, good_end, window = good + half, end, window - half
        return good_end

    def _skip_slow(self, pos: int, depth: int) -> int:
        """:meth:`skip` in Python, value by value."""
        # Iterative, so hostile nesting cannot exhaust Python's stack.
        stack: list[int] = []  # children left, per open container
        pending = 1
        while True:
            if pending == 0:
                if not stack:
                    return pos
                stack.pop()
                pending = stack[-1] if stack else 0
                continue
            if stack:
                stack[-1] -= 1
                pending = stack[-1]
            else:
                pending = 0
            header, length, children = self.head(pos)
            b = self.buf[pos]
            container = _describe(b) in ("array", "map")
            if container:
                if depth + len(stack) > _MAX_DEPTH:
                    self.fail(pos, f"containers nested deeper than {_MAX_DEPTH}")
                if children > self.end - pos - header:
                    self.fail(
                        pos,
                        f"data truncated: {_describe(b)} of {children} values "
                        f"but only {self.end - pos - header} bytes remain",
                    )
                pos += header
                stack.append(children)
                pending = children
                continue
            self.need(pos, pos + header + length)
            pos += header + length

    def array(self, pos: int, what: str, depth: int) -> tuple[int, int]:
        """Read an array header that must be there; ``(count, position after header)``."""
        b = self.code(pos)
        kind = _describe(b)
        if kind != "array":
            self.fail(pos, f"expected {what}, got {kind}")
        if depth > _MAX_DEPTH:
            self.fail(pos, f"containers nested deeper than {_MAX_DEPTH}")
        header, _, n = self.head(pos)
        if n > self.end - pos - header:
            self.fail(
                pos,
                f"data truncated: array of {n} values but only {self.end - pos - header} "
                "bytes remain",
            )
        return n, pos + header


class _Walker(_Scanner):
    """The careful pass: walks the bytes, checking each value against the schema, and builds
    what msgpack could not."""

    def plain_scalars(self, pos: int, n: int, kind: Scalar) -> tuple[int, int]:
        """Skip the leading run of list items that are plainly valid (numbers, bools, ASCII str).

        Returns ``(items skipped, position)``; the general path checks the rest, so this
        only makes the careful pass fast on long numeric lists.
        """
        buf, end = self.buf, self.end
        numbers = kind is Scalar.INT or kind is Scalar.FLOAT
        floats = kind is Scalar.FLOAT
        bools = kind is Scalar.BOOL
        strs = kind is Scalar.STR
        i = 0
        while i < n and pos < end:
            b = buf[pos]
            if numbers and (b <= 0x7F or b >= 0xE0):
                step = 1
            elif numbers and 0xCC <= b <= 0xD3:
                step = 1 + (1 << ((b - 0xCC) & 3))
            elif floats and b == 0xCB:
                step = 9
            elif floats and b == 0xCA:
                step = 5
            elif bools and (b == 0xC2 or b == 0xC3):
                step = 1
            elif strs and 0xA0 <= b <= 0xBF:
                step = 1 + (b & 0x1F)
                body = buf[pos + 1 : pos + step]
                if not body.isascii() and not _utf8(body):
                    break
            else:
                break
            if pos + step > end:
                break
            pos += step
            i += 1
        return i, pos

    def value(self, pos: int, spec: Spec, path: str, depth: int) -> int:
        self.path = path
        if type(spec) is Scalar:
            b = self.code(pos)
            kind = _describe(b)
            got = _SCALAR_OF.get(kind)
            if got is not spec and not (spec is Scalar.FLOAT and got is Scalar.INT):
                self.fail(pos, f"expected {spec.value}, got {kind}")
            end = self.skip(pos, depth)
            if got is Scalar.STR:
                header = end - pos - self.head(pos)[1]
                try:
                    self.buf[pos + header : end].decode("utf-8")
                except UnicodeDecodeError as exc:
                    self.fail(pos, f"str is not valid UTF-8 ({exc.reason} at byte {exc.start})")
            return end
        if type(spec) is Optional:
            if self.code(pos) == 0xC0:
                return pos + 1
            return self.value(pos, spec.inner, path, depth)
        if type(spec) is ListOf:
            n, pos = self.array(pos, "an array", depth)
            first = 0
            if type(spec.item) is Scalar:
                first, pos = self.plain_scalars(pos, n, spec.item)
            for i in range(first, n):
                pos = self.value(pos, spec.item, f"{path}[{i}]", depth + 1)
            return pos
        assert type(spec) is Record
        start = pos
        n, pos = self.array(pos, f"a {spec.name} record (an array)", depth)
        if n < spec.required:
            self.fail(
                start,
                f"{spec.name} record has {n} fields; its first {spec.required} are required",
            )
        prefix = f"{path}." if path else ""
        for i in range(n):
            if i < len(spec.fields):
                name, field_spec = spec.fields[i]
                pos = self.value(pos, field_spec, prefix + name, depth + 1)
            else:
                self.path = f"{prefix}<extra element {i}>"
                pos = self.skip(pos, depth + 1)
        return pos

    def build(self, pos: int, spec: Spec, path: str, depth: int) -> tuple[int, Any]:
        """Check the value at ``pos`` like :meth:`value`; return its end and the value.

        Records are built field by field (their extra elements skipped); any other field is
        checked and then handed to msgpack, which can build whatever the check accepts.
        """
        self.path = path
        if type(spec) is Optional and type(spec.inner) is not Scalar:
            if self.code(pos) == 0xC0:
                return pos + 1, None
            return self.build(pos, spec.inner, path, depth)
        if type(spec) is ListOf and type(spec.item) is Record:
            n, pos = self.array(pos, "an array", depth)
            items = []
            for i in range(n):
                pos, item = self.build(pos, spec.item, f"{path}[{i}]", depth + 1)
                items.append(item)
            return pos, items
        if type(spec) is Record:
            start = pos
            n, pos = self.array(pos, f"a {spec.name} record (an array)", depth)
            if n < spec.required:
                self.fail(
                    start,
                    f"{spec.name} record has {n} fields; its first {spec.required} are required",
                )
            prefix = f"{path}." if path else ""
            values = []
            for i in range(n):
                if i < len(spec.fields):
                    name, field_spec = spec.fields[i]
                    pos, value = self.build(pos, field_spec, prefix + name, depth + 1)
                    values.append(value)
                else:
                    self.path = f"{prefix}<extra element {i}>"
                    pos = self.skip(pos, depth + 1)
            return pos, spec.build(*values)
        end = self.value(pos, spec, path, depth)
        return end, msgpack.unpackb(self.buf[pos:end], **_UNPACK_OPTIONS)

    def walk(self) -> None:
        n, pos = self.array(0, "an array of micro-batches", 1)
        for i in range(n):
            self.micro_batch = i
            pos = self.value(pos, MICRO_BATCH, "", 2)
        self.micro_batch = None
        self.path = ""
        if pos != self.end:
            self.fail(pos, f"{self.end - pos} trailing bytes after the array of {n} micro-batches")
