"""The inference of a run: a fleet over servers already running, or over vLLM servers this
process launches and stops."""

from __future__ import annotations

import os
import shlex
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ._errors import EngineConfigError
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
    fleet, then stops the launched servers (SIGTERM, then SIGKILL, to each process group)."""
    from ._launch import launch_vllm_servers

    if bool(urls) == bool(launch):
        raise EngineConfigError(
            "open_inference: give the servers already running (urls) or how many to launch, "
            f"exactly one of them (urls={list(urls)}, launch={launch})"
        )
    if served_name is not None:
        kwargs["model"] = served_name
    if urls:
        async with open_engine_fleet(urls, **kwargs) as fleet:
            yield fleet
        return
    if model_path is None:
        raise EngineConfigError("open_inference: launching servers needs model_path")
    launch_kwargs: dict[str, Any] = {"args": tuple(vllm_args)}
    if vllm:
        launch_kwargs["executable"] = tuple(shlex.split(vllm))
    if "start_timeout" in kwargs:
        launch_kwargs["start_timeout"] = kwargs["start_timeout"]
    if served_name is not None:
        launch_kwargs["served_name"] = served_name
    async with (
        launch_vllm_servers(
            launch, model_path, log_dir=log_dir, restarts=restarts, **launch_kwargs
        ) as launched,
        open_engine_fleet(launched.urls, **kwargs) as fleet,
    ):
        launched.on_exit = fleet.take_out
        yield fleet
