"""The rollout layer's exceptions (defined, with the whole tree, in :mod:`trio_rl.errors`).

Every error this layer raises is a :class:`RolloutError`.
"""

from __future__ import annotations

from ..errors import CreditError as CreditError
from ..errors import DataSourceError as DataSourceError
from ..errors import DriverFailed as DriverFailed
from ..errors import DriverFailedError as DriverFailedError
from ..errors import FailureBudgetExceeded as FailureBudgetExceeded
from ..errors import FailureBudgetExceededError as FailureBudgetExceededError
from ..errors import GroupFailed as GroupFailed
from ..errors import GroupFailedError as GroupFailedError
from ..errors import RolloutConfigError as RolloutConfigError
from ..errors import RolloutError as RolloutError
from ..errors import SourceExhausted as SourceExhausted
from ..errors import SourceExhaustedError as SourceExhaustedError

__all__ = [
    "CreditError",
    "DataSourceError",
    "DriverFailed",
    "DriverFailedError",
    "FailureBudgetExceeded",
    "FailureBudgetExceededError",
    "GroupFailed",
    "GroupFailedError",
    "RolloutConfigError",
    "RolloutError",
    "SourceExhausted",
    "SourceExhaustedError",
]
