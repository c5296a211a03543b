"""Credentials for inference servers: a bearer key, headers whose values come from the
environment, and a refusal of those credentials as :class:`EngineAuthError`.

Secret values live only in memory: in the headers of the engines' HTTP clients and in the
environment of a launched server. Nothing here formats a header's value into a message.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping

import httpx

from ._errors import EngineAuthError, EngineConfigError, EngineRequestError

__all__ = ["bearer_headers", "draw_api_key", "expand_headers", "refused"]

#: The statuses that mean "these credentials are not accepted": no retry, no waiting.
AUTH_STATUSES = frozenset({401, 403})

_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def draw_api_key() -> str:
    """A fresh random key (256 bits, URL-safe text): what a run's launched servers require
    when no key is given. Held in memory only; it dies with the run."""
    return secrets.token_urlsafe(32)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}``, or no header without a key."""
    if api_key is None:
        return {}
    if not api_key or api_key != api_key.strip() or "\n" in api_key:
        # said without the value: it is a secret
        raise EngineConfigError(
            "the API key is empty or has leading/trailing whitespace or a line break"
        )
    return {"Authorization": f"Bearer {api_key}"}


def env_references(value: str) -> list[str]:
    """The names of the environment variables ``value`` references as ``${NAME}``."""
    return _REFERENCE.findall(value)


def expand_headers(
    headers: Mapping[str, str], environ: Mapping[str, str] | None = None, *, where: str = "headers"
) -> dict[str, str]:
    """``headers`` with every ``${NAME}`` in a value replaced by that environment variable
    (``environ``, default ``os.environ``); ``$$`` stands for a literal ``$``. A variable that
    is unset or empty is an :class:`EngineConfigError` naming the header and the variable
    (``where`` says whose headers), never a value."""
    env = os.environ if environ is None else environ
    expanded: dict[str, str] = {}
    for name, value in headers.items():

        def substitute(match: re.Match[str], header: str = name) -> str:
            variable = match.group(1)
            found = env.get(variable, "")
            if not found:
                raise EngineConfigError(
                    f"{where}: header {header!r} references the environment variable "
                    f"{variable}, which is {'empty' if variable in env else 'not set'}"
                )
            return found

        parts = value.split("$$")
        expanded[name] = "$".join(_REFERENCE.sub(substitute, part) for part in parts)
    return expanded


#: Request headers whose values are not secret: everything else the request carried (an
#: ``Authorization``, a proxy's token) is blanked out of an answer quoted in an error.
_PLAIN_HEADERS = frozenset(
    {
        "host",
        "accept",
        "accept-encoding",
        "connection",
        "content-length",
        "content-type",
        "user-agent",
        "x-request-id",
    }
)


def _quoted(response: httpx.Response, limit: int) -> str:
    """The start of the body, with every value of a request header that may be secret
    replaced by ``***`` (a proxy or server may echo the request back)."""
    text = response.text
    try:
        sent = response.request.headers
    except RuntimeError:  # a response built without its request
        return text[:limit]
    for name, value in sent.items():
        if name.lower() not in _PLAIN_HEADERS and value:
            text = text.replace(value, "***")
            _, _, token = value.partition(" ")
            if len(token) >= 8:  # the key alone, without its scheme
                text = text.replace(token, "***")
    return text[:limit]


def refused(response: httpx.Response, where: str) -> EngineRequestError:
    """The error of a 4xx answer: :class:`EngineAuthError` for 401 and 403 (the body is not
    kept), else :class:`EngineRequestError` with the start of the body, the values of the
    request's headers blanked out of it."""
    status = response.status_code
    if status in AUTH_STATUSES:
        return EngineAuthError(
            f"{where} refused the credentials sent (HTTP {status}): a missing or wrong API key",
            status_code=status,
            body="",
        )
    return EngineRequestError(
        f"{where} refused with HTTP {status}: {_quoted(response, 500)}",
        status_code=status,
        body=_quoted(response, 2000),
    )
