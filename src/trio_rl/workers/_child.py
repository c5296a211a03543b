"""A worker process of :class:`~trio_rl.workers.WorkerPool`, run as a script by its path.

It imports the standard library only (not the ``trio_rl`` package, nor trio), so a worker
starts in the time the interpreter takes plus the user's own module. The pool owns its
lifetime: SIGINT and SIGTERM are ignored here (a Ctrl-C reaches the whole process group; the
run decides, and kills its workers), and a watcher thread exits the process when the parent
is gone, so even a parent killed with SIGKILL leaves no worker behind, however long the call
in progress would have taken.

Protocol, on two pipes the parent passes as file descriptors (stdout stays the user's): each
message is a 4-byte big-endian length and a pickle. The parent sends ``(sys_path, fn)`` with
``fn`` pickled (by reference: the worker imports its module), then argument tuples; the
worker answers ``("ready",)``, then ``("ok", value)`` or ``("error", line, where)`` per call,
``line`` being the last line of the traceback and ``where`` the innermost frame. End of input
ends the worker.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
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


def main(argv: list[str]) -> int:
    jobs, results, parent = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        sys_path, fn_bytes = _receive(jobs)
    except EOFError:
        return 0
    sys.path[:] = sys_path
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException as exc:  # whatever importing the user's module raised
        _send(results, failure(exc))
        return 1
    _send(results, ("ready",))
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
        except Exception as exc:  # a value pickle cannot carry back
            _send(results, failure(exc))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the parent closed its end while this worker answered: it is gone
        os._exit(0)
