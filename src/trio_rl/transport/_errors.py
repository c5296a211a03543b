"""The transport layer's exceptions."""

from __future__ import annotations

__all__ = ["EndOfStream", "TransportError", "TransportIOError", "TransportTimeoutError"]


class TransportError(Exception):
    """A batch transport failed: a bad message, a wrong step, a socket or file problem."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A transport wait passed its deadline (the READY barrier, a batch file that never came)."""


class TransportIOError(TransportError):
    """A file operation of the filesystem transport failed; ``path`` names the file."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class EndOfStream(TransportError):
    """The sender ended the stream: no step ``>= step`` will come (see `Sender.end_stream`).

    Raised by a receive asked for a step at or past the end (again on every later receive).
    """

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
