"""What an :class:`~trio_rl.engines.EngineFleet` reports about its servers: their states and
the events that moved them between states."""

from __future__ import annotations

from typing import Literal

import attrs

from ..samples import PolicyVersion

__all__ = ["FleetEvent", "FleetServer", "ServerState"]

#: ``live``: takes requests; ``out``: taken out (stopped answering), probed until it answers;
#: ``loading``: answers again and is loading the current weights before it is taken back in.
ServerState = Literal["live", "out", "loading"]


@attrs.frozen
class FleetServer:
    """One server of an :class:`EngineFleet`, as :meth:`EngineFleet.servers` reports it."""

    url: str
    state: ServerState
    #: Requests on it now.
    in_flight: int
    #: The policy version of the weights it has loaded (None: it has not loaded any since it
    #: came in, so it serves what it started with).
    loaded_version: PolicyVersion | None
    #: Requests sent to it, and of those the ones that failed with it (taken out under them).
    requests: int
    failures: int
    #: Times it was taken out and taken back in.
    taken_out: int
    taken_in: int


@attrs.frozen
class FleetEvent:
    """Something that happened to a server: ``out`` (taken out), ``loaded`` (loaded weights
    ``version``), ``in`` (taken back in), ``refused`` (answers, but serves other models than
    the fleet: it stays out). ``at`` is ``trio.current_time()``."""

    at: float
    url: str
    kind: Literal["out", "loaded", "in", "refused"]
    version: PolicyVersion | None
    detail: str = ""
