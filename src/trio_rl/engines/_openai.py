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

from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._abort import stop_scope
from ._errors import (
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
)
from ._protocol import Completion, FinishReason, GenerateRequest
from ._validate import http_urls, non_negative, positive

__all__ = ["OpenAICompatibleEngine", "parse_completion_response"]

logger = logging.getLogger("trio_rl.engines")

_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})
_TOKEN_PREFIX = "token_id:"


def _urls(value: str | Sequence[str]) -> tuple[str, ...]:
    urls = (value,) if isinstance(value, str) else tuple(value)
    return tuple(u.rstrip("/") for u in urls)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_completion_response(
    data: object, *, where: str = "response"
) -> tuple[list[int], list[float], FinishReason]:
    """Tokens, logprobs and finish reason of the first choice of a ``/v1/completions`` body.

    Accepted token forms, in this order:

    - ``choices[0].token_ids``: a list of ints (vLLM with ``return_token_ids``);
    - ``choices[0].logprobs.tokens``: strings ``"token_id:<int>"`` (vLLM and SGLang with
      ``return_tokens_as_token_ids``).

    Logprobs come from ``choices[0].logprobs.token_logprobs`` (numbers, one per token). The
    finish reason must be ``stop``, ``length`` or ``abort``. Anything else raises
    :class:`EngineResponseError` naming the field and ``where`` (server and request id).
    """
    if not isinstance(data, dict):
        raise EngineResponseError(f"{where}: body is {type(data).__name__}, not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise EngineResponseError(f"{where}: field 'choices' is missing or not a non-empty list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise EngineResponseError(f"{where}: field 'choices[0]' is not an object")
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise EngineResponseError(
            f"{where}: field 'choices[0].logprobs' is missing (the engine must return logprobs)"
        )

    tokens: list[int]
    token_ids = choice.get("token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list):
            raise EngineResponseError(f"{where}: field 'choices[0].token_ids' is not a list")
        for i, t in enumerate(token_ids):
            if not _is_int(t):
                raise EngineResponseError(
                    f"{where}: field 'choices[0].token_ids[{i}]' = {t!r} is not an int"
                )
        tokens = list(token_ids)
    else:
        strings = lp.get("tokens")
        if not isinstance(strings, list):
            raise EngineResponseError(
                f"{where}: neither 'choices[0].token_ids' nor 'choices[0].logprobs.tokens' "
                "holds token ids (request them with return_tokens_as_token_ids)"
            )
        tokens = []
        for i, s in enumerate(strings):
            if not (isinstance(s, str) and s.startswith(_TOKEN_PREFIX)):
                raise EngineResponseError(
                    f"{where}: field 'choices[0].logprobs.tokens[{i}]' = {s!r} is not of the "
                    "form 'token_id:<int>'"
                )
            try:
                tokens.append(int(s[len(_TOKEN_PREFIX) :]))
            except ValueError:
                raise EngineResponseError(
                    f"{where}: field 'choices[0].logprobs.tokens[{i}]' = {s!r} is not of the "
                    "form 'token_id:<int>'"
                ) from None

    raw_logprobs = lp.get("token_logprobs")
    if not isinstance(raw_logprobs, list):
        raise EngineResponseError(
            f"{where}: field 'choices[0].logprobs.token_logprobs' is missing or not a list"
        )
    for i, v in enumerate(raw_logprobs):
        if not _is_number(v):
            raise EngineResponseError(
                f"{where}: field 'choices[0].logprobs.token_logprobs[{i}]' = {v!r} is not a number"
            )
    logprobs = [float(v) for v in raw_logprobs]
    if len(logprobs) != len(tokens):
        raise EngineResponseError(
            f"{where}: {len(tokens)} tokens but {len(logprobs)} logprobs in 'choices[0]'"
        )

    finish = choice.get("finish_reason")
    if finish not in _FINISH_REASONS:
        raise EngineResponseError(
            f"{where}: field 'choices[0].finish_reason' = {finish!r} is not one of "
            "'stop', 'length', 'abort'"
        )
    reason: FinishReason = finish
    return tokens, logprobs, reason


def _rendezvous(key: str, urls: tuple[str, ...]) -> str:
    # Highest-random-weight hashing: stable per key, and adding a server moves ~1/n keys.
    def weight(url: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()

    return max(urls, key=weight)


@attrs.define(slots=True, eq=False)
class OpenAICompatibleEngine:
    """An :class:`~trio_rl.engines.Engine` for vLLM or SGLang servers (``/v1/completions``).

    Use it as ``async with OpenAICompatibleEngine(urls, model=...) as engine:``; the lifetime
    owns one ``httpx.AsyncClient`` and ``generate`` outside it raises
    ``trio.ClosedResourceError``.

    Each call posts the prompt as token ids and asks for token ids and logprobs (``logprobs: 1``,
    ``return_tokens_as_token_ids: true``; see :func:`parse_completion_response` for the accepted
    answers). The request id (``request.request_id``, or a fresh uuid) travels as the
    ``X-Request-Id`` header and, if ``request_id_field`` is set, in the body (SGLang's ``rid``).

    **Servers.** A request with a ``routing_key`` always goes to the same server of
    ``base_urls`` (rendezvous hashing, so retries and siblings share a prefix cache); other
    requests go round robin, and a retry moves on to the next server.

    **Deadline and retries.** The whole call, retries included, runs under
    ``trio.fail_after(timeout)``; expiry raises :class:`EngineTimeoutError`. Transport errors
    and 5xx answers are retried up to ``max_attempts`` in all, sleeping ``backoff``, then twice
    that, ... (at most ``max_backoff``) in between; then :class:`EngineTransportError`. A 4xx
    answer raises :class:`EngineRequestError` at once, a malformed body
    :class:`EngineResponseError`.

    **Policy version**, in this order: ``version_source()`` if given; the integer JSON field
    ``version_field`` of the response; the header ``version_header``; else the version last set
    with :meth:`set_policy_version` (0 at first).

    **Abort** (:attr:`GenerateRequest.abort`): the request is dropped and aborted server-side
    as on cancellation, and the call returns a completion with no tokens and finish reason
    ``abort``. The non-streaming answer is never read, so the tokens the server generated for
    it are lost (SGLang would return them in the aborted answer, but the connection is closed
    first); a continuation starts again from the tokens the sample had before this request.

    **Cancellation.** If the call is cancelled (or times out) while a request is outstanding,
    the engine posts ``{"rid": <request id>}`` to ``abort_path`` of that server (SGLang's
    ``/abort_request``; set ``abort_path=None`` for vLLM, which aborts on disconnect) in a
    shielded scope bounded by ``abort_timeout``; errors of that call are logged and dropped.
    Then ``Cancelled`` propagates.
    """

    base_urls: tuple[str, ...] = attrs.field(converter=_urls, validator=http_urls)
    model: str = "default"
    timeout: float = attrs.field(default=600.0, validator=positive)
    max_attempts: int = attrs.field(default=4, validator=positive)
    backoff: float = attrs.field(default=0.25, validator=non_negative)
    max_backoff: float = attrs.field(default=8.0, validator=non_negative)
    completions_path: str = "/v1/completions"
    abort_path: str | None = "/abort_request"
    abort_timeout: float = attrs.field(default=2.0, validator=positive)
    request_id_field: str | None = "rid"
    version_field: str | None = "policy_version"
    version_header: str | None = "x-policy-version"
    version_source: Callable[[], PolicyVersion] | None = None
    #: Merged into every request body (e.g. ``{"skip_special_tokens": False}``).
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
    #: Sent with every request (e.g. ``{"Authorization": "Bearer ..."}``).
    headers: Mapping[str, str] = attrs.field(factory=dict)
    #: httpx connection-pool size; None means unbounded.
    max_connections: int | None = None

    _client: httpx.AsyncClient | None = attrs.field(init=False, default=None)
    _round_robin: int = attrs.field(init=False, default=0)
    #: The policy-version cell this engine stamps; pass the pipeline's to share it.
    version: PolicyVersionCell = attrs.field(factory=PolicyVersionCell, kw_only=True)

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("OpenAICompatibleEngine is already open")
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None),  # trio deadlines bound every call instead
            limits=httpx.Limits(
                max_connections=self.max_connections, max_keepalive_connections=None
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
            "stream": False,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if self.request_id_field is not None:
            body[self.request_id_field] = rid
        body.update(self.extra_body)
        return body

    async def generate(self, request: GenerateRequest) -> Completion:
        """One completion from one of the servers; see the class docstring for errors,
        retries and what happens on cancellation (an engine-side abort)."""
        client = self._client
        if client is None:
            raise trio.ClosedResourceError(
                "OpenAICompatibleEngine used outside its 'async with' block"
            )
        rid = request.request_id or uuid.uuid4().hex
        body = self._body(request, rid)
        completion: Completion | None = None
        with stop_scope(request.abort):
            try:
                with trio.fail_after(self.timeout):
                    completion = await self._with_retries(client, request, rid, body)
            except trio.TooSlowError:
                raise EngineTimeoutError(
                    f"request {rid!r} did not finish within {self.timeout}s"
                ) from None
        if completion is not None:
            return completion
        # aborted: the server-side abort was posted on the way out of _post; a non-streaming
        # answer has no partial output to return
        return Completion([], [], "abort", self.version.value)

    async def _with_retries(
        self, client: httpx.AsyncClient, request: GenerateRequest, rid: str, body: dict[str, Any]
    ) -> Completion:
        failures: list[str] = []
        base = self.server_for(request.routing_key)
        for attempt in range(self.max_attempts):
            if attempt:
                await trio.sleep(min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))
                if request.routing_key is None:
                    base = self.server_for(None)
            try:
                response = await self._post(client, base, rid, body)
            except httpx.TransportError as exc:
                failures.append(f"{base}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                failures.append(f"{base}: HTTP {response.status_code}")
                continue
            where = f"{base}{self.completions_path} (request {rid!r})"
            if response.status_code >= 400:
                raise EngineRequestError(
                    f"{where} refused with HTTP {response.status_code}: {response.text[:500]}",
                    status_code=response.status_code,
                    body=response.text[:2000],
                )
            return self._completion(response, where)
        raise EngineTransportError(
            f"request {rid!r} failed after {self.max_attempts} attempts: " + "; ".join(failures)
        )

    async def _post(
        self, client: httpx.AsyncClient, base: str, rid: str, body: dict[str, Any]
    ) -> httpx.Response:
        try:
            return await client.post(
                base + self.completions_path, json=body, headers={"X-Request-Id": rid}
            )
        except trio.Cancelled:
            await self._abort(client, base, rid)
            raise

    async def _abort(self, client: httpx.AsyncClient, base: str, rid: str) -> None:
        if self.abort_path is None:
            return
        with trio.move_on_after(self.abort_timeout, shield=True) as scope:
            try:
                await client.post(base + self.abort_path, json={"rid": rid})
            except httpx.HTTPError as exc:
                logger.warning("abort of request %r at %s failed: %s", rid, base, exc)
        if scope.cancelled_caught:
            logger.warning("abort of request %r at %s timed out", rid, base)

    def _completion(self, response: httpx.Response, where: str) -> Completion:
        try:
            data = json.loads(response.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineResponseError(
                f"{where}: body is not valid JSON ({exc}); starts with {response.content[:80]!r}"
            ) from None
        tokens, logprobs, finish = parse_completion_response(data, where=where)
        return Completion(
            tokens=tokens,
            logprobs=logprobs,
            finish_reason=finish,
            policy_version=self._version_of(data, response, where),
        )

    def _version_of(self, data: dict[str, Any], response: httpx.Response, where: str) -> int:
        if self.version_source is not None:
            return self.version_source()
        if self.version_field is not None and self.version_field in data:
            value = data[self.version_field]
            if not _is_int(value):
                raise EngineResponseError(
                    f"{where}: field {self.version_field!r} = {value!r} is not an int"
                )
            return int(value)
        if self.version_header is not None and self.version_header in response.headers:
            text = response.headers[self.version_header]
            try:
                return int(text)
            except ValueError:
                raise EngineResponseError(
                    f"{where}: header {self.version_header!r} = {text!r} is not an int"
                ) from None
        return self.version.value
