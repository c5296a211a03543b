"""Gathering the concurrent requests of a group into one batch (the torch and vLLM engines).

The ``n`` samples of a group arrive as ``n`` requests for the same prompt within a moment of
each other. :class:`RequestBatcher` holds each new request for ``window`` seconds so its
siblings can join, then hands the batch's rows to the engine's ``run_rows`` coroutine, which
fills each row's ``completion`` or ``error``. Cancellation, abort and closing are handled here
once for both engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ..samples import PolicyVersion
from ._abort import stop_scope
from ._protocol import Completion, GenerateRequest

__all__ = ["PendingRow", "RequestBatcher"]


@attrs.define(slots=True, eq=False)
class PendingRow:
    """A request of a batch; the batch's runner fills ``completion`` or ``error`` and the batcher
    sets ``done``. ``abandoned`` is set from the loop when the caller was cancelled (the runner
    drops the row); ``aborted`` when the request's abort signal fired (the runner ends the row
    with what it has, finish reason ``abort``). ``tokens``, ``logprobs`` and ``version`` are what
    a streaming runner has received for the row so far and the version it was sent at: an abort
    that does not wait returns them."""

    request: GenerateRequest
    done: trio.Event = attrs.field(factory=trio.Event)
    abandoned: bool = False
    aborted: bool = False
    completion: Completion | None = None
    error: BaseException | None = None
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    version: PolicyVersion | None = None


def batch_key(request: GenerateRequest) -> tuple[Any, ...]:
    """Requests with equal keys may share a batch: same prompt, same sampling settings."""
    p = request.params
    return (request.prompt_tokens, p.max_tokens, p.temperature, p.top_p)


def length_key(request: GenerateRequest) -> tuple[Any, ...]:
    """Requests with equal keys may share a batch: prompts of the same length (one tensor
    without padding), same sampling settings."""
    p = request.params
    return (len(request.prompt_tokens), p.max_tokens, p.temperature, p.top_p)


@attrs.define(slots=True, eq=False)
class _Batch:
    key: tuple[Any, ...]
    rows: list[PendingRow] = attrs.field(factory=list)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


#: Fills ``completion`` (or ``error``) of each row it is given; it may set a row's ``done`` as
#: soon as its ``completion`` is filled (a streamed choice that finished before its siblings).
RunRows = Callable[[list[PendingRow]], Awaitable[None]]


@attrs.define(slots=True, eq=False)
class RequestBatcher:
    """Gathers requests with the same :func:`batch_key` arriving within ``window`` seconds into
    batches of at most ``max_rows``, and runs each batch with ``run_rows`` in ``nursery``.

    ``abort_waits`` says what an aborted request does: True (torch) marks its row ``aborted``
    and waits for ``run_rows`` to end it with its partial output; False (vLLM) drops the row and
    returns at once an ``abort`` completion of the row's ``tokens`` and ``logprobs`` so far (a
    copy; empty unless the runner streams) stamped with the row's ``version``, else
    ``version()``. A batch whose rows have all been dropped or released early is cancelled (for
    vLLM that closes its HTTP request, which makes the server abort it).
    """

    name: str
    run_rows: RunRows
    version: Callable[[], int]
    window: float
    max_rows: int
    abort_waits: bool
    nursery: trio.Nursery | None = None
    #: which requests may share a batch (:func:`batch_key`: the same prompt)
    key: Callable[[GenerateRequest], tuple[Any, ...]] = batch_key
    _gathering: dict[tuple[Any, ...], _Batch] = attrs.field(init=False, factory=dict)

    async def submit(self, request: GenerateRequest) -> Completion:
        """Queue ``request`` in a batch and wait for its completion.

        Raises ``trio.ClosedResourceError`` when the engine is closed (before or while the
        request runs) and the runner's error otherwise. Abort: see the class docstring.
        Cancellation: the row is dropped (the batch is cancelled once every row is) and
        ``trio.Cancelled`` propagates.
        """
        if self.nursery is None:
            raise trio.ClosedResourceError(f"{self.name} used outside its open() block")
        key = self.key(request)
        batch = self._gathering.get(key)
        if batch is None or len(batch.rows) >= self.max_rows:
            batch = _Batch(key)
            self._gathering[key] = batch
            self.nursery.start_soon(self._run, batch)
        row = PendingRow(request)
        batch.rows.append(row)
        try:
            with stop_scope(request.abort) as stop:
                await row.done.wait()
            if stop.cancelled_caught and not row.done.is_set():
                if not self.abort_waits:
                    self._drop(batch, row)
                    version = self.version() if row.version is None else row.version
                    return Completion(list(row.tokens), list(row.logprobs), "abort", version)
                row.aborted = True
                await row.done.wait()
        except BaseException:
            self._drop(batch, row)
            raise
        if row.error is not None:
            raise row.error
        assert row.completion is not None
        return row.completion

    def _drop(self, batch: _Batch, row: PendingRow) -> None:
        row.abandoned = True
        if all(r.abandoned or r.done.is_set() for r in batch.rows):
            self._forget(batch)  # a later request for the same prompt must not join it
            batch.scope.cancel()

    def _forget(self, batch: _Batch) -> None:
        if self._gathering.get(batch.key) is batch:
            del self._gathering[batch.key]

    async def _run(self, batch: _Batch) -> None:
        try:
            with batch.scope:
                await trio.sleep(self.window)  # let the rest of the group join
                self._forget(batch)
                rows = [r for r in batch.rows if not r.abandoned]
                if rows:
                    await self.run_rows(rows)
        finally:
            self._forget(batch)
            for r in batch.rows:
                if r.error is None and r.completion is None:
                    r.error = trio.ClosedResourceError(f"{self.name} closed before the request ran")
                r.done.set()
