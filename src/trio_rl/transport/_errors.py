"""The transport layer's exceptions."""

from __future__ import annotations

__all__ = ["TransportError", "TransportTimeoutError"]


class TransportError(Exception):
    """A batch transport failed: a bad message, a wrong step, a socket or file problem."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A transport wait passed its deadline (the READY barrier, a batch file that never came)."""
