"""The train layer's exceptions (defined, with the whole tree, in :mod:`trio_rl.errors`).

Payload errors are not train errors: payload files are written by rollout and read by trainers.
"""

from __future__ import annotations

from ..errors import CheckpointCompactionError as CheckpointCompactionError
from ..errors import CheckpointError as CheckpointError
from ..errors import CodecError as CodecError
from ..errors import PayloadError as PayloadError
from ..errors import PayloadFileMissingError as PayloadFileMissingError
from ..errors import TrainError as TrainError
from ..errors import TrainSinkError as TrainSinkError

__all__ = [
    "CheckpointCompactionError",
    "CheckpointError",
    "CodecError",
    "PayloadError",
    "PayloadFileMissingError",
    "TrainError",
    "TrainSinkError",
]
