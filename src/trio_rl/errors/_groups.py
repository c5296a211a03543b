"""Exception groups at a public ``async with`` boundary: one real failure among the
cancellations it caused is raised as itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

__all__ = ["collapse_single"]


@contextlib.contextmanager
def collapse_single() -> Iterator[None]:
    """At a public ``async with`` boundary: an exception group out of the component's nurseries
    whose leaves are one real failure plus cancellations (the siblings it cancelled) is re-raised
    as that failure, so ``except TransportIOError`` around the block works. Two real failures
    stay a group; a group of cancellations only is left to trio's cancel scopes."""
    try:
        yield
    except BaseExceptionGroup as group:
        real = _real_leaves(group)
        if len(real) != 1:
            raise
        failure = real[0]
    else:
        return
    # Raised outside the handler, so the failure's own cause and context stay as they were.
    raise failure


def _real_leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _real_leaves(e)]
    return [] if isinstance(exc, trio.Cancelled) else [exc]
