"""The wire format's exceptions."""

from __future__ import annotations

__all__ = ["WireEncodeError", "WireFormatError"]


class WireFormatError(ValueError):
    """A payload that is not a valid array of micro-batches.

    ``offset`` is the byte offset of the offending value (for truncated data, of the value that
    the data ends inside), ``field`` the micro-batch field it belongs to (a path such as
    ``"routed_experts.shape"`` or ``"payload[2].rows"``; ``None`` outside any micro-batch),
    ``micro_batch`` the index of the micro-batch, and ``source`` what the payload came from (a
    file name or ``"step S rank R"``), when the caller said.
    """

    def __init__(
        self,
        reason: str,
        *,
        offset: int,
        field: str | None = None,
        micro_batch: int | None = None,
        source: str | None = None,
    ) -> None:
        self.reason = reason
        self.offset = offset
        self.field = field
        self.micro_batch = micro_batch
        self.source = source
        where = [f"byte offset {offset}"]
        if micro_batch is not None:
            where.append(f"micro-batch {micro_batch}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = f"{source}: " if source is not None else ""
        super().__init__(f"{prefix}malformed micro-batch payload at {', '.join(where)}: {reason}")


class WireEncodeError(ValueError):
    """A micro-batch holds a value the wire format cannot carry (e.g. a numpy scalar, a float
    in an int list that the encoder cannot pack, an int beyond 64 bits).

    ``micro_batch`` is the index of the offending micro-batch and ``field`` its field name.
    """

    def __init__(self, reason: str, *, micro_batch: int, field: str) -> None:
        self.reason = reason
        self.micro_batch = micro_batch
        self.field = field
        super().__init__(f"cannot encode micro-batch {micro_batch}, field {field!r}: {reason}")
