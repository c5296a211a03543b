"""The train layer's exceptions: every bad input names what was wrong and where."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "PayloadError",
    "PayloadFileMissing",
    "TrainError",
    "TrainSinkError",
]


class TrainError(Exception):
    """Base class of the train layer's errors."""


class TrainSinkError(TrainError, ValueError):
    """A group, sample or counter handed to the sink was malformed; the sink state is unchanged."""


class PayloadError(TrainError, OSError):
    """A by-handle payload file could not be read (short reads persisted, bad segment, ...)."""


class PayloadFileMissing(PayloadError, FileNotFoundError):
    """A payload segment names a file that does not exist (read and deleted, or never written)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"payload file {path!r} does not exist")
        self.path = path


class CheckpointError(TrainError):
    """A checkpoint file is truncated, corrupt, of an unknown schema version or malformed.

    ``path`` names the file. Loading never executes code from the file (MessagePack, no pickle).
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"checkpoint {path}: {message}")
        self.path = path
