"""The soft stop of partial rollouts: end a generation early and keep what it has."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

__all__ = ["AbortSignal"]


class AbortSignal:
    """A one-way "stop now and return what you have" signal shared by many requests.

    A driver creates one, hands it to every request it may want to stop
    (:attr:`GenerateRequest.abort`), and calls :meth:`set` once. An engine wraps the part of a
    request that waits (for a slot, a decode step, an HTTP answer) in :meth:`scope`: setting
    the signal cancels every open scope, so the wait ends at its next checkpoint and
    ``scope.cancelled_caught`` tells the engine to return its partial output with finish
    reason ``abort`` instead of raising. No task is spawned: a scope is a plain
    ``trio.CancelScope`` registered while it is open. Cancellation from outside is unaffected
    and still propagates as ``trio.Cancelled``.
    """

    __slots__ = ("_scopes", "_set")

    def __init__(self) -> None:
        self._set = False
        self._scopes: set[trio.CancelScope] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Stop every open scope now and every scope opened later (idempotent)."""
        self._set = True
        for scope in self._scopes:
            scope.cancel()

    @contextlib.contextmanager
    def scope(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that this signal cancels; already cancelled if the signal is set."""
        scope = trio.CancelScope()
        if self._set:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)


@contextlib.contextmanager
def stop_scope(signal: AbortSignal | None) -> Iterator[trio.CancelScope]:
    """``signal.scope()``, or a scope nothing cancels when there is no signal."""
    if signal is None:
        with trio.CancelScope() as scope:
            yield scope
    else:
        with signal.scope() as scope:
            yield scope
