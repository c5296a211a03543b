"""The worker processes of :class:`~trio_rl.workers.WorkerPool`: a template process, run as a
script by its path, that loads the user's function once and forks a worker per request.

It imports the standard library only (not the ``trio_rl`` package, nor trio), so the template
starts in the time the interpreter takes plus the user's own module, and a worker, forked from
it with the function loaded, in about a millisecond: a call killed at its timeout costs a fork,
not an interpreter's start (tens of milliseconds of CPU) nor the module's import again. The
pool owns their lifetimes: SIGINT and SIGTERM are ignored here (a Ctrl-C reaches the whole
process group; the run decides, and kills its workers), and a watcher thread in each process
exits it when its parent is gone (the template watches the run, a worker its template), so
even a run killed with SIGKILL leaves no worker behind, however long the call in progress
would have taken.

Protocol. The template's control channel is a Unix socket the parent passes as a file
descriptor (stdout stays the user's); each message is a 4-byte big-endian length and a pickle.
The parent sends ``(sys_path, fn)`` with ``fn`` pickled (by reference: the template imports
its module); the template answers ``("ready",)`` or ``("error", line, where)``. Then each
one-byte message ``b"F"`` carries two file descriptors (SCM_RIGHTS): a worker's job pipe (read
end) and result pipe (write end); the template forks a worker on them and answers
``("forked", pid)``, and ``("exited", pid, code)`` once it reaped a worker. A worker reads
argument tuples on its job pipe and answers ``("ok", value)`` or ``("error", line, where)``
per call, ``line`` being the last line of the traceback and ``where`` the innermost frame. End
of input ends a worker, and the template (its workers, already forked, run on).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct(">I")
#: How often the watcher thread checks that the parent is alive.
_PARENT_POLL = 0.5


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


def _send(fd: int, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def failure(exc: BaseException) -> tuple[str, str, str]:
    """``("error", last line of the traceback, innermost frame as file:line in function)``."""
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        where = f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"
    return ("error", line, where)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL)
    os._exit(1)


def _serve(fn: Callable[..., Any], jobs: int, results: int) -> int:
    """A worker's loop: a call per argument tuple, until the end of input."""
    while True:
        try:
            args = _receive(jobs)
        except EOFError:
            return 0
        try:
            reply: tuple[Any, ...] = ("ok", fn(*args))
        except BaseException as exc:  # the user's code: its failure is the call's answer
            reply = failure(exc)
        try:
            _send(results, reply)
        except BrokenPipeError:  # the parent closed its end while this worker answered
            return 0
        except Exception as exc:  # a value pickle cannot carry back
            _send(results, failure(exc))


def _fork_worker(fn: Callable[..., Any], control: socket.socket, wake: tuple[int, int]) -> int:
    """Fork a worker on the two descriptors of the next request; its pid (0: the parent
    closed the control channel)."""
    message, fds, _, _ = socket.recv_fds(control, 1, 2)
    if not message:
        return 0
    jobs, results = fds
    template = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker: never returns into the template's loop
        code = 1
        try:
            control.close()
            for fd in wake:
                os.close(fd)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            threading.Thread(target=_watch_parent, args=(template,), daemon=True).start()
            code = _serve(fn, jobs, results)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(jobs)
    os.close(results)
    return pid


def _reap(fd: int) -> None:
    """Report every worker that exited: ``("exited", pid, code)``."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(fd, ("exited", pid, os.waitstatus_to_exitcode(status)))


def main(argv: list[str]) -> int:
    control_fd, parent = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    control = socket.socket(fileno=control_fd)
    try:
        sys_path, fn_bytes = _receive(control_fd)
    except EOFError:
        return 0
    sys.path[:] = sys_path
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException as exc:  # whatever importing the user's module raised
        _send(control_fd, failure(exc))
        return 1
    # a worker's exit wakes the loop below (through the wake-up pipe), which reaps it
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _send(control_fd, ("ready",))
    while True:
        readable, _, _ = select.select([control_fd, wake[0]], [], [])
        if wake[0] in readable:
            os.read(wake[0], 4096)
            _reap(control_fd)
        if control_fd in readable:
            pid = _fork_worker(fn, control, wake)
            if pid == 0:
                return 0
            _send(control_fd, ("forked", pid))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the parent closed its end while this process answered: it is gone
        os._exit(0)
