"""The operations tools' errors: every one is a :class:`~trio_rl.errors.TrioRLError`."""

from __future__ import annotations

from ..errors import TrioRLError

__all__ = ["InspectError", "MetricsFileError", "MissingExtraError", "ToolsError"]


class ToolsError(TrioRLError):
    """Base class of the operations tools' errors (inspect, plot, metrics sinks)."""


class InspectError(ToolsError, ValueError):
    """``trio-rl inspect`` was given a path that is none of the things it reads; ``path``
    names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class MetricsFileError(ToolsError, ValueError):
    """A ``metrics.jsonl`` line is not a JSON object with a step; names the file, the line
    number and the line's byte offset."""

    def __init__(self, path: str, line: int, offset: int, reason: str) -> None:
        super().__init__(f"{path}: line {line} (byte offset {offset}): {reason}")
        self.path = path
        self.line = line
        self.offset = offset


class MissingExtraError(ToolsError, ImportError):
    """An optional dependency a tool needs is not installed; the message says which extra
    installs it."""

    def __init__(self, what: str, package: str, extra: str) -> None:
        super().__init__(f"{what} needs the {package!r} package (pip install 'trio-rl[{extra}]')")
        self.package = package
        self.extra = extra
