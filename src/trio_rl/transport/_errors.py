"""The transport layer's exceptions (defined, with the whole tree, in :mod:`trio_rl.errors`).

A sender or receiver used after it was closed raises ``trio.ClosedResourceError``.
"""

from __future__ import annotations

from ..errors import EndOfStreamError as EndOfStreamError
from ..errors import TransportError as TransportError
from ..errors import TransportIOError as TransportIOError
from ..errors import TransportTimeoutError as TransportTimeoutError

__all__ = [
    "EndOfStreamError",
    "TransportError",
    "TransportIOError",
    "TransportTimeoutError",
]
