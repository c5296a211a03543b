"""The operations tools' errors, defined with every other in :mod:`trio_rl.errors`."""

from __future__ import annotations

from ..errors import InspectError, MetricsFileError, MissingExtraError, ToolsError

__all__ = ["InspectError", "MetricsFileError", "MissingExtraError", "ToolsError"]
