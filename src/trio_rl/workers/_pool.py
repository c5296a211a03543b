"""A pool of killable workers for user code: :class:`WorkerPool`, :func:`open_worker_pool`.

A user's function (a reward, a tool) is the least trusted code of a run. In ``"process"``
mode it runs in worker processes of its own, forked from a template process that loaded it
once (:mod:`._template`, :mod:`._child`): a call that overruns the pool's timeout, or is
cancelled, has its process killed and reaped, so a hung call costs that call only (and a
fork to replace its worker), never a capacity token, a thread or the run's stop. In
``"thread"`` mode it runs in trio worker threads under the pool's own limiter: cheaper per
call and no pickling, but a hung call cannot be killed: its thread is abandoned and keeps one
of the pool's tokens until it returns.

The pool lives in an ``async with``: on exit every worker process is ended (idle ones by
closing their input, after a short grace by SIGKILL) and reaped, whichever way the block
ended. A call running longer than ``report_every`` seconds is named in the log at WARNING
every ``report_every`` seconds while it runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import attrs
import trio

from ..errors import (
    InvalidArgumentError,
    WorkerCallError,
    WorkerDiedError,
    WorkerStartError,
    WorkerTimeoutError,
    collapse_single,
)
from ._child import failure
from ._template import Template, WorkerProcess, describe, start_template

__all__ = ["DEFAULT_WORKERS", "WORKER_MODES", "WorkerMode", "WorkerPool", "open_worker_pool"]

logger = logging.getLogger("trio_rl.workers")

WorkerMode = Literal["process", "thread"]
WORKER_MODES: tuple[WorkerMode, ...] = ("process", "thread")

_HEADER = struct.Struct(">I")
#: Worker processes started with the pool; more start only when calls wait (``grow_after``).
FIRST_WORKERS = 2
#: Worker processes starting at a time: many interpreters starting at once on a busy machine
#: each take seconds, and the calls waiting for them with them.
_STARTING_AT_ONCE = 2
#: Calls at a time (worker processes at most): more than a group of samples, so that a group
#: whose record makes the function hang leaves workers to the others.
DEFAULT_WORKERS = 16
#: Seconds an idle worker gets to exit on its own at the pool's close before it is killed.
_GRACE = 1.0
#: Seconds a cancelled call's answer is awaited (in the background) before its worker is
#: killed: a call cancelled with its group (a stale one, say) mostly ends in a moment, and a
#: worker kept saves a start (seconds, for a function whose module imports torch).
_CANCEL_GRACE = 1.0
#: What a worker being started is called in the log while it starts.
_STARTING = "starting a worker process"
#: Seconds to wait for a killed process to be reaped (SIGKILL cannot be refused; this only
#: bounds a wait the kernel could in theory stretch).
_REAP_TIMEOUT = 5.0


@attrs.define(eq=False)
class _Worker:
    """One worker process and the two pipes to it."""

    process: WorkerProcess
    jobs: trio.lowlevel.FdStream
    results: trio.lowlevel.FdStream
    buffer: bytearray = attrs.field(factory=bytearray)

    async def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        await self.jobs.send_all(_HEADER.pack(len(data)) + data)

    async def _fill(self, n: int) -> None:
        while len(self.buffer) < n:
            chunk = await self.results.receive_some(max(65536, n - len(self.buffer)))
            if not chunk:
                raise EOFError
            self.buffer += chunk

    async def receive(self) -> tuple[Any, ...]:
        await self._fill(_HEADER.size)
        (size,) = _HEADER.unpack(self.buffer[: _HEADER.size])
        await self._fill(_HEADER.size + size)
        data = bytes(self.buffer[_HEADER.size : _HEADER.size + size])
        del self.buffer[: _HEADER.size + size]
        reply: tuple[Any, ...] = pickle.loads(data)
        return reply

    async def close(self) -> None:
        """End the process (SIGKILL if it still runs) and reap it; never raises, never
        waits unbounded. Shielded: a worker is never left behind because its owner was
        cancelled."""
        with trio.CancelScope(shield=True):
            for stream in (self.jobs, self.results):
                with contextlib.suppress(OSError, trio.BrokenResourceError):
                    await stream.aclose()
            if self.process.returncode is None:
                self.process.kill()
            with trio.move_on_after(_REAP_TIMEOUT):
                await self.process.wait()
            if self.process.returncode is None:
                logger.warning(
                    "worker process %d did not exit within %.0f s of SIGKILL",
                    self.process.pid,
                    _REAP_TIMEOUT,
                )


def _size(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"WorkerPool.{attribute.name}: {value!r}, expected an int >= 1")


def _positive_or_none(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, int | float) and value > 0):
        raise InvalidArgumentError(
            f"WorkerPool.{attribute.name}: {value!r}, expected seconds > 0 or None"
        )


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0):
        raise InvalidArgumentError(f"WorkerPool.{attribute.name}: {value!r}, expected seconds > 0")


@attrs.define(eq=False)
class WorkerPool:
    """Runs ``fn(*args)`` in killable worker processes (``mode="process"``) or in threads
    under its own limiter (``mode="thread"``), at most ``size`` calls at a time. Process
    mode starts ``FIRST_WORKERS`` processes with the pool and more, up to ``size``, when a
    call waited ``grow_after`` seconds for a busy one, and when calls run longer than
    ``grow_after`` (:attr:`slow`): the pool then keeps ``FIRST_WORKERS`` plus the most calls
    ever slow at once free of slow calls. Fast calls share a few workers; calls that hang
    (a group's samples of a record the function hangs on) make the pool grow around them,
    and the next such burst finds its workers ready.

    In process mode ``fn`` is sent by reference (``module:name``, imported again in the
    template process every worker is forked from, with the working directory and this
    process's ``sys.path``): it must be a module-level function or a picklable object, or
    :class:`~trio_rl.errors.WorkerStartError`
    is raised here, naming it. ``timeout`` (seconds, None: none) bounds one call: an overrun
    raises :class:`~trio_rl.errors.WorkerTimeoutError` after killing the worker. What the
    function raises comes back as :class:`~trio_rl.errors.WorkerCallError`, a process that
    died as :class:`~trio_rl.errors.WorkerDiedError`. Cancellation kills the call's process
    unless it answers within a moment.

    Make one with :func:`open_worker_pool`, which owns its processes (workers start in its
    nursery, in the background: a call waits for whichever worker is free first).
    """

    fn: Callable[..., Any]
    mode: WorkerMode = attrs.field(default="process", validator=attrs.validators.in_(WORKER_MODES))
    size: int = attrs.field(default=DEFAULT_WORKERS, validator=_size)
    timeout: float | None = attrs.field(default=None, validator=_positive_or_none)
    #: Names the pool in messages (``"reward examples.rewards:score"``).
    name: str = "worker"
    #: Seconds between the log lines naming a call still running.
    report_every: float = attrs.field(default=10.0, validator=_positive)
    #: Seconds a call waits for a busy worker before the pool starts another (up to
    #: ``size``): fast calls share the first few workers, calls that hang make it grow.
    grow_after: float = attrs.field(default=0.25, validator=_positive)
    _limiter: trio.CapacityLimiter = attrs.field(init=False)
    _idle: list[_Worker] = attrs.field(init=False, factory=list)
    _freed: trio.lowlevel.ParkingLot = attrs.field(init=False, factory=trio.lowlevel.ParkingLot)
    _workers: set[_Worker] = attrs.field(init=False, factory=set)
    #: The calls in progress: what each is called on, and when it started.
    _running: dict[object, tuple[str, float]] = attrs.field(init=False, factory=dict)
    _fn_bytes: bytes = attrs.field(init=False, default=b"")
    #: Workers being started (not yet in ``_workers``).
    _starting: int = attrs.field(init=False, default=0)
    #: Calls running longer than ``grow_after`` (their workers are out of use for a while).
    _slow: int = attrs.field(init=False, default=0)
    #: The most calls ever slow at once: calls hang together (a group's samples of a record
    #: the function hangs on), so that many workers are kept spare for the next such burst.
    _burst: int = attrs.field(init=False, default=0)
    #: Where workers start; set by :func:`open_worker_pool`.
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    #: The process workers are forked from (started with the first worker).
    _template: Template | None = attrs.field(init=False, default=None)
    _template_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    #: Where the template's reports are read (open until the pool's close is done).
    _reports: trio.Nursery | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._limiter = trio.CapacityLimiter(self.size)
        if self.mode == "process":
            try:
                self._fn_bytes = pickle.dumps(self.fn, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise WorkerStartError(
                    f"{self.name}: {describe(self.fn)} cannot run in a worker process: it "
                    f"must be importable as module:name ({type(exc).__name__}: {exc}); define "
                    "it at the top level of a module, or use the thread mode"
                ) from None

    @property
    def processes(self) -> list[int]:
        """The process ids of the live workers (busy or idle)."""
        return [w.process.pid for w in self._workers if w.process.returncode is None]

    @property
    def slow(self) -> int:
        """Calls running longer than ``grow_after`` seconds (process mode): a call that hangs
        counts here until its timeout kills it."""
        return self._slow

    @property
    def running(self) -> int:
        """Calls in progress (not counting workers being started)."""
        return sum(1 for label, _ in self._running.values() if label != _STARTING)

    async def run(
        self, *args: Any, label: str = "", on_start: Callable[[], None] | None = None
    ) -> Any:
        """``fn(*args)`` in a worker; ``label`` names the call in the log and in errors
        (``record id 'r3'``); ``on_start()`` is called once the call has its worker process
        (not while it waits for one; process mode only)."""
        if self._closed or (self.mode == "process" and self._nursery is None):
            raise trio.ClosedResourceError(
                f"{self.name}: the worker pool is not open (use open_worker_pool)"
            )
        if self.mode == "thread":
            return await _run_in_thread(self, args, label)
        async with self._limiter:
            worker = await self._worker()
            if on_start is not None:
                on_start()
            key = object()
            self._running[key] = (label, trio.current_time())
            try:
                with trio.fail_after(math.inf if self.timeout is None else self.timeout):
                    await worker.send(args)
                    reply = await self._reply(worker)
            except trio.TooSlowError:
                await self._discard(worker, replace=True)
                raise WorkerTimeoutError(
                    f"{self.name} took longer than {self.timeout:g} s on {label or 'a call'}; "
                    "its worker process was killed"
                ) from None
            except (EOFError, trio.BrokenResourceError, OSError):
                await self._discard(worker, replace=True)
                raise WorkerDiedError(
                    f"{self.name}: the worker process ended during the call on "
                    f"{label or 'a call'} (exit status {worker.process.returncode})"
                ) from None
            except BaseException:  # cancelled: the call's process is killed, not abandoned
                self._after_cancel(worker)
                raise
            finally:
                del self._running[key]
            self._idle.append(worker)
            self._freed.unpark()
        return _answer(self.name, reply, label)

    async def _reply(self, worker: _Worker) -> tuple[Any, ...]:
        """The call's reply. A call still running after ``grow_after`` seconds counts as
        slow while it runs: its worker is out of use for a while (a call that hangs, for as
        long as the timeout), so a spare starts for the calls behind it at once instead of
        after they waited (:meth:`_keep_spares`)."""
        with trio.move_on_after(self.grow_after):
            # cancel-safe: what arrived stays in the worker's buffer for the next receive
            return await worker.receive()
        self._slow += 1
        self._burst = max(self._burst, self._slow)
        try:
            self._keep_spares()
            return await worker.receive()
        finally:
            self._slow -= 1

    async def _worker(self) -> _Worker:
        """An idle worker: the first free one. A worker is started (in the background) at
        once while fewer than ``FIRST_WORKERS`` run, and whenever a call waited
        ``grow_after`` seconds without one being freed, up to ``size``."""
        while not self._idle:
            if self._count() < min(self.size, FIRST_WORKERS):
                self._grow()
            with trio.move_on_after(self.grow_after) as waited:
                await self._freed.park()
            if waited.cancelled_caught and not self._idle:
                self._grow()
        return self._idle.pop()

    def _count(self) -> int:
        return len(self._workers) + self._starting

    def _keep_spares(self) -> None:
        """Start workers (in the background, up to ``size``) until ``FIRST_WORKERS`` plus the
        largest burst of slow calls seen are not held by slow calls: a call that hangs takes
        its worker out of use for as long as the timeout, and neither the calls behind it nor
        the next burst of such calls should wait for a worker to start (seconds, on a busy
        machine)."""
        while self._count() - self._slow < min(self.size, FIRST_WORKERS + self._burst):
            before = self._starting
            self._grow()
            if self._starting == before:  # at ``size``, or enough starting already
                return

    def _grow(self) -> None:
        """Start a worker in the background, unless ``size`` run or ``_STARTING_AT_ONCE``
        are starting already (a call still waiting asks again ``grow_after`` later)."""
        if self._closed or self._nursery is None:
            return
        if self._count() < self.size and self._starting < _STARTING_AT_ONCE:
            self._starting += 1
            self._nursery.start_soon(self._start_idle)

    async def _start_idle(self) -> None:
        try:
            worker = await self._start()
        finally:
            self._starting -= 1
        self._idle.append(worker)
        self._freed.unpark()
        self._keep_spares()  # more slow calls than the starts allowed at once

    def _after_cancel(self, worker: _Worker) -> None:
        """A cancelled call's worker: settled in the background (the cancelled caller goes
        on at once), or killed at once when the pool is closing."""
        if self._closed or self._nursery is None:
            worker.process.kill()  # reaped by the pool's close
            return
        self._nursery.start_soon(self._settle, worker)

    async def _settle(self, worker: _Worker) -> None:
        """Keep the worker if the cancelled call answers within ``_CANCEL_GRACE`` seconds,
        else kill it (and start another in its place)."""
        with trio.move_on_after(_CANCEL_GRACE):
            try:
                await worker.receive()
            except (EOFError, trio.BrokenResourceError, OSError):
                pass
            else:
                self._idle.append(worker)
                self._freed.unpark()
                return
        await self._discard(worker, replace=True)

    async def _start(self) -> _Worker:
        template = await _loaded_template(self)
        process, jobs, results = await template.fork()
        worker = _Worker(process, trio.lowlevel.FdStream(jobs), trio.lowlevel.FdStream(results))
        self._workers.add(worker)
        return worker

    async def _discard(self, worker: _Worker, *, replace: bool = False) -> None:
        """End ``worker``; with ``replace``, start another in its place at once (a worker
        killed with its call was one the pool had grown to need: a record whose call hung
        comes back with the next pass over the data)."""
        self._workers.discard(worker)
        if replace:
            self._grow()
        self._freed.unpark()  # a waiting call may start a worker in its place
        await worker.close()


async def _run_in_thread(pool: WorkerPool, args: tuple[Any, ...], label: str) -> Any:
    """A call in thread mode: under the pool's own limiter, abandoned at the timeout."""
    key = object()
    pool._running[key] = (label, trio.current_time())
    try:
        with trio.fail_after(math.inf if pool.timeout is None else pool.timeout):
            reply = await trio.to_thread.run_sync(
                _call_here, pool.fn, args, limiter=pool._limiter, abandon_on_cancel=True
            )
    except trio.TooSlowError:
        raise WorkerTimeoutError(
            f"{pool.name} took longer than {pool.timeout:g} s on {label or 'a call'}; its "
            "thread was abandoned and still holds one of the pool's tokens"
        ) from None
    finally:
        del pool._running[key]
    return _answer(pool.name, reply, label)


def _call_here(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # the user's code: its failure is the call's answer
        return failure(exc)


async def _loaded_template(pool: WorkerPool) -> Template:
    """The template process workers are forked from, started (or started again, if it
    died) with the function loaded; named in ``running`` while it starts."""
    async with pool._template_lock:
        if pool._template is not None and pool._template.alive:
            return pool._template
        if pool._template is not None:
            await pool._template.aclose()
        assert pool._nursery is not None  # workers start in the pool's nursery
        key = object()
        pool._running[key] = (_STARTING, trio.current_time())
        try:
            pool._template = await start_template(pool.name, pool.fn, pool._fn_bytes)
        finally:
            del pool._running[key]
        assert pool._reports is not None
        pool._reports.start_soon(pool._template.read_reports)
        return pool._template


async def _report_stuck(pool: WorkerPool) -> None:
    """Name every call running longer than ``report_every``, every ``report_every`` s."""
    while True:
        await trio.sleep(pool.report_every)
        now = trio.current_time()
        for label, started in list(pool._running.values()):
            if now - started >= pool.report_every:
                logger.warning(
                    "%s: still running on %s after %.0f s%s",
                    pool.name,
                    label or "a call",
                    now - started,
                    "" if pool.timeout is None else f" (the limit is {pool.timeout:g} s)",
                )


async def _close(pool: WorkerPool) -> None:
    """End every worker process and reap it (bounded, shielded)."""
    pool._closed = True
    with trio.CancelScope(shield=True):
        idle, pool._idle = pool._idle, []
        for worker in idle:  # end of input: an idle worker exits by itself
            with contextlib.suppress(OSError, trio.BrokenResourceError):
                await worker.jobs.aclose()
        with trio.move_on_after(_GRACE):
            for worker in idle:
                await worker.process.wait()
        async with trio.open_nursery() as nursery:
            for worker in list(pool._workers):
                nursery.start_soon(pool._discard, worker)
        if pool._template is not None:
            await pool._template.aclose()


def _answer(name: str, reply: tuple[Any, ...], label: str) -> Any:
    """A worker's reply: the value, or the function's failure raised."""
    if reply[0] == "ok":
        return reply[1]
    _, line, where = reply
    at = f" ({where})" if where else ""
    raise WorkerCallError(f"{name} raised {line}{at} on {label or 'a call'}", line, where)


@contextlib.asynccontextmanager
async def open_worker_pool(
    fn: Callable[..., Any],
    *,
    mode: WorkerMode = "process",
    size: int = DEFAULT_WORKERS,
    call_timeout: float | None = None,
    name: str = "worker",
    report_every: float = 10.0,
) -> AsyncIterator[WorkerPool]:
    """A :class:`WorkerPool` for ``fn``; in process mode its first workers start in the
    background at once (a function that does not load in a worker fails the block with
    :class:`~trio_rl.errors.WorkerStartError`). On exit, however the block ended, every worker
    process is ended and reaped. ``call_timeout`` is the pool's ``timeout``."""
    pool = WorkerPool(fn, mode, size, call_timeout, name, report_every)
    # The template's reports (its workers' exits) are read until the pool closed: its close
    # waits for every worker's exit.
    with collapse_single():
        async with trio.open_nursery() as reports:
            pool._reports = reports
            try:
                with collapse_single():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_report_stuck, pool)
                        pool._nursery = nursery
                        if mode == "process":
                            for _ in range(min(size, FIRST_WORKERS)):
                                pool._grow()
                        yield pool
                        nursery.cancel_scope.cancel()
            finally:
                await _close(pool)
                reports.cancel_scope.cancel()
