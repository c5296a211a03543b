"""Deferred memory release of shipped batches: empty the containers, then ``malloc_trim(0)``.

Freeing a big shipped batch (hundreds of thousands of Python lists and floats) takes seconds
and holds the GIL the whole time it runs as one ``del``. The release therefore runs in a worker
thread, pops one element at a time (so the event loop gets the GIL back between frees), and
asks glibc to hand freed heap pages back to the OS. At most one release is pending; whoever
schedules the next one, or tears the publisher down, first waits for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable, MutableMapping, MutableSequence, Sequence
from typing import Any, TypeAlias

import attrs
import trio

from ._errors import ReleaseTimeoutError
from ._pacing import Pacer

logger = logging.getLogger("trio_rl.publish")

__all__ = ["Container", "DeferredRelease", "ReleaseFn", "malloc_trim", "release_containers"]

Container: TypeAlias = "MutableSequence[Any] | MutableMapping[Any, Any]"
ReleaseFn: TypeAlias = Callable[[Sequence[Container]], None]


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # absent on musl and other non-glibc libcs
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    fn: Callable[[int], int] = trim
    return fn


_MALLOC_TRIM = _load_malloc_trim()


def malloc_trim() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    Returns whether glibc released any memory (``False`` where the call is unavailable).
    Blocking: call it in a worker thread.
    """
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


def release_containers(containers: Sequence[Container]) -> None:
    """Empty each container element by element, then trim the heap. Run it in a worker thread.

    Popping one element at a time lets the interpreter hand the GIL to the event loop between
    frees; a single ``clear()`` would free everything inside one uninterruptible C call.
    """
    pace = Pacer()
    for container in containers:
        if isinstance(container, MutableSequence):
            while container:
                container.pop()
                pace()
        else:
            while container:
                container.popitem()
                pace()
    malloc_trim()


@attrs.define(eq=False)
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class DeferredRelease:
    """At most one pending release of shipped containers, run in a worker thread.

    ``schedule`` first waits for the previous release (see ``wait``), then starts the new one
    as a task of the given nursery. The worker job always runs exactly once per scheduled
    release: it is started inside a shielded cancel scope and never abandoned, so cancelling
    the nursery or the waiter neither skips nor repeats it (the nursery simply waits for the
    thread to finish before it exits).

    ``wait`` waits under a shielded cancel scope with a ``timeout`` inside the shield; a
    release still running after ``timeout`` seconds raises ``ReleaseTimeoutError`` (the release
    stays pending and is waited for again next time). A release that raised is logged (logger
    ``trio_rl.publish``) and kept in ``errors``; it does not stop later releases.
    """

    limiter: trio.CapacityLimiter
    release: ReleaseFn = release_containers
    timeout: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    _pending: _Pending | None = attrs.field(default=None, init=False)
    scheduled: int = attrs.field(default=0, init=False)
    completed: int = attrs.field(default=0, init=False)
    errors: list[Exception] = attrs.field(factory=list, init=False)

    @property
    def pending(self) -> bool:
        """Whether a scheduled release has not finished yet."""
        return self._pending is not None and not self._pending.done.is_set()

    async def wait(self) -> None:
        """Wait (shielded, at most ``timeout`` seconds) for the pending release, if any.

        On cancellation: the wait is shielded, so it still completes (or times out) first; the
        cancellation is delivered at the caller's next checkpoint.
        """
        pending = self._pending
        if pending is None:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.timeout):
                await pending.done.wait()
        if not pending.done.is_set():
            raise ReleaseTimeoutError(
                f"memory release of a shipped batch still running after {self.timeout:g} s"
            )
        self._pending = None

    async def run_now(self, containers: Sequence[Container]) -> None:
        """Wait for the pending release, then release ``containers`` here, in a worker
        (shielded: it happens exactly once), for when no nursery is left to schedule it in."""
        await self.wait()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.release, containers, limiter=self.limiter)

    async def schedule(self, nursery: trio.Nursery, containers: Sequence[Container]) -> None:
        """Wait for the previous release, then release ``containers`` in a worker thread.

        On cancellation: the wait for the previous release is shielded; once it returns, the new
        release is started without another checkpoint, so it is never skipped or run twice.
        """
        await self.wait()
        pending = _Pending()
        self._pending = pending
        self.scheduled += 1
        nursery.start_soon(self._run, pending, list(containers), name="publish:release")

    async def _run(self, pending: _Pending, containers: list[Container]) -> None:
        try:
            # Shielded: a cancelled nursery must not skip a release that was scheduled (the
            # thread job is short and never abandoned, so the shield cannot hang teardown).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.release, containers, limiter=self.limiter)
        except Exception as exc:  # a failed release must not stop the next one: log, keep
            logger.exception("memory release of a shipped batch failed")
            self.errors.append(exc)
        finally:
            containers.clear()  # our own list of references, not the caller's containers
            self.completed += 1
            pending.done.set()
