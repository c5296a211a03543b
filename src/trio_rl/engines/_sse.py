"""Server-sent events, as vLLM and SGLang stream a completion: the framing only (which lines
make one event's data, where the stream ends); what a chunk means is the engine's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import trio

from ._errors import EngineResponseError


async def read_events(response: httpx.Response, on_chunk: Callable[[str, int], None]) -> None:
    """Read ``response``'s body to its end, handing each event's data (its ``data:`` lines
    joined) and the event's index to ``on_chunk``; nothing after ``data: [DONE]`` is handed
    over, but the body is still read to the end so the connection can be reused. Other fields
    (``event``, ``id``, ``retry``) and comments are ignored. When ``on_chunk`` raises
    :class:`EngineResponseError` the reading stops at once (:func:`abandon`) and it propagates.

    Cancellation: ``Cancelled`` propagates from the next network read; the caller's ``stream``
    block closes the response."""
    data: list[str] = []
    events = 0
    done = False
    lines = response.aiter_lines()
    try:
        async for line in lines:
            if done:
                continue
            if line:
                name, _, value = line.partition(":")
                if name == "data":
                    data.append(value.removeprefix(" "))
                continue
            if not data:
                continue
            payload, data = "\n".join(data), []
            if payload.strip() == "[DONE]":
                done = True
                continue
            on_chunk(payload, events)
            events += 1
        if data and not done and "\n".join(data).strip() != "[DONE]":
            on_chunk("\n".join(data), events)  # a last event without its closing blank line
    except EngineResponseError:
        await abandon(lines)
        raise


async def abandon(lines: AsyncIterator[str]) -> None:
    """Stop reading a streamed body part-way. Reading on in a cancelled scope makes the next
    network read raise ``Cancelled`` inside httpx's nested async generators, which closes
    every one of them now (instead of leaving them to the garbage collector, which trio
    reports as a ``ResourceWarning``); the scope swallows that cancellation."""
    with trio.CancelScope() as scope:
        scope.cancel()
        async for _ in lines:
            pass


def event_json(payload: str, where: str) -> Any:
    """An event's data as JSON, or :class:`EngineResponseError` naming ``where`` (the request
    and the event's index) and how the data starts."""
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        raise EngineResponseError(
            f"{where}: event data is not valid JSON ({exc}); starts with {payload[:80]!r}"
        ) from None
