"""The soft stop of partial rollouts: end a generation early and keep what it has."""

from __future__ import annotations

from types import TracebackType

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

    def scope(self) -> StopScope:
        """A cancel scope that this signal cancels; already cancelled if the signal is set."""
        return StopScope(self)


class StopScope:
    """``with`` block of :meth:`AbortSignal.scope`: a ``trio.CancelScope`` registered with the
    signal while it is open. ``__exit__`` is typed to swallow (it swallows the signal's own
    cancellation), so type checkers see that code after the block is reachable."""

    __slots__ = ("_scope", "_signal")

    def __init__(self, signal: AbortSignal | None) -> None:
        self._signal = signal
        self._scope = trio.CancelScope()

    def __enter__(self) -> trio.CancelScope:
        signal = self._signal
        if signal is not None:
            if signal._set:
                self._scope.cancel()
            signal._scopes.add(self._scope)
        return self._scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._signal is not None:
            self._signal._scopes.discard(self._scope)
        return bool(self._scope.__exit__(exc_type, exc, tb))


def stop_scope(signal: AbortSignal | None) -> StopScope:
    """``signal.scope()``, or a scope nothing cancels when there is no signal."""
    return StopScope(signal)
