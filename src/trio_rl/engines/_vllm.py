"""A vLLM server as an engine: the admin endpoints, weight reloads and ``n`` samples per request.

Nothing here imports vLLM: the server is another process, reached over HTTP. The admin
endpoints need the server started with ``VLLM_SERVER_DEV_MODE=1``:

- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` reads
  every ``*.safetensors`` file of ``DIR`` (Hugging Face parameter names) into the running model;
- ``POST /reset_prefix_cache`` drops KV blocks computed with the old weights;
- ``GET /health`` answers 200 once the server takes requests.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from .._validation import a_bool, http_urls, non_negative_or_inf, positive_or_inf
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._auth import refused
from ._backoff import retry_delay
from ._batching import PendingRow as _Row
from ._batching import RequestBatcher
from ._errors import (
    EngineAuthError,
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
)
from ._fleet_config import ADMIN_TIMEOUT
from ._openai_answers import parse_completion_chunk, parse_completion_response
from ._protocol import Completion, GenerateRequest
from ._sse import event_json, read_events
from ._waiting import transport_reason, wait_until_up

__all__ = ["VLLMAdmin", "VLLMEngine", "open_vllm_engine"]


def _url(value: str) -> str:
    return value.rstrip("/")


@attrs.define(slots=True, eq=False)
class VLLMAdmin:
    """The admin endpoints of one vLLM server (started with ``VLLM_SERVER_DEV_MODE=1``).

    Use it as ``async with VLLMAdmin(url) as admin:`` (it owns one ``httpx.AsyncClient``); a
    call outside that block raises ``trio.ClosedResourceError``. Every call runs under
    ``trio.fail_after(timeout)``: expiry raises :class:`EngineTimeoutError`, an unreachable
    server :class:`EngineTransportError`, a 4xx :class:`EngineRequestError` (401 and 403:
    :class:`~trio_rl.errors.EngineAuthError`, also from :meth:`healthy`), a 5xx
    :class:`EngineTransportError`; each message names the URL. ``headers`` (e.g. an
    ``Authorization`` header) go with every call and stay out of the repr.
    """

    base_url: str = attrs.field(converter=_url, validator=http_urls)
    timeout: float = attrs.field(default=60.0, validator=positive_or_inf)
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    _client: httpx.AsyncClient | None = attrs.field(init=False, default=None)

    async def __aenter__(self) -> VLLMAdmin:
        """Open the HTTP client (once per admin; `RuntimeError` if already open).

        Cancellation: entering awaits nothing (it is not a checkpoint), so it cannot be
        cancelled: it returns with the client open.
        """
        if self._client is not None:
            raise RuntimeError("VLLMAdmin is already open")
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None), headers=dict(self.headers))
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the HTTP client; later calls raise `trio.ClosedResourceError`.

        Cancellation: the admin is closed first (the client is dropped before anything is
        awaited), so it is closed even if `trio.Cancelled` is raised; the client's own close
        is not shielded, so a cancellation can cut it short and leave connections to be
        dropped rather than closed gracefully.
        """
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        client = self._client
        if client is None:
            raise trio.ClosedResourceError("VLLMAdmin used outside its 'async with' block")
        url = self.base_url + path
        try:
            with trio.fail_after(self.timeout):
                response = await self._send(client, method, url, body)
        except trio.TooSlowError:
            raise EngineTimeoutError(
                f"{method} {url} did not answer within {self.timeout}s"
            ) from None
        if response.status_code >= 500:
            raise EngineTransportError(
                f"{method} {url}: HTTP {response.status_code}: {response.text[:500]}"
            )
        if response.status_code >= 400:
            raise refused(response, f"{method} {url}")
        return response

    @staticmethod
    async def _send(client: httpx.AsyncClient, method: str, url: str, body: Any) -> httpx.Response:
        # One retry on a transport error: uvicorn closes idle keep-alive connections (5 s), and
        # a request racing that close fails without reaching vLLM. Every admin call is
        # idempotent (a reload of the same directory twice loads the same weights).
        for attempt in (1, 2):
            try:
                if body is None:
                    return await client.request(method, url)
                return await client.request(method, url, json=body)
            except httpx.TransportError as exc:
                if attempt == 2:
                    raise EngineTransportError(
                        f"{method} {url}: {type(exc).__name__}: {exc}"
                    ) from exc
        raise AssertionError("unreachable")

    async def healthy(self) -> bool:
        """True if ``GET /health`` answers 200 now; False if the server is not reachable yet.
        A refusal of the credentials (401, 403: a server or proxy that guards ``/health``)
        raises :class:`~trio_rl.errors.EngineAuthError` at once: waiting would not help.

        Cancellation: the request is abandoned.
        """
        return await self.not_healthy() is None

    async def not_healthy(self) -> str | None:
        """Why ``GET /health`` does not answer 200 now (``connection refused``, ``HTTP 503``,
        ...), or None when it does. Cancellation: the request is abandoned."""
        try:
            await self._call("GET", "/health")
        except EngineAuthError:
            raise
        except EngineTransportError as exc:
            return transport_reason(exc)
        except EngineRequestError as exc:
            return f"HTTP {exc.status_code}"
        except EngineTimeoutError:
            return f"no answer within {self.timeout}s"
        return None

    async def wait_healthy(self, within: float, *, poll_interval: float = 0.25) -> None:
        """Poll ``/health`` until it answers 200, backing off from ``poll_interval`` to 2 s;
        the wait is logged at WARNING at once with why the server does not answer (``waiting
        for URL/health (connection refused, 1 attempt), giving up in 590 s``), then every 10 s.
        :class:`EngineTimeoutError` after ``within`` seconds, naming the last reason.
        Cancellation: polling stops."""
        await wait_until_up(
            self.not_healthy,
            f"{self.base_url}/health",
            within,
            first_poll=poll_interval,
            max_poll=max(poll_interval, 2.0),
            goal="answer 200",
        )

    async def models(self) -> list[str]:
        """The ids of the models the server serves (``GET /v1/models``).

        Cancellation: the request is abandoned."""
        response = await self._call("GET", "/v1/models")
        where = f"{self.base_url}/v1/models"
        try:
            data = json.loads(response.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineResponseError(f"{where}: body is not JSON ({exc})") from None
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise EngineResponseError(f"{where}: field 'data' is missing or not a list")
        ids = [e.get("id") for e in entries if isinstance(e, dict)]
        if len(ids) != len(entries) or not all(isinstance(i, str) for i in ids):
            raise EngineResponseError(f"{where}: an entry of 'data' has no string 'id'")
        return [str(i) for i in ids]

    async def collective_rpc(self, method: str, kwargs: Mapping[str, Any]) -> object:
        """``POST /collective_rpc {"method": method, "kwargs": kwargs}``; the ``results`` list of
        the answer (one entry per worker), or None for an empty 200.

        Cancellation: the HTTP request is dropped; the server may still run the call.
        """
        response = await self._call(
            "POST", "/collective_rpc", {"method": method, "kwargs": dict(kwargs)}
        )
        if not response.content:
            return None
        try:
            data = json.loads(response.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineResponseError(
                f"{self.base_url}/collective_rpc ({method}): body is not JSON ({exc})"
            ) from None
        if not isinstance(data, dict) or "results" not in data:
            raise EngineResponseError(
                f"{self.base_url}/collective_rpc ({method}): field 'results' is missing"
            )
        return data["results"]

    async def reload_weights(self, path: str | os.PathLike[str]) -> None:
        """Have the server read the safetensors files of directory ``path`` into its model.

        ``path`` must be readable by the server process (the same filesystem). Cancellation:
        the HTTP request is dropped; the server may still finish the reload.
        """
        await self.collective_rpc("reload_weights", {"weights_path": os.fspath(path)})

    async def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``: no later request reuses KV computed by old weights.

        Cancellation: the HTTP request is dropped."""
        await self._call("POST", "/reset_prefix_cache")


def _seed_runs(rows: list[_Row]) -> list[list[_Row]]:
    """Rows split into runs of consecutive seeds (vLLM gives sample ``i`` of a request with
    ``seed`` s and ``n`` k the seed ``s + i``), so a sample's tokens depend on its own seed only.
    Unseeded rows form one run."""
    unseeded = [r for r in rows if r.request.params.seed is None]
    seeded = sorted(
        (r for r in rows if r.request.params.seed is not None),
        key=lambda r: r.request.params.seed or 0,
    )
    runs: list[list[_Row]] = [unseeded] if unseeded else []
    for r in seeded:
        last = runs[-1] if runs and runs[-1] is not unseeded else None
        if last and (last[-1].request.params.seed or 0) + 1 == r.request.params.seed:
            last.append(r)
        else:
            runs.append([r])
    return runs


@attrs.define(slots=True, eq=False, kw_only=True)
class VLLMEngine:
    """An :class:`~trio_rl.engines.Engine` over one vLLM server that sends the samples of a
    group as one ``/v1/completions`` request with ``n``; open it with :func:`open_vllm_engine`.

    Concurrent requests for the same prompt and sampling settings that arrive within
    ``gather_window`` seconds become one HTTP request per run of consecutive seeds (``seed`` of
    the first, ``n`` the run's length; vLLM seeds choice ``i`` with ``seed + i``). Each request
    runs under ``trio.fail_after(timeout)`` (:class:`EngineTimeoutError`); transport errors and
    5xx answers are retried ``max_attempts`` times in all (after ``backoff``, then twice that,
    ..., each pause jittered between half and all of it), then :class:`EngineTransportError`;
    a 4xx raises :class:`EngineRequestError`, a bad body :class:`EngineResponseError`.

    **Policy version.** A completion reports the version current when its HTTP request was
    sent. :meth:`load_weights` reloads the server (``VLLMAdmin.reload_weights``), resets its
    prefix cache and only then makes ``version`` current, so a request sent after it returns
    runs entirely on the new weights; one in flight during a reload is reported as the older
    version (never fresher than it is).

    **Streaming** (``stream``, default True): the request asks for ``"stream": true`` and
    the answer is read as server-sent events (:func:`~trio_rl.engines._sse.read_events`), each
    chunk's choices parsed by :func:`~trio_rl.engines._openai_answers.parse_completion_chunk` and
    routed to their sample by ``choices[k].index``. A choice that finishes releases its sample
    at once, before its siblings finish. The completions equal the non-streamed ones
    (``stream=False`` posts ``"stream": false`` and reads one JSON body). A malformed event (bad
    JSON, an error object, a bad or missing ``index``, tokens after a choice's finish reason)
    or a stream that ends with a choice unfinished is an :class:`EngineResponseError` naming
    the event, for every unreleased sample of the request; it is not retried. A stream cut
    mid-way is a transport error and is retried, unfinished choices starting afresh.

    **Abort** (:attr:`GenerateRequest.abort`): the sample leaves its request at once and
    returns a completion with finish reason ``abort`` holding exactly the tokens and logprobs
    streamed for its choice so far (a chunk is taken whole or not at all; none when not
    streaming, or before its first chunk), stamped with the request's version; a continuation
    goes on from them. vLLM cannot stop one choice of an ``n`` request, so the siblings keep
    streaming and get their full completions (the server goes on decoding the aborted choice
    too, unread); once every sample has aborted, been cancelled or been released the request is
    closed, which makes vLLM abort it.

    **Cancellation.** A cancelled caller's sample leaves its request the same way, with no
    completion (``trio.Cancelled`` propagates); a request whose samples are all gone is closed
    (vLLM aborts it), and leaving :func:`open_vllm_engine` closes every request.
    """

    base_url: str = attrs.field(converter=_url, validator=http_urls, kw_only=False)
    model: str = "default"
    timeout: float = attrs.field(default=600.0, validator=positive_or_inf)
    admin_timeout: float = attrs.field(default=ADMIN_TIMEOUT, validator=positive_or_inf)
    gather_window: float = attrs.field(default=0.002, validator=non_negative_or_inf)
    max_n: int = attrs.field(default=64, validator=positive_or_inf)
    max_attempts: int = attrs.field(default=3, validator=positive_or_inf)
    backoff: float = attrs.field(default=0.25, validator=non_negative_or_inf)
    #: Ask for a streamed answer (server-sent events, one chunk per choice and step), so that
    #: an abort keeps the tokens generated so far; False posts ``"stream": false``.
    stream: bool = attrs.field(default=True, validator=a_bool)
    #: Merged into every request body.
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
    #: The header that carries the requests' routing key (see
    #: :attr:`~trio_rl.engines.GenerateRequest.routing_key`), as SGLang's router reads it
    #: (None: not sent). An ``n`` request sends its first sample's key: under group-sticky
    #: routing every sample of a group has the same one.
    routing_header: str | None = "X-SMG-Routing-Key"
    #: Sent with every request and admin call (e.g. ``{"Authorization": "Bearer ..."}``); kept
    #: out of the repr, as values may be secret.
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    _client: httpx.AsyncClient | None = attrs.field(init=False, default=None)
    _admin: VLLMAdmin | None = attrs.field(init=False, default=None)
    _batcher: RequestBatcher = attrs.field(init=False)
    #: The policy-version cell this engine stamps; pass the pipeline's to share it.
    version: PolicyVersionCell = attrs.field(factory=PolicyVersionCell)
    _counts: dict[str, int] = attrs.field(
        init=False,
        factory=lambda: {"requests": 0, "http_requests": 0, "tokens": 0, "weight_loads": 0},
    )

    @_batcher.default
    def _make_batcher(self) -> RequestBatcher:
        return RequestBatcher(
            "VLLMEngine",
            self._run_rows,
            lambda: self.version.value,
            window=self.gather_window,
            max_rows=self.max_n,
            abort_waits=False,
        )

    @property
    def policy_version(self) -> PolicyVersion:
        return self.version.value

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Make ``version`` current without a reload (e.g. the server started on it)."""
        self.version.advance(version)

    @property
    def admin(self) -> VLLMAdmin:
        if self._admin is None:
            raise trio.ClosedResourceError("VLLMEngine used outside open_vllm_engine()")
        return self._admin

    def statistics(self) -> dict[str, int]:
        """Counters since opening: samples requested, HTTP requests, tokens, weight loads."""
        return dict(self._counts)

    def count(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name`` of :meth:`statistics`."""
        self._counts[name] += amount

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        """Reload the server from the safetensors directory ``path`` as policy ``version``.

        Raises the admin client's :class:`EngineError` (naming the URL) if the server refuses
        or fails, and ``ValueError`` if ``version`` goes back. Cancellation: the version stays
        where it was (the server may have read the new weights already).
        """
        self.version.check(version)
        await self.admin.reload_weights(path)
        await self.admin.reset_prefix_cache()
        self.version.advance(version)
        self._counts["weight_loads"] += 1

    async def generate(self, request: GenerateRequest) -> Completion:
        """One completion; see the class docstring for batching, errors, abort and
        cancellation (the sample is dropped and `trio.Cancelled` propagates)."""
        if self._batcher.nursery is None:
            raise trio.ClosedResourceError("VLLMEngine used outside open_vllm_engine()")
        if not request.prompt_tokens:
            raise EngineError(f"request {request.request_id!r}: empty prompt")
        self._counts["requests"] += 1
        return await self._batcher.submit(request)

    async def _run_rows(self, rows: list[_Row]) -> None:
        async with trio.open_nursery() as nursery:
            for run in _seed_runs(rows):
                nursery.start_soon(self._run_request, run)

    async def _run_request(self, rows: list[_Row]) -> None:
        client = self._client
        first = rows[0].request
        p = first.params
        rid = first.request_id or uuid.uuid4().hex
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(first.prompt_tokens),
            "n": len(rows),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stream": self.stream,
            **({"seed": p.seed} if p.seed is not None else {}),
            **self.extra_body,
        }
        url = self.base_url + "/v1/completions"
        try:
            if client is None:
                raise trio.ClosedResourceError("VLLMEngine used outside open_vllm_engine()")
            headers = {"X-Request-Id": rid}
            if first.routing_key is not None and self.routing_header is not None:
                headers[self.routing_header] = first.routing_key
            request = _NRequest(self, client, rows, body, rid, url, self.version.value, headers)
            await request.run()
        except (EngineError, trio.ClosedResourceError) as exc:
            for r in rows:
                if r.completion is None:
                    r.error = exc


@attrs.define(slots=True, eq=False)
class _NRequest:
    """One ``/v1/completions`` request of ``engine`` with ``n = len(rows)``: choice ``i``
    fills ``rows[i]`` (its ``completion``; streamed, also its ``tokens`` and ``logprobs`` so
    far). Every row is stamped ``version``. :meth:`run` owns the deadline and the retries."""

    engine: VLLMEngine
    client: httpx.AsyncClient
    rows: list[_Row]
    body: dict[str, Any]
    rid: str
    url: str
    version: PolicyVersion
    #: The request id and, with a routing key, the routing header.
    headers: dict[str, str]
    #: whether each choice has streamed its finish reason in the current attempt
    _finished: list[bool] = attrs.field(init=False, factory=list)
    #: cancelled to stop reading once no sample wants more (see :meth:`_take`)
    _reading: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)

    @property
    def where(self) -> str:
        return f"{self.url} (request {self.rid!r}, n={len(self.rows)})"

    async def run(self) -> None:
        """Post the request and fill the rows, retrying transport errors and 5xx answers
        (``max_attempts`` in all, then :class:`EngineTransportError`), all under
        ``trio.fail_after(timeout)`` (:class:`EngineTimeoutError`). A retry starts every
        unfinished choice afresh (their streamed tokens are discarded); a row already
        released keeps its completion. Cancellation: the response is closed (vLLM aborts the
        request on disconnect) and ``Cancelled`` propagates."""
        e = self.engine
        failures: list[str] = []
        for r in self.rows:
            r.version = self.version
        try:
            with trio.fail_after(e.timeout):
                for attempt in range(e.max_attempts):
                    if attempt:
                        await trio.sleep(retry_delay(attempt, e.backoff))
                    e.count("http_requests")
                    self._reset()
                    try:
                        failure = await (self._streamed() if e.stream else self._posted())
                    except httpx.TransportError as exc:
                        failure = f"{type(exc).__name__}: {exc}"
                    if failure is None:
                        return
                    failures.append(failure)
        except trio.TooSlowError:
            raise EngineTimeoutError(f"{self.where} did not finish within {e.timeout}s") from None
        raise EngineTransportError(
            f"{self.where} failed after {e.max_attempts} attempts: " + "; ".join(failures)
        )

    def _reset(self) -> None:
        self._finished = [False] * len(self.rows)
        for r in self.rows:
            if r.completion is None:
                r.tokens, r.logprobs = [], []

    def _refused(self, response: httpx.Response) -> EngineRequestError:
        return refused(response, self.where)

    def _complete(self, row: _Row, tokens: list[int], logprobs: list[float], finish: Any) -> None:
        """Release ``row`` with its completion at once (its siblings may still be running)."""
        row.completion = Completion(tokens, logprobs, finish, self.version)
        row.done.set()
        self.engine.count("tokens", len(tokens))

    async def _posted(self) -> str | None:
        """One non-streamed attempt: None once every row is filled, else why to retry."""
        response = await self.client.post(self.url, json=self.body, headers=self.headers)
        if response.status_code >= 500:
            return f"HTTP {response.status_code}"
        if response.status_code >= 400:
            raise self._refused(response)
        where, n = self.where, len(self.rows)
        try:
            data = json.loads(response.content)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EngineResponseError(f"{where}: body is not valid JSON ({exc})") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else choices
            raise EngineResponseError(f"{where}: expected {n} choices, got {got!r}")
        ordered: list[Any] = [None] * n
        for i, choice in enumerate(choices):
            index = choice.get("index", i) if isinstance(choice, dict) else i
            if not _is_index(index, n) or ordered[index]:
                raise EngineResponseError(
                    f"{where}: field 'choices[{i}].index' = {index!r} is out of range or repeated"
                )
            ordered[index] = choice
        parsed = [
            parse_completion_response({"choices": [c]}, where=f"{where} choice {i}")
            for i, c in enumerate(ordered)
        ]
        for r, (tokens, logprobs, finish) in zip(self.rows, parsed, strict=True):
            if r.completion is None and not r.abandoned:
                self._complete(r, tokens, logprobs, finish)
        return None

    async def _streamed(self) -> str | None:
        """One streamed attempt: None once every row is filled, else why to retry. Each
        chunk lands in its choice's row at once, so an abort finds it there; a choice that
        finishes releases its row at once; leaving the ``stream`` block closes the response
        (also when reading stops because no row wants more)."""
        async with self.client.stream(
            "POST", self.url, json=self.body, headers=self.headers
        ) as resp:
            if resp.status_code >= 500:
                return f"HTTP {resp.status_code}"
            if resp.status_code >= 400:
                await resp.aread()
                raise self._refused(resp)
            with trio.CancelScope() as self._reading:
                await read_events(resp, self._take)
        unfinished = [i for i, r in enumerate(self.rows) if r.completion is None]
        unfinished = [i for i in unfinished if not self.rows[i].abandoned]
        if unfinished:
            raise EngineResponseError(
                f"{self.where}: the stream ended without a finish reason for choices {unfinished}"
            )
        return None

    def _take(self, payload: str, event: int) -> None:
        """One server-sent event: every choice it carries is checked, then taken whole."""
        where, n = f"{self.where}, event {event}", len(self.rows)
        data = event_json(payload, where)
        parse_completion_chunk(data, where=where)  # an error event, no 'choices' list
        parsed = []
        for k, choice in enumerate(data["choices"]):
            tokens, logprobs, finish = parse_completion_chunk(
                {"choices": [choice]}, where=f"{where}, choices[{k}]"
            )
            index = choice.get("index", 0 if n == 1 else None)
            if not _is_index(index, n):
                raise EngineResponseError(
                    f"{where}: field 'choices[{k}].index' = {index!r} is missing or not in "
                    f"0..{n - 1}"
                )
            if self._finished[index]:
                raise EngineResponseError(f"{where}: choice {index} goes on after its finish")
            self._finished[index] = finish is not None
            parsed.append((index, tokens, logprobs, finish))
        for index, tokens, logprobs, finish in parsed:
            r = self.rows[index]
            if r.completion is not None or r.abandoned:
                continue  # released or left: nothing more goes in
            r.tokens += tokens
            r.logprobs += logprobs
            if finish is not None:
                self._complete(r, r.tokens, r.logprobs, finish)
        rows = self.rows
        if all(r.completion or r.abandoned for r in rows) and any(r.abandoned for r in rows):
            # the last sibling of an aborted sample is released: the server still decodes the
            # aborted choice for no one, so close the request now (the batcher closes it when
            # the last to go is an abort or a cancellation)
            self._reading.cancel()


def _is_index(value: object, n: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n


@asynccontextmanager
async def open_vllm_engine(base_url: str, **kwargs: Any) -> AsyncIterator[VLLMEngine]:
    """Open a :class:`VLLMEngine` on the server at ``base_url`` (keyword arguments as in its
    constructor). Leaving the block cancels every outstanding request (vLLM aborts them on
    disconnect); their callers get ``trio.ClosedResourceError``."""
    engine = VLLMEngine(base_url, **kwargs)
    async with (
        httpx.AsyncClient(
            timeout=httpx.Timeout(None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers=dict(engine.headers),
        ) as client,
        VLLMAdmin(engine.base_url, timeout=engine.admin_timeout, headers=engine.headers) as admin,
        trio.open_nursery() as nursery,
    ):
        engine._client, engine._admin, engine._batcher.nursery = client, admin, nursery
        try:
            yield engine
        finally:
            engine._batcher.nursery = engine._client = engine._admin = None
            nursery.cancel_scope.cancel()
