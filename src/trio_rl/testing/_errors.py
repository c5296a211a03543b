"""The harness's exceptions (defined, with the whole tree, in :mod:`trio_rl.errors`)."""

from __future__ import annotations

from ..errors import InvariantViolation as InvariantViolation
from ..errors import InvariantViolationError as InvariantViolationError
from ..errors import ScriptedEngineError as ScriptedEngineError
from ..errors import ScriptedFailure as ScriptedFailure

__all__ = [
    "InvariantViolation",
    "InvariantViolationError",
    "ScriptedEngineError",
    "ScriptedFailure",
]
