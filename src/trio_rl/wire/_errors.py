"""The wire format's exceptions (defined, with the whole tree, in :mod:`trio_rl.errors`)."""

from __future__ import annotations

from ..errors import WireEncodeError as WireEncodeError
from ..errors import WireFormatError as WireFormatError

__all__ = ["WireEncodeError", "WireFormatError"]
