"""The errors the publisher raises."""

from __future__ import annotations

__all__ = ["PublishClosedError", "PublishError", "ReleaseTimeoutError", "MonitorTimeoutError"]


class PublishError(Exception):
    """Base class of every error the publication path raises."""


class PublishClosedError(PublishError):
    """The publisher was used outside its ``async with`` lifetime."""


class ReleaseTimeoutError(PublishError):
    """The deferred memory release of a shipped batch did not finish within its deadline."""


class MonitorTimeoutError(PublishError):
    """The monitor did not accept a ship record within its deadline."""
