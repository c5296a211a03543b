"""The rollout layer's exceptions. Every error this layer raises is a :class:`RolloutError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..samples import Group

__all__ = [
    "CreditError",
    "DataSourceError",
    "DriverFailed",
    "FailureBudgetExceeded",
    "GroupFailed",
    "RolloutConfigError",
    "RolloutError",
    "SourceExhausted",
]


class RolloutError(Exception):
    """Base class of every error raised by :mod:`trio_rl.rollout`."""


class RolloutConfigError(RolloutError, ValueError):
    """A bad setting, refused when the object is built (names the class, field and value)."""


class FailureBudgetExceeded(RolloutError):
    """Too many groups failed (see ``FailurePolicy.max_consecutive_failures`` and
    ``SyncRolloutDriver.max_failures``); ``__cause__`` is the last :class:`GroupFailed`.

    A group that fails the same way every time (an engine refusing every request) would
    otherwise be retried, or replaced by a new prompt, without bound.
    """


class CreditError(RolloutError):
    """Credit accounting was violated (a credit returned twice, or for an unknown group).

    This always means a bug in a group runner or a custom driver: the library's own runners
    return exactly one credit per started sample.
    """


class DataSourceError(RolloutError):
    """A data source could not be read or restored (names the file, line and field)."""


class SourceExhausted(RolloutError):
    """The data source has no prompt left (and nothing recycled is waiting)."""


class GroupFailed(RolloutError):
    """A group failed: one of its samples (or its group reward) raised.

    ``__cause__`` is the first real failure; :attr:`failures` holds every real failure as
    ``(sample_index, exception)`` pairs in the order they happened (``sample_index`` is None
    for a failing group reward). Siblings cancelled because of the failure are not failures.
    By the time this is raised, every sample task of the group has settled and returned its
    credit.
    """

    def __init__(
        self,
        group: Group,
        failures: Sequence[tuple[int | None, Exception]],
    ) -> None:
        self.group = group
        self.group_id = group.group_id
        self.failures: tuple[tuple[int | None, Exception], ...] = tuple(failures)
        if not self.failures:
            raise ValueError("GroupFailed needs at least one failure")
        first_index, first = self.failures[0]
        where = "group reward" if first_index is None else f"sample {first_index}"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        super().__init__(f"group {group.group_id} failed at {where}: {first!r}{more}")


class DriverFailed(RolloutError):
    """A fully-async driver stopped because its worker failed; ``__cause__`` says why.

    Once a driver has failed, every later :meth:`next_batch` raises this again.
    """
