"""The inference of a run: a fleet over servers already running, or over vLLM servers this
process launches and stops."""

from __future__ import annotations

import os
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ._auth import bearer_headers, expand_headers
from ._errors import EngineAuthError, EngineConfigError
from ._fleet import EngineFleet, open_engine_fleet

__all__ = ["open_inference"]


@asynccontextmanager
async def open_inference(
    *,
    urls: Sequence[str] = (),
    launch: int = 0,
    model_path: str | os.PathLike[str] | None = None,
    vllm: str = "",
    vllm_args: Sequence[str] = (),
    served_name: str | None = None,
    restarts: int = 3,
    log_dir: str | os.PathLike[str] | None = None,
    api_key: str | None = None,
    api_key_env: str | None = None,
    headers: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> AsyncIterator[EngineFleet]:
    """The inference fleet of a run, as ``[inference]`` describes it (the fields of its
    :class:`InferenceConfig`, ``config.inference.fleet_config()``): the servers at ``urls``,
    already running, or
    ``launch`` vLLM servers serving ``model_path``, started by
    :func:`~trio_rl.engines.launch_vllm_servers` (``vllm`` the command before ``--model``,
    default :data:`~trio_rl.engines.DEFAULT_VLLM`, ``vllm_args`` extra
    arguments, ``log_dir`` their logs, at most ``restarts`` restarts each; a restart takes the
    server out of the fleet at once). Other keyword arguments go to :class:`EngineFleet`
    (``start_timeout`` also bounds each launched server's start). Leaving the block closes the
    fleet, then stops the launched servers (SIGTERM, then SIGKILL, to each process group).

    **Credentials**, resolved here and held in memory only. The API key is ``api_key``, or
    the value of the environment variable named ``api_key_env``; every request and admin call
    of every server sends it as ``Authorization: Bearer``. Launched servers want it on every
    path (without one, a key is drawn for this run). ``headers`` go with every call too, each
    ``${NAME}`` in a value replaced by that environment variable. An unset variable is an
    :class:`EngineConfigError`, and servers that refuse the key at opening an
    :class:`EngineAuthError`, each naming the variable and never its value."""
    from ._launch import launch_vllm_servers

    if bool(urls) == bool(launch):
        raise EngineConfigError(
            "open_inference: give the servers already running (urls) or how many to launch, "
            f"exactly one of them (urls={list(urls)}, launch={launch})"
        )
    key, source = _api_key(api_key, api_key_env)
    sent = expand_headers(headers or {}, where="headers")
    if any(name.lower() == "authorization" for name in sent) and (key is not None or launch):
        raise EngineConfigError(
            "open_inference: an Authorization header and an API key"
            + (" (launched servers want the run's key)" if launch else f" ({source})")
            + ": give one of them"
        )
    if served_name is not None:
        kwargs["model"] = served_name
    if urls:
        kwargs["headers"] = {**sent, **bearer_headers(key)}
        async with _refusal_named(source), open_engine_fleet(urls, **kwargs) as fleet:
            yield fleet
        return
    if model_path is None:
        raise EngineConfigError("open_inference: launching servers needs model_path")
    launch_kwargs: dict[str, Any] = {"args": tuple(vllm_args), "api_key": key}
    if vllm:
        launch_kwargs["executable"] = tuple(shlex.split(vllm))
    if "start_timeout" in kwargs:
        launch_kwargs["start_timeout"] = kwargs["start_timeout"]
    if served_name is not None:
        launch_kwargs["served_name"] = served_name
    async with launch_vllm_servers(
        launch, model_path, log_dir=log_dir, restarts=restarts, **launch_kwargs
    ) as launched:
        kwargs["headers"] = {**sent, **launched.headers}
        async with open_engine_fleet(launched.urls, **kwargs) as fleet:
            launched.on_exit = fleet.take_out
            yield fleet


def _api_key(api_key: str | None, api_key_env: str | None) -> tuple[str | None, str]:
    """The key and where it came from (for messages, which never hold the key)."""
    if api_key is not None and api_key_env is not None:
        raise EngineConfigError("open_inference: give api_key or api_key_env, not both")
    if api_key_env is None:
        return api_key, "the API key given" if api_key else "none (api_key_env is unset)"
    value = os.environ.get(api_key_env, "")
    if not value:
        state = "empty" if api_key_env in os.environ else "not set"
        raise EngineConfigError(
            f"the API key's environment variable {api_key_env} (api_key_env) is {state}"
        )
    return value, f"the API key in the environment variable {api_key_env} (api_key_env)"


@asynccontextmanager
async def _refusal_named(source: str) -> AsyncIterator[None]:
    """An :class:`EngineAuthError` raised inside says whose key was refused."""
    try:
        yield
    except EngineAuthError as exc:
        raise EngineAuthError(
            f"{exc}; the key sent: {source}", status_code=exc.status_code, body=""
        ) from None
