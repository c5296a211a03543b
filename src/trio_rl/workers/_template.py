"""The pool's template process (:mod:`._child`): it loads the user's function once and forks
a worker per request, so a worker killed at its timeout is replaced for the cost of a fork.

:func:`start_template` starts one; :meth:`Template.fork` makes a worker (a
:class:`WorkerProcess` and the two pipes to it). A forked worker is the template's child, not
this process's: it is signalled through a pidfd (never a pid that could be reused), and its
exit is what the template reports when it reaps it.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import WorkerStartError

__all__ = ["START_TIMEOUT", "Template", "WorkerProcess", "describe", "start_template"]

logger = logging.getLogger("trio_rl.workers")

_CHILD = Path(__file__).with_name("_child.py")
_HEADER = struct.Struct(">I")
#: Seconds the template process may take to start and import the function's module.
START_TIMEOUT = 120.0
#: Seconds a fork request may take (a fork and a reply: milliseconds).
_FORK_TIMEOUT = 30.0
#: Seconds the template gets to exit on its own at the end of its input before it is killed.
_GRACE = 1.0


def describe(fn: Callable[..., Any]) -> str:
    """``module:qualified name`` of ``fn``, as messages name it."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


@attrs.define(eq=False)
class WorkerProcess:
    """A forked worker process: ``pid``, ``returncode`` once it exited (None while it runs,
    or when its exit was never reported: the template itself gone), :meth:`kill` and
    :meth:`wait`."""

    pid: int
    _pidfd: int | None
    returncode: int | None = None
    _exited: trio.Event = attrs.field(factory=trio.Event)

    @property
    def gone(self) -> bool:
        return self._exited.is_set()

    def kill(self) -> None:
        """SIGKILL, through the pidfd (a no-op once the process is gone)."""
        if self._pidfd is not None and not self._exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def wait(self) -> int | None:
        """Wait until the process exited; its exit code (None if unknown)."""
        await self._exited.wait()
        return self.returncode

    def set_exited(self, code: int | None) -> None:
        self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


@attrs.define(eq=False)
class Template:
    """A running template process and its control socket (see the module docstring)."""

    name: str
    process: trio.Process
    control: trio.socket.SocketType
    _workers: dict[int, WorkerProcess] = attrs.field(factory=dict)
    _buffer: bytearray = attrs.field(factory=bytearray)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _forked: trio.Event = attrs.field(factory=trio.Event)
    _new: WorkerProcess | None = None
    _closed: bool = False

    @property
    def alive(self) -> bool:
        return not self._closed and self.process.returncode is None

    async def _fill(self, n: int) -> None:
        while len(self._buffer) < n:
            chunk = await self.control.recv(max(65536, n - len(self._buffer)))
            if not chunk:
                raise EOFError
            self._buffer += chunk

    async def receive(self) -> tuple[Any, ...]:
        await self._fill(_HEADER.size)
        (size,) = _HEADER.unpack(self._buffer[: _HEADER.size])
        await self._fill(_HEADER.size + size)
        data = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
        del self._buffer[: _HEADER.size + size]
        reply: tuple[Any, ...] = pickle.loads(data)
        return reply

    async def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:
            view = view[await self.control.send(view) :]

    async def read_reports(self) -> None:
        """Dispatch the template's reports (a fork's pid, a worker's exit) until it ends;
        then every worker it still had is killed and counted as gone."""
        try:
            while True:
                report = await self.receive()
                if report[0] == "forked":
                    # registered here, before the next report: its exit may be that one
                    self._new = self._register(int(report[1]))
                    self._forked.set()
                elif report[0] == "exited":
                    worker = self._workers.pop(int(report[1]), None)
                    if worker is not None:
                        worker.set_exited(int(report[2]))
        except (EOFError, OSError, trio.ClosedResourceError):
            pass
        finally:
            self._closed = True
            self._forked.set()  # a fork waiting for its reply fails
            for worker in self._workers.values():
                worker.kill()  # SIGKILL cannot be refused: it is gone
                worker.set_exited(None)
            self._workers.clear()

    async def fork(self) -> tuple[WorkerProcess, int, int]:
        """A new worker: its process, the write end of its job pipe and the read end of its
        result pipe (the caller owns both). Raises :class:`WorkerStartError` when the
        template is gone."""
        async with self._lock:
            job_read, job_write = os.pipe()
            result_read, result_write = os.pipe()
            sent = False
            try:
                if not self.alive:
                    raise WorkerStartError(f"{self.name}: the worker template process is gone")
                self._forked = trio.Event()
                fds = array.array("i", (job_read, result_write))
                with trio.fail_after(_FORK_TIMEOUT):
                    sent = True
                    await self.control.sendmsg(
                        [b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                    )
                    await self._forked.wait()
                worker, self._new = self._new, None
                if worker is None:
                    raise WorkerStartError(f"{self.name}: the worker template process is gone")
            except BaseException:
                if sent:
                    # a reply may still come, and would answer the next request: the pool
                    # starts another template (this worker, its pipes closed, exits)
                    self._closed = True
                os.close(job_write)
                os.close(result_read)
                raise
            finally:
                os.close(job_read)
                os.close(result_write)
        return worker, job_write, result_read

    def _register(self, pid: int) -> WorkerProcess:
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already (and reaped): its exit report follows
            pidfd = None
        worker = self._workers[pid] = WorkerProcess(pid, pidfd)
        return worker

    async def aclose(self) -> None:
        """End the template (end of input; SIGKILL after a grace) and reap it. Workers it
        forked are not waited for here (the pool ends them)."""
        with trio.CancelScope(shield=True):
            with contextlib.suppress(OSError):
                self.control.shutdown(socket.SHUT_WR)
            with trio.move_on_after(_GRACE):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                with trio.move_on_after(5.0):
                    await self.process.wait()
            self.control.close()


async def start_template(name: str, fn: Callable[..., Any], fn_bytes: bytes) -> Template:
    """A template process that has loaded ``fn`` (imported by reference, with the working
    directory and this process's ``sys.path``); :class:`WorkerStartError` if it cannot."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(_CHILD), str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    template = Template(name, process, trio.socket.from_stdlib_socket(ours))
    try:
        cwd = os.getcwd()
        path = sys.path if cwd in sys.path else [cwd, *sys.path]
        with trio.fail_after(START_TIMEOUT):
            await template.send((path, fn_bytes))
            reply = await template.receive()
    except trio.TooSlowError:
        await template.aclose()
        raise WorkerStartError(
            f"{name}: a worker process did not load {describe(fn)} within {START_TIMEOUT:g} s"
        ) from None
    except (EOFError, OSError):
        await template.aclose()
        raise WorkerStartError(
            f"{name}: a worker process exited while starting (exit status "
            f"{template.process.returncode})"
        ) from None
    except BaseException:
        await template.aclose()
        raise
    if reply[0] != "ready":
        await template.aclose()
        _, line, where = reply
        at = f" ({where})" if where else ""
        raise WorkerStartError(
            f"{name}: cannot load {describe(fn)} in a worker process: {line}{at}"
        )
    return template
