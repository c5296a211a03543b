"""What every command's job shares: the signal watcher, the start-up signal mask, the run's log.

``trio-rl run`` and ``trio-rl simulate`` stop the same way: the first SIGINT or SIGTERM cancels
the work (which then checkpoints what it holds), a second exits at once (`Stop`,
`stop_on_signals`); a signal that arrives while the command is still importing or reading its
configuration is held back and delivered once the watcher listens (`STARTUP`). A kept run
directory gets its log, ``logs/run.log`` (`RunLog`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .errors import TrioRLError
from .rundir import RunDirectory


@attrs.define
class Stop:
    """What the first SIGINT or SIGTERM cancels (the whole job until the run is open, then
    only the run, which is then checkpointed), and what was received."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Set by the first signal (the learning run watches it instead of a scope).
    event: trio.Event = attrs.field(factory=trio.Event)
    #: Set by the job once a stop has something to checkpoint (its first step began); before,
    #: a signal ends the start at once and the acknowledgement says so.
    started: trio.Event = attrs.field(factory=trio.Event)
    signals: list[int] = attrs.field(factory=list)
    reported: bool = False

    @property
    def status(self) -> int:
        return 128 + self.signals[0]

    def report(self, what: str) -> None:
        name = signal.Signals(self.signals[0]).name
        print(f"trio-rl: stopped by {name} {what}", file=sys.stderr, flush=True)
        self.reported = True


def _stopping(stop: Stop) -> str:
    """What the first signal will do, as the job stands when it arrives."""
    name = signal.Signals(stop.signals[0]).name
    if stop.started.is_set():
        return f"stopping after saving a checkpoint ({name} again exits now)"
    return "stopping now: the run is still starting, there is nothing to checkpoint yet"


async def stop_on_signals(
    stop: Stop, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The first SIGINT or SIGTERM cancels ``stop.scope`` (the run then checkpoints what it
    holds, once ``stop.started`` is set; before, the start just ends); a second one exits at
    once, leaving the last checkpoint as it is."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        STARTUP.release()  # a signal held back during start-up arrives here now
        task_status.started()
        async for signum in received:
            name = signal.Signals(signum).name
            if stop.signals:
                print(f"trio-rl: {name} again: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            stop.signals.append(signum)
            print(f"trio-rl: {name}: {_stopping(stop)}", file=sys.stderr, flush=True)
            stop.scope.cancel()
            stop.event.set()


@attrs.define
class StartupSignals:
    """SIGINT and SIGTERM are blocked (the operating system keeps them pending) from the start
    of the command until the event loop's watcher listens (``stop_on_signals``), which then
    receives a pending one: a signal during imports, configuration or torch's import is never
    lost to a handler swap and stops the command like any later one. The console script's first
    module (``_trio_rl_start``) blocks them before the package imports; ``release`` restores the
    mask the process started with. Commands without an event loop release at once."""

    original: set[int] | None = None

    def hold(self) -> None:
        if self.original is not None:
            return
        before = set(signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}))
        # the launcher blocked them already: what to restore is the mask from before it
        launched: set[int] | None = getattr(
            sys.modules.get("_trio_rl_start"), "ORIGINAL_MASK", None
        )
        self.original = before if launched is None else set(launched)

    def release(self) -> None:
        if self.original is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.original)
            self.original = None


STARTUP = StartupSignals()


def trio_run(fn: Callable[..., Any], *args: Any) -> int:
    # The loop's first task, the signal watcher, releases the held signals once it listens.
    try:
        return int(trio.run(fn, *args))
    finally:
        STARTUP.release()


def resume_command(argv: Sequence[str]) -> str:
    """The command that was run, without ``--fresh`` (which would set the checkpoints aside)."""
    return shlex.join(["trio-rl", *(a for a in argv if a != "--fresh")])


class _UsageError(TrioRLError, ValueError):
    """A bad command line the parser cannot see (e.g. ``--out`` below a regular file): exit 2."""


def check_out(out: Path) -> None:
    """``--out`` must be a directory or creatable as one, and writable: refuse it (a usage
    error, exit 2, naming the option) before anything starts. A directory made to check that is
    removed again, so a run that then fails on its configuration leaves nothing behind."""
    made: Path | None = None
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise _UsageError(
                    f"--out {out}: {path} is a regular file, not a directory; pass a directory"
                )
            break
        made = path
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise _UsageError(
            f"--out {out}: cannot write there ({exc.strerror or exc}); pass a directory you "
            "can write"
        ) from None
    finally:
        if made is not None:  # the directories this check made, innermost first
            for path in (out, *out.parents):
                try:
                    path.rmdir()
                except OSError:
                    break
                if path == made:
                    break


class _LogLines:
    """``sys.stdout`` during a run: what is printed goes to the terminal and, line by line, to
    the run's log (as records of ``trio_rl.console``)."""

    def __init__(self, stream: Any, logger: logging.Logger) -> None:
        self._stream, self._logger, self._part = stream, logger, ""

    def write(self, text: str) -> int:
        self._stream.write(text)
        lines = (self._part + text).split("\n")
        self._part = lines.pop()
        for line in lines:
            if line.strip():
                self._logger.info("%s", line)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RunLog:
    """``RUN_DIR/logs/run.log`` at ``level``: the library's log records, every line the run
    prints and every step's plain line (the fields the terminal shows, as text). The console
    handler keeps its level (warnings; ``-v``: info)."""

    def __init__(self, out: Path, level: str) -> None:
        self.path = RunDirectory(out).run_log
        self.level = getattr(logging, level.upper())
        self.console = logging.getLogger("trio_rl.console")
        self.terminal: Any = sys.stdout
        self._handler: logging.Handler | None = None
        self._saved: tuple[int, list[tuple[logging.Handler, int]]] | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setLevel(self.level)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        # the handlers already there keep what they showed: their level becomes explicit
        self._saved = (root.level, [(h, h.level) for h in root.handlers])
        for h in root.handlers:
            h.setLevel(max(h.level, root.level))
        root.setLevel(min(root.level, self.level))
        root.addHandler(handler)
        # the printed lines go to the log only, not to the console handler a second time
        self.console.propagate = False
        self.console.setLevel(logging.INFO)
        self.console.addHandler(handler)
        self._handler = handler
        self.terminal = sys.stdout
        sys.stdout = _LogLines(sys.stdout, self.console)

    def close(self) -> None:
        if self._handler is None:
            return
        if isinstance(sys.stdout, _LogLines):
            sys.stdout.flush()
            sys.stdout = self.terminal
        root = logging.getLogger()
        root.removeHandler(self._handler)
        self.console.removeHandler(self._handler)
        self.console.propagate = True
        if self._saved is not None:
            level, handlers = self._saved
            root.setLevel(level)
            for h, h_level in handlers:
                h.setLevel(h_level)
        self._handler.close()
        self._handler = None
