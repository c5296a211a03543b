"""Decoding and validation of micro-batch payloads.

The happy path is one ``msgpack.unpackb`` of the whole buffer (C speed) followed by a type check
of every field against the schema (``set(map(type, values))`` per list, so also C speed). Only
when either rejects the payload does a second, careful pass walk the bytes in Python to find
the first malformed value, its byte offset and its field, for the error.

Tolerance is the reference decoder's: a record array shorter than the record (but holding every
required field) gives the missing trailing fields their defaults, a longer one has its extra
trailing elements ignored (they must still be well-formed MessagePack), an int is accepted in a
float list, a float32 in a float field. Everything else raises :class:`WireFormatError`.
"""

from __future__ import annotations

from typing import Any, NoReturn

import msgpack

from ._errors import WireFormatError
from ._records import MicroBatch
from ._schema import MICRO_BATCH, ListOf, Optional, Record, Scalar, Spec

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


class _Reject(Exception):
    """The fast path found the payload invalid; the careful pass says where and why."""


def _convert(value: Any, spec: Spec) -> Any:
    if type(spec) is ListOf:
        if type(value) is not list:
            raise _Reject
        item = spec.item
        if type(item) is Scalar:
            if value and not set(map(type, value)) <= _ALLOWED[item]:
                raise _Reject
            return value
        return [_convert(x, item) for x in value]
    if type(spec) is Optional:
        return None if value is None else _convert(value, spec.inner)
    if type(spec) is Record:
        if type(value) is not list or len(value) < spec.required:
            raise _Reject
        # zip stops at the shorter: extra elements are ignored, missing ones take defaults.
        return spec.build(*[_convert(x, f[1]) for x, f in zip(value, spec.fields, strict=False)])
    assert type(spec) is Scalar
    if type(value) not in _ALLOWED[spec]:
        raise _Reject
    return value


def _decode_fast(data: bytes | bytearray | memoryview) -> list[MicroBatch]:
    """Decode ``data``; raise ``_Reject`` or msgpack's own errors when it is invalid."""
    top = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    if type(top) is not list:
        raise _Reject
    return [_convert(mb, MICRO_BATCH) for mb in top]


def decode(data: bytes | bytearray | memoryview, *, source: str | None = None) -> list[MicroBatch]:
    """The micro-batches of one payload (the inverse of :func:`encode`).

    Raises :class:`WireFormatError` naming the byte offset, micro-batch and field of the first
    malformed value, with ``source`` (a file name or ``"step S rank R"``) in the message. Pure
    and synchronous; decoding a large payload is CPU work for a worker thread.
    """
    try:
        return _decode_fast(data)
    except MemoryError:
        # A corrupt header can claim more items than any real payload; the careful pass
        # names it without allocating. A genuine out-of-memory is re-raised below.
        problem: BaseException = MemoryError()
    except Exception as exc:
        problem = exc
    _Walker(data, source).walk()
    if isinstance(problem, MemoryError):
        raise problem
    # The careful pass accepts what the fast path rejected: report it rather than return
    # something unchecked. (Tests assert the two passes agree.)
    raise WireFormatError(
        f"payload rejected ({type(problem).__name__}: {problem})", offset=0, source=source
    ) from problem


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


_SCALAR_OF = {"int": Scalar.INT, "bool": Scalar.BOOL, "float": Scalar.FLOAT, "str": Scalar.STR}
_SCALAR_OF["bin"] = Scalar.BIN


class _Walker:
    """The careful pass: walks the bytes, checking each value against the schema."""

    def __init__(self, data: bytes | bytearray | memoryview, source: str | None) -> None:
        self.buf = bytes(data)
        self.end = len(self.buf)
        self.source = source
        self.micro_batch: int | None = None
        self.path = ""

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
        """Check the well-formedness of the (any-typed) value at ``pos``; return its end."""
        # Iterative, so hostile nesting cannot exhaust Python's stack.
        stack: list[list[int]] = []  # [children left, children total, is map]
        pending = 1
        while True:
            if pending == 0:
                if not stack:
                    return pos
                stack.pop()
                pending = stack[-1][0] if stack else 0
                continue
            is_key = bool(stack) and stack[-1][2] == 1 and (stack[-1][1] - stack[-1][0]) % 2 == 0
            if stack:
                stack[-1][0] -= 1
                pending = stack[-1][0]
            else:
                pending = 0
            header, length, children = self.head(pos)
            b = self.buf[pos]
            container = _describe(b) in ("array", "map")
            if container:
                if is_key:
                    self.fail(pos, f"a map key cannot be an {_describe(b)}")
                if depth + len(stack) > _MAX_DEPTH:
                    self.fail(pos, f"containers nested deeper than {_MAX_DEPTH}")
                if children > self.end - pos - header:
                    self.fail(
                        pos,
                        f"data truncated: {_describe(b)} of {children} values "
                        f"but only {self.end - pos - header} bytes remain",
                    )
                pos += header
                stack.append([children, children, 1 if _describe(b) == "map" else 0])
                pending = children
                continue
            self.need(pos, pos + header + length)
            body = self.buf[pos + header : pos + header + length]
            kind = _describe(b)
            if kind == "str":
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self.fail(pos, f"str is not valid UTF-8 ({exc.reason} at byte {exc.start})")
            elif kind == "ext" and self.buf[pos + header - 1] == 0xFF:
                self._timestamp(pos, body)
            pos += header + length

    def _timestamp(self, pos: int, body: bytes) -> None:
        # msgpack decodes ext type -1 as a Timestamp and rejects malformed ones.
        if len(body) == 8:
            nanoseconds = int.from_bytes(body[:4], "big") >> 2
        elif len(body) == 12:
            nanoseconds = int.from_bytes(body[:4], "big")
        elif len(body) == 4:
            return
        else:
            self.fail(pos, f"invalid timestamp extension of {len(body)} bytes")
        if nanoseconds > 999_999_999:
            self.fail(pos, "invalid timestamp extension (nanoseconds out of range)")

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
            elif strs and 0xA0 <= b <= 0xBF and buf[pos + 1 : pos + 1 + (b & 0x1F)].isascii():
                step = 1 + (b & 0x1F)
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
            return self.skip(pos, depth)
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

    def walk(self) -> None:
        n, pos = self.array(0, "an array of micro-batches", 1)
        for i in range(n):
            self.micro_batch = i
            pos = self.value(pos, MICRO_BATCH, "", 2)
        self.micro_batch = None
        self.path = ""
        if pos != self.end:
            self.fail(pos, f"{self.end - pos} trailing bytes after the array of {n} micro-batches")
