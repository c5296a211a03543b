"""An engine that talks to vLLM or SGLang over their OpenAI-compatible HTTP API."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import attrs
import httpx
import trio

from .._validation import a_bool, http_urls, non_negative_or_inf, positive_or_inf, url_tuple
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._abort import stop_scope
from ._auth import refused
from ._backoff import retry_delay
from ._errors import (
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
)
from ._openai_answers import (
    _header_version,
    _json_version,
    parse_completion_chunk,
    parse_completion_response,
)
from ._protocol import Completion, FinishReason, GenerateRequest
from ._sse import event_json, read_events

__all__ = ["OpenAICompatibleEngine"]

logger = logging.getLogger("trio_rl.engines")


@attrs.define(slots=True, eq=False)
class _Received:
    """What the current attempt has received: the tokens, logprobs and finish reason streamed
    so far, and the version the server reported (None: none yet). An abort returns it."""

    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    finish: FinishReason | None = None
    server_version: PolicyVersion | None = None
    #: The version current when the attempt was sent (``version_source()`` or the fallback).
    sent_version: PolicyVersion = 0

    def reset(self) -> None:
        self.tokens, self.logprobs, self.finish, self.server_version = [], [], None, None


def _stamp(engine: OpenAICompatibleEngine, received: _Received) -> PolicyVersion:
    """The version read at send when ``version_source`` is set, else what the server
    reported, else the fallback read at send."""
    if engine.version_source is not None or received.server_version is None:
        return received.sent_version
    return received.server_version


async def _post_aborts(
    engine: OpenAICompatibleEngine,
    client: httpx.AsyncClient,
    bases: Sequence[str],
    body: dict[str, Any],
    what: str,
) -> None:
    """Post ``body`` to ``abort_path`` of each of ``bases`` at once, each shielded within
    ``abort_timeout``; a failure is logged and dropped (an abort is best effort). Nothing
    without ``abort_path``."""
    path = engine.abort_path
    if path is None:
        return

    async def post(base: str) -> None:
        with trio.move_on_after(engine.abort_timeout, shield=True) as scope:
            try:
                await client.post(base + path, json=body)
            except httpx.HTTPError as exc:
                logger.warning("abort of %s at %s failed: %s", what, base, exc)
        if scope.cancelled_caught:
            logger.warning("abort of %s at %s timed out", what, base)

    if len(bases) == 1:
        await post(bases[0])
        return
    async with trio.open_nursery() as nursery:
        for base in bases:
            nursery.start_soon(post, base)


def _rendezvous(key: str, urls: tuple[str, ...]) -> str:
    # Highest-random-weight hashing: stable per key, and adding a server moves ~1/n keys.
    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()

    return max(urls, key=weight)


@attrs.define(slots=True, eq=False, kw_only=True)
class OpenAICompatibleEngine:
    """An :class:`~trio_rl.engines.Engine` for vLLM or SGLang servers (``/v1/completions``).

    Use it as ``async with OpenAICompatibleEngine(urls, model=...) as engine:``; the lifetime
    owns one ``httpx.AsyncClient`` and ``generate`` outside it raises
    ``trio.ClosedResourceError``.

    Each call posts the prompt as token ids and asks for token ids and logprobs (``logprobs: 1``,
    ``return_tokens_as_token_ids: true``; see :func:`parse_completion_response` for the accepted
    answers). The request id (``request.request_id``, or a fresh uuid) travels as the
    ``X-Request-Id`` header and, if ``request_id_field`` is set, in the body (SGLang's ``rid``).

    **Streaming** (``stream``, default True): the request asks for ``"stream": true`` and the
    answer is read as server-sent events, one chunk of tokens and logprobs at a time
    (:func:`parse_completion_chunk`), up to ``data: [DONE]``; a stream that ends without a
    finish reason is an :class:`EngineResponseError`. The completion is the same as the
    non-streamed one; streaming is what lets an abort keep the tokens generated so far. With
    ``stream=False`` the engine posts ``"stream": false`` and reads one JSON body.

    **Servers.** A request with a ``routing_key`` always goes to the same server of
    ``base_urls`` (rendezvous hashing, so retries and siblings share a prefix cache); other
    requests go round robin, and a retry moves on to the next server. The key also travels as
    the header ``routing_header`` (``X-SMG-Routing-Key``, what SGLang's router reads, as miles
    sends it), so a router in front of several servers keeps the key's requests together.

    **Deadline and retries.** The whole call, retries included, runs under
    ``trio.fail_after(timeout)``; expiry raises :class:`EngineTimeoutError`. Transport errors
    and 5xx answers are retried up to ``max_attempts`` in all, sleeping ``backoff``, then twice
    that, ... (at most ``max_backoff``) in between, each pause jittered (between half and all
    of it: many clients do not retry a restarted server at the same instant); then
    :class:`EngineTransportError`. A 4xx
    answer raises :class:`EngineRequestError` at once (401 and 403:
    :class:`~trio_rl.errors.EngineAuthError`), a malformed body
    :class:`EngineResponseError`.

    **Policy version**, in this order: ``version_source()`` if given, read when the request
    is sent; the integer JSON field ``version_field`` of the response; the header
    ``version_header``; else the version last set with :meth:`set_policy_version` (0 at first),
    read when the request is sent. The client-side versions are read at send, never when the
    answer arrives: weights that changed while the request ran did not produce its tokens,
    so a completion is never stamped fresher than the weights that generated it (a retry is
    a new request: it reads the version again).

    **Abort** (:attr:`GenerateRequest.abort`): the engine stops reading, closes the response
    (vLLM aborts a request whose client disconnects), posts the server-side abort as on
    cancellation, and returns a completion with finish reason ``abort``. Streaming, it carries
    the tokens and logprobs of every chunk received before the abort (a continuation goes on
    from them; tokens the server decoded after the last chunk read are lost) and the version
    the server reported for them. Not streaming, it carries no tokens: the answer is never
    read, and a continuation starts again from the tokens the sample had before this request.
    A chunk is taken whole or not at all. Tokens received by an attempt that then failed (a
    dropped connection) are discarded with it, since the retry starts the completion afresh.

    **Cancellation.** If the call is cancelled (or times out) while a request is outstanding
    (sent, or its answer being streamed), the response is closed and the engine posts
    ``{"rid": <request id>}`` to ``abort_path`` of that server (SGLang's ``/abort_request``;
    set ``abort_path=None`` for vLLM, which aborts on disconnect) in a shielded scope bounded
    by ``abort_timeout``; errors of that call are logged and dropped.
    Then ``Cancelled`` propagates (an expired deadline raises :class:`EngineTimeoutError`, with
    no partial output).
    """

    base_urls: tuple[str, ...] = attrs.field(
        converter=url_tuple, validator=http_urls, kw_only=False
    )
    model: str = "default"
    timeout: float = attrs.field(default=600.0, validator=positive_or_inf)
    max_attempts: int = attrs.field(default=4, validator=positive_or_inf)
    backoff: float = attrs.field(default=0.25, validator=non_negative_or_inf)
    max_backoff: float = attrs.field(default=8.0, validator=non_negative_or_inf)
    completions_path: str = "/v1/completions"
    #: Ask for a streamed answer (server-sent events), so that an abort keeps the tokens
    #: generated so far; False posts ``"stream": false`` and reads one JSON body.
    stream: bool = attrs.field(default=True, validator=a_bool)
    abort_path: str | None = "/abort_request"
    abort_timeout: float = attrs.field(default=2.0, validator=positive_or_inf)
    request_id_field: str | None = "rid"
    version_field: str | None = "policy_version"
    version_header: str | None = "x-policy-version"
    version_source: Callable[[], PolicyVersion] | None = None
    #: Merged into every request body (e.g. ``{"skip_special_tokens": False}``).
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
    #: Sent with every request (e.g. ``{"Authorization": "Bearer ..."}``); kept out of the repr,
    #: as values may be secret. A 401 or 403 answer raises :class:`EngineAuthError`.
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    #: httpx connection-pool size; None means unbounded.
    max_connections: int | None = None
    #: Seconds an idle pooled connection is kept for reuse. Below the servers' own idle limit
    #: (uvicorn closes after 5 s), so the pool drops a connection before the server does;
    #: at the same limit a request races the server's close on every connection in the pool.
    keepalive_expiry: float = attrs.field(default=2.0, validator=non_negative_or_inf)
    #: The header that carries :attr:`GenerateRequest.routing_key` (None: not sent).
    routing_header: str | None = "X-SMG-Routing-Key"

    _client: httpx.AsyncClient | None = attrs.field(init=False, default=None)
    _round_robin: int = attrs.field(init=False, default=0)
    #: The policy-version cell this engine stamps; pass the pipeline's to share it.
    version: PolicyVersionCell = attrs.field(factory=PolicyVersionCell)

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("OpenAICompatibleEngine is already open")
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None),  # trio deadlines bound every call instead
            limits=httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=None,
                keepalive_expiry=self.keepalive_expiry,
            ),
            headers=dict(self.headers),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (idempotent).

        Cancellation: the client is released even if `trio.Cancelled` is raised.
        """
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def policy_version(self) -> PolicyVersion:
        """The fallback version, used when the server reports none."""
        return self.version.value

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Set the fallback version (e.g. after pushing new weights). It never goes back."""
        self.version.advance(version)

    def server_for(self, routing_key: str | None) -> str:
        """The server a request goes to: fixed per routing key, else the next in turn."""
        if routing_key is not None:
            return _rendezvous(routing_key, self.base_urls)
        url = self.base_urls[self._round_robin % len(self.base_urls)]
        self._round_robin += 1
        return url

    def _body(self, request: GenerateRequest, rid: str) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_tokens),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stream": self.stream,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if self.request_id_field is not None:
            body[self.request_id_field] = rid
        body.update(self.extra_body)
        return body

    async def generate(self, request: GenerateRequest) -> Completion:
        """One completion from one of the servers; see the class docstring for errors,
        retries, abort (the tokens streamed so far) and cancellation (an engine-side abort,
        then ``trio.Cancelled`` propagates)."""
        client = self._client
        if client is None:
            raise trio.ClosedResourceError(
                "OpenAICompatibleEngine used outside its 'async with' block"
            )
        rid = request.request_id or uuid.uuid4().hex
        body = self._body(request, rid)
        received = _Received(sent_version=self._version_now())
        completion: Completion | None = None
        with stop_scope(request.abort):
            try:
                with trio.fail_after(self.timeout):
                    completion = await self._with_retries(client, request, rid, body, received)
            except trio.TooSlowError:
                raise EngineTimeoutError(
                    f"request {rid!r} did not finish within {self.timeout}s"
                ) from None
        if completion is not None:
            return completion
        # aborted: the response was closed and the server-side abort posted on the way out of
        # the attempt; return what the stream delivered (nothing when not streaming)
        return Completion(
            tokens=received.tokens,
            logprobs=received.logprobs,
            finish_reason="abort",
            policy_version=_stamp(self, received),
        )

    async def _with_retries(
        self,
        client: httpx.AsyncClient,
        request: GenerateRequest,
        rid: str,
        body: dict[str, Any],
        received: _Received,
    ) -> Completion:
        failures: list[str] = []
        base = self.server_for(request.routing_key)
        headers = {"X-Request-Id": rid}
        if request.routing_key is not None and self.routing_header is not None:
            headers[self.routing_header] = request.routing_key
        exchange = _Exchange(self, headers)
        for attempt in range(self.max_attempts):
            if attempt:
                await trio.sleep(retry_delay(attempt, self.backoff, self.max_backoff))
                if request.routing_key is None:
                    base = self.server_for(None)
            try:
                outcome = await exchange.attempt(client, base, rid, body, received)
            except trio.Cancelled:
                await self._abort(client, base, rid)
                raise
            if isinstance(outcome, Completion):
                return outcome
            received.reset()  # a failed attempt's tokens go with it: the retry starts afresh
            failures.append(outcome)
        raise EngineTransportError(
            f"request {rid!r} failed after {self.max_attempts} attempts: " + "; ".join(failures)
        )

    async def _abort(self, client: httpx.AsyncClient, base: str, rid: str) -> None:
        await _post_aborts(self, client, [base], {"rid": rid}, f"request {rid!r}")

    async def abort_all(self) -> None:
        """Abort every request running on every server (miles' ``abort_all``): post
        ``{"abort_all": true}`` to ``abort_path`` of each server at once (SGLang: every request
        there ends with finish reason ``abort``, other clients' too). Without ``abort_path``
        (vLLM) nothing is posted: cancelling a request disconnects it, which aborts it. Each
        post is shielded, within ``abort_timeout``; failures are logged and dropped."""
        if self._client is None:
            raise trio.ClosedResourceError("OpenAICompatibleEngine used outside 'async with'")
        await _post_aborts(self, self._client, self.base_urls, {"abort_all": True}, "all")

    def _version_now(self) -> PolicyVersion:
        """The client-side version of a request sent now (``version_source()`` or fallback)."""
        return self.version_source() if self.version_source is not None else self.version.value


@attrs.frozen
class _Exchange:
    """One attempt's request and answer for ``engine``: post it, read the answer (one JSON
    body, or server-sent events chunk by chunk), and build the completion. Retries, deadlines
    and aborts are the engine's."""

    engine: OpenAICompatibleEngine
    #: The request id and, with a routing key, the routing header.
    headers: Mapping[str, str]

    async def attempt(
        self,
        client: httpx.AsyncClient,
        base: str,
        rid: str,
        body: dict[str, Any],
        received: _Received,
    ) -> Completion | str:
        """One attempt on ``base``: the completion, or why it may be retried. A request
        that never got an answer because its pooled connection was gone (a server closes an
        idle keep-alive connection, uvicorn after 5 s, and a request racing that close fails
        before the server saw it) is sent once more at once, to the same server: that is no
        failure of the server. Were the server gone, the second try fails to connect."""
        outcome = await self._once(client, base, rid, body, received)
        if isinstance(outcome, _Unanswered):
            logger.debug("%s; sending it again on a new connection", outcome)
            # a client of its own: the pool could hand the resend another idle connection the
            # server closed too, and the server would be blamed for it
            async with httpx.AsyncClient(
                timeout=client.timeout,
                limits=httpx.Limits(max_keepalive_connections=0),
                headers=client.headers,
            ) as fresh:
                outcome = await self._once(fresh, base, rid, body, received)
        return outcome

    async def _once(
        self,
        client: httpx.AsyncClient,
        base: str,
        rid: str,
        body: dict[str, Any],
        received: _Received,
    ) -> Completion | str:
        received.reset()
        received.sent_version = self.engine._version_now()
        if self.engine.stream:
            return await self.streamed(client, base, rid, body, received)
        return await self.posted(client, base, rid, body, received)

    async def posted(
        self,
        client: httpx.AsyncClient,
        base: str,
        rid: str,
        body: dict[str, Any],
        received: _Received,
    ) -> Completion | str:
        """One non-streamed attempt: the completion, or why it may be retried."""
        answered = False
        try:
            async with client.stream(
                "POST", base + self.engine.completions_path, json=body, headers=dict(self.headers)
            ) as response:
                answered = True
                await response.aread()
        except httpx.TransportError as exc:
            return _failure(base, exc, answered)
        if response.status_code >= 500:
            return f"{base}: HTTP {response.status_code}"
        where = f"{base}{self.engine.completions_path} (request {rid!r})"
        if response.status_code >= 400:
            raise _refused(response, where)
        return self._completion(response, where, received)

    async def streamed(
        self,
        client: httpx.AsyncClient,
        base: str,
        rid: str,
        body: dict[str, Any],
        received: _Received,
    ) -> Completion | str:
        """One streamed attempt: the completion, or why it may be retried. Every chunk read
        lands in ``received`` at once, so an abort (a cancellation of this call) finds it
        there; leaving the ``client.stream`` block closes the response."""
        where = f"{base}{self.engine.completions_path} (request {rid!r})"
        answered = False
        try:
            async with client.stream(
                "POST",
                base + self.engine.completions_path,
                json=body,
                headers=dict(self.headers),
            ) as response:
                answered = True
                if response.status_code >= 500:
                    return f"{base}: HTTP {response.status_code}"
                if response.status_code >= 400:
                    await response.aread()
                    raise _refused(response, where)
                received.server_version = _header_version(
                    response.headers, self.engine.version_header, where
                )
                await read_events(
                    response,
                    lambda payload, n: self._chunk(payload, received, f"{where}, event {n}"),
                )
        except httpx.TransportError as exc:
            return _failure(base, exc, answered)
        if received.finish is None:
            raise EngineResponseError(f"{where}: the stream ended without a finish reason")
        return Completion(
            tokens=received.tokens,
            logprobs=received.logprobs,
            finish_reason=received.finish,
            policy_version=_stamp(self.engine, received),
        )

    def _chunk(self, payload: str, received: _Received, where: str) -> None:
        chunk = event_json(payload, where)
        tokens, logprobs, finish = parse_completion_chunk(chunk, where=where)
        version = _json_version(chunk, self.engine.version_field, where)
        # all checks passed: take the chunk whole
        received.tokens += tokens
        received.logprobs += logprobs
        if finish is not None:
            received.finish = finish
        if version is not None:
            received.server_version = version

    def _completion(self, response: httpx.Response, where: str, received: _Received) -> Completion:
        try:
            data = json.loads(response.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineResponseError(
                f"{where}: body is not valid JSON ({exc}); starts with {response.content[:80]!r}"
            ) from None
        tokens, logprobs, finish = parse_completion_response(data, where=where)
        version = _json_version(data, self.engine.version_field, where)
        if version is None:
            version = _header_version(response.headers, self.engine.version_header, where)
        received.server_version = version
        return Completion(
            tokens=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            policy_version=_stamp(self.engine, received),
        )


class _Unanswered(str):
    """Why an attempt failed: its connection broke before any answer (a pooled connection
    the server had closed), so it is sent once more before it counts as an attempt."""


def _failure(base: str, exc: httpx.TransportError, answered: bool) -> str:
    reason = f"{base}: {type(exc).__name__}: {exc}"
    # refused or timed out connecting: the server is not there, no reason to ask again
    broken = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
    return _Unanswered(reason) if broken and not answered else reason


def _refused(response: httpx.Response, where: str) -> EngineRequestError:
    return refused(response, where)
