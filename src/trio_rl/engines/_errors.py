"""The errors engines raise (defined, with the whole tree, in :mod:`trio_rl.errors`).

Every engine failure is an :class:`EngineError`, so a group runner can tell "the engine gave up
on this sample" from a bug in the caller. An engine used outside its lifetime raises
``trio.ClosedResourceError``.
"""

from __future__ import annotations

from ..errors import EngineAuthError as EngineAuthError
from ..errors import EngineConfigError as EngineConfigError
from ..errors import EngineError as EngineError
from ..errors import EngineRequestError as EngineRequestError
from ..errors import EngineResponseError as EngineResponseError
from ..errors import EngineTimeoutError as EngineTimeoutError
from ..errors import EngineTransportError as EngineTransportError
from ..errors import SimulatedEngineError as SimulatedEngineError

__all__ = [
    "EngineAuthError",
    "EngineConfigError",
    "EngineError",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeoutError",
    "EngineTransportError",
    "SimulatedEngineError",
]
