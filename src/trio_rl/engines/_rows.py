"""One request waiting in an engine's batch (the torch and vLLM engines batch a group's samples)."""

from __future__ import annotations

import attrs
import trio

from ._protocol import Completion, GenerateRequest


@attrs.define(slots=True, eq=False)
class PendingRow:
    """A request of a batch; the batch's runner fills ``completion`` or ``error`` and sets
    ``done``. ``abandoned`` is set from the loop when the caller was cancelled: the runner drops
    the row instead of finishing it."""

    request: GenerateRequest
    done: trio.Event = attrs.field(factory=trio.Event)
    abandoned: bool = False
    completion: Completion | None = None
    error: BaseException | None = None
