"""One server of an :class:`~trio_rl.engines.EngineFleet`: its client, admin handle, state and
counters, kept apart from the fleet's logic so that each stays readable."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ..samples import PolicyVersion
from ._fleet_status import FleetServer, ServerState
from ._openai import OpenAICompatibleEngine

__all__ = ["Member"]


@attrs.define(slots=True, eq=False)
class Member:
    """A server of the fleet, as the fleet tracks it."""

    url: str
    engine: OpenAICompatibleEngine
    admin: Any  # VLLMAdmin (imported late: _vllm imports this package's modules)
    state: ServerState = "live"
    in_flight: int = 0
    loaded: PolicyVersion | None = None
    requests: int = 0
    failures: int = 0
    taken_out: int = 0
    taken_in: int = 0
    probe_failures: int = 0
    #: its models were compared with the fleet's (at opening, or when it first joined)
    checked: bool = False
    #: what it served when it was last refused for serving other models (reported once)
    refused: list[str] | None = None
    #: one cancel scope per request on it: taking the server out cancels them
    scopes: set[trio.CancelScope] = attrs.field(factory=set)

    def status(self) -> FleetServer:
        return FleetServer(
            self.url,
            self.state,
            self.in_flight,
            self.loaded,
            self.requests,
            self.failures,
            self.taken_out,
            self.taken_in,
        )
