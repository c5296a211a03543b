"""The errors engines raise.

Every engine failure is an :class:`EngineError`, so a group runner can tell "the engine gave up
on this sample" from a bug in the caller. Messages name the server, the request id and what was
wrong with the response.
"""

from __future__ import annotations

__all__ = [
    "EngineClosedError",
    "EngineConfigError",
    "EngineError",
    "EngineRequestError",
    "EngineResponseError",
    "EngineTimeoutError",
    "EngineTransportError",
    "SimulatedEngineFailure",
]


class EngineError(Exception):
    """Base class of every error an engine raises for one request."""


class EngineConfigError(EngineError, ValueError):
    """A bad setting, refused when the object is built (not a request failure).

    The message names the class, the field and the bad value, e.g.
    ``SamplingParams.max_tokens must be an int >= 1, got 0``. It is a ``ValueError`` too.
    """


class EngineClosedError(EngineError):
    """The engine was used outside its ``async with`` lifetime."""


class EngineTransportError(EngineError):
    """The server could not be reached or kept failing (connection errors, 5xx) after retries."""


class EngineRequestError(EngineError):
    """The server refused the request (a 4xx status); retrying would not help.

    ``status_code`` is the HTTP status and ``body`` the start of the response body.
    """

    def __init__(self, message: str, *, status_code: int, body: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class EngineResponseError(EngineError):
    """The server answered 2xx but the body is not a usable completion (bad JSON, a missing or
    ill-typed field, tokens and logprobs of different lengths). The message names the field."""


class EngineTimeoutError(EngineError):
    """A request did not finish within its deadline (it was aborted engine-side)."""


class SimulatedEngineFailure(EngineError):
    """A failure injected by :class:`~trio_rl.engines.SimulatedEngine` (``failure_rate``)."""
