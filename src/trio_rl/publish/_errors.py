"""The errors the publisher raises (defined, with the whole tree, in :mod:`trio_rl.errors`).

A publisher used outside its lifetime raises ``trio.ClosedResourceError``.
"""

from __future__ import annotations

from ..errors import MonitorTimeoutError as MonitorTimeoutError
from ..errors import PackingError as PackingError
from ..errors import PublishError as PublishError
from ..errors import ReleaseTimeoutError as ReleaseTimeoutError

__all__ = ["MonitorTimeoutError", "PackingError", "PublishError", "ReleaseTimeoutError"]
