"""An incremental chain's compaction as a job with an owner: the thread that runs one (one at
a time, joined by `Compaction.close` within a deadline) and its failures, retried and then
reported to the caller (never only logged)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from ._checkpoint_format import _CompactionStoppedError
from ._errors import CheckpointCompactionError

logger = logging.getLogger("trio_rl.sink")

#: Compactions failed in a row after which the write that sees the last one raises.
COMPACTION_ATTEMPTS = 3


class Compaction:
    """The compaction of a `CheckpointChain`: at most one runs, in the writing thread or in a
    thread this object owns. A failure is counted (a success resets the count) and kept
    until it is reported: by `check` once it failed ``COMPACTION_ATTEMPTS`` times in a row,
    by `wait` and `close` at once."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock  # the chain's: guards the counts, as the files they are about
        self.thread: threading.Thread | None = None
        #: The delta the running (or last) compaction rewrites.
        self.path: Path | None = None
        #: Set by `close`: the running compaction stops at its next record.
        self.abort = threading.Event()
        self.failures = 0
        self.failed: tuple[Path, Exception] | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, path: Path, job: Callable[[], None], *, background: bool) -> None:
        """Run ``job`` (the rewrite of ``path``), in a thread of its own if ``background``."""
        self.path = path
        if not background:
            self._run(path, job)
            return
        # A daemon only so that a write hung on a stalled disk, which `close` then raises,
        # cannot hold the interpreter's exit; otherwise `close` joins it.
        self.thread = threading.Thread(
            target=self._run, args=(path, job), name="trio-rl checkpoint compaction", daemon=True
        )
        self.thread.start()

    def _run(self, path: Path, job: Callable[[], None]) -> None:
        try:
            job()
        except _CompactionStoppedError:
            pass
        except Exception as exc:
            with self.lock:
                self.failures += 1
                self.failed = (path, exc)
                n = self.failures
            logger.warning(
                "checkpoint compaction of %s failed (%d in a row; the deltas stay valid, it is "
                "retried at the next write): %s",
                path,
                n,
                exc,
            )
        else:
            with self.lock:
                self.failures, self.failed = 0, None

    def check(self) -> None:
        """After a write: raise the failure once compaction failed ``COMPACTION_ATTEMPTS``
        times in a row (the count then starts over)."""
        if self.failures >= COMPACTION_ATTEMPTS:
            self.raise_failure(f"failed {self.failures} times in a row, at every write")

    def raise_failure(self, how: str) -> None:
        """Raise the failure not reported yet (if any) as one `CheckpointCompactionError`
        naming the delta, chained to the cause; it is then reported, and the count of
        failures in a row starts over."""
        with self.lock:
            failed, self.failed, self.failures = self.failed, None, 0
        if failed is None:
            return
        path, exc = failed
        raise CheckpointCompactionError(
            str(path),
            f"compacting this delta into a full file {how} (last: {exc}); the deltas stay "
            "valid: every checkpoint written is still readable, only the chain is longer",
        ) from exc

    def close(self, timeout: float) -> None:
        """Blocking: stop a running compaction and join its thread, at most ``timeout``
        seconds; a thread still running then (a hung write) raises, and a later `close` joins
        it. Then a failure not reported yet is raised."""
        t = self.thread
        if t is not None:
            self.abort.set()
            t.join(timeout)
            if t.is_alive():
                raise CheckpointCompactionError(
                    str(self.path),
                    f"the compaction did not stop within {timeout:g} s (a stalled write?); "
                    "the deltas it would replace stay valid",
                )
            self.abort.clear()
            self.thread = None
        self.raise_failure("failed")

    def wait(self, timeout: float) -> None:
        """Blocking: wait for a running compaction, at most ``timeout`` seconds (then it
        raises), and raise its failure if it failed."""
        t = self.thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                raise CheckpointCompactionError(
                    str(self.path), f"the compaction did not finish within {timeout:g} s"
                )
        self.raise_failure("failed")
