"""A failed command as one line on stderr: the real failure inside exception groups, what to
do about it, and an exit status (2 for usage and configuration errors, 1 otherwise)."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import traceback

import trio

from ._jobs import _UsageError
from .config import ConfigError
from .errors import EngineTransportError
from .sink import CheckpointCompactionError, CheckpointError


def _one_failure(exc: BaseException) -> BaseException:
    """The real failure inside (nested) exception groups: the first that is not a
    cancellation caused by it."""
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (leaves or list(exc.exceptions))[0]
    return exc


def _hint(failure: BaseException, message: str, command: str) -> str:
    """What to do about ``failure``, appended to its one line."""
    chain: list[BaseException] = []
    cause: BaseException | None = failure
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if command not in ("run", "simulate"):
        return ""  # inspect, plot: the message is the finding
    if isinstance(failure, CheckpointCompactionError):
        # nothing is damaged: --fresh would throw away a resumable run
        return (
            "; every checkpoint written is readable: fix the cause (disk space, what is in "
            "the way) and run the same command again to resume"
        )
    if isinstance(failure, CheckpointError) and "unusable" in message:
        return "; pass --fresh to move them aside and start over"
    if isinstance(failure, CheckpointError):
        return "; pass --fresh to move the run's checkpoints aside and start over"
    if any(getattr(c, "errno", None) == errno.EADDRINUSE for c in chain) or (
        "Address already in use" in message
    ):
        return "; pick another port (--port, or 0 for a free pair) or stop the process using it"
    if _engine_failure(failure) is not None:
        return "; check the engine's URL and that the server is up"
    if isinstance(failure, PermissionError):
        return "; choose a directory you can write (--out)"
    return ""


def _engine_failure(failure: BaseException) -> EngineTransportError | None:
    """The engine transport error that made the rollout layer give up, if that is why."""
    cause: BaseException | None = failure
    for _ in range(8):
        if cause is None:
            return None
        if isinstance(cause, EngineTransportError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


class FirstFailures(logging.Filter):
    """Pass the first ``limit`` records that carry an exception, then one line saying the
    rest are not shown (an unreachable engine fails every group: the error line says why)."""

    def __init__(self, limit: int = 3) -> None:
        super().__init__()
        self.limit, self.seen = limit, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        self.seen += 1
        if self.seen == self.limit + 1:
            record.msg, record.args, record.exc_info = (
                "further failures are not shown (-v shows every one)",
                None,
                None,
            )
            return True
        return self.seen <= self.limit


class Quiet(logging.Formatter):
    """Log records as one line each: the exception's message without its traceback (``-v``
    keeps tracebacks)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record = logging.makeLogRecord(record.__dict__)
            record.msg = f"{record.getMessage()}: {' '.join(str(exc).split())}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return super().format(record)


def report_failure(args: argparse.Namespace, exc: BaseException) -> int:
    failure = _one_failure(exc)
    if isinstance(failure, KeyboardInterrupt):
        print("trio-rl: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "verbose", False):
        traceback.print_exception(exc)
    message = " ".join(str(failure).split()) or type(failure).__name__
    engine = _engine_failure(failure)
    if engine is not None:  # the cause, not the rollout layer's wrapping of it
        message = "the engine failed every request, e.g. " + " ".join(str(engine).split())
    if isinstance(failure, ConfigError | _UsageError):
        print(f"trio-rl: error: {message}", file=sys.stderr)
        return 2
    hint = _hint(failure, message, str(getattr(args, "command", "")))
    print(f"trio-rl: error: {message}{hint}", file=sys.stderr)
    return 1
