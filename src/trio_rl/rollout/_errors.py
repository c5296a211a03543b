"""The rollout layer's exceptions: the tree's rollout branch, and :class:`GroupFailedError`.

Every error this layer raises is a :class:`RolloutError`. :class:`GroupFailedError` carries the
:class:`~trio_rl.samples.Group` that failed, so it is defined here, on the floor that knows
groups, rather than in :mod:`trio_rl.errors`, which imports nothing of ours (not even for
annotations).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CreditError as CreditError
from ..errors import DataSourceError as DataSourceError
from ..errors import DriverFailedError as DriverFailedError
from ..errors import FailureBudgetExceededError as FailureBudgetExceededError
from ..errors import InvalidArgumentError
from ..errors import RolloutConfigError as RolloutConfigError
from ..errors import RolloutError as RolloutError
from ..errors import SourceExhaustedError as SourceExhaustedError
from ..samples import Group

__all__ = [
    "CreditError",
    "DataSourceError",
    "DriverFailedError",
    "FailureBudgetExceededError",
    "GroupFailedError",
    "RolloutConfigError",
    "RolloutError",
    "SourceExhaustedError",
]


class GroupFailedError(RolloutError):
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
            raise InvalidArgumentError("GroupFailedError failures must hold at least one failure")
        first_index, first = self.failures[0]
        where = "group reward" if first_index is None else f"sample {first_index}"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        super().__init__(f"group {group.group_id} failed at {where}: {first!r}{more}")
