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

from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._batching import PendingRow as _Row
from ._batching import RequestBatcher
from ._errors import (
    EngineError,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
)
from ._openai import parse_completion_response
from ._protocol import Completion, GenerateRequest
from ._validate import http_urls
from ._validate import non_negative as _non_negative
from ._validate import positive as _positive

__all__ = ["VLLMAdmin", "VLLMEngine", "open_vllm_engine"]


def _url(value: str) -> str:
    return value.rstrip("/")


@attrs.define(slots=True, eq=False)
class VLLMAdmin:
    """The admin endpoints of one vLLM server (started with ``VLLM_SERVER_DEV_MODE=1``).

    Use it as ``async with VLLMAdmin(url) as admin:`` (it owns one ``httpx.AsyncClient``); a
    call outside that block raises ``trio.ClosedResourceError``. Every call runs under
    ``trio.fail_after(timeout)``: expiry raises :class:`EngineTimeoutError`, an unreachable
    server :class:`EngineTransportError`, a 4xx :class:`EngineRequestError`, a 5xx
    :class:`EngineTransportError`; each message names the URL.
    """

    base_url: str = attrs.field(converter=_url, validator=http_urls)
    timeout: float = attrs.field(default=60.0, validator=_positive)
    headers: Mapping[str, str] = attrs.field(factory=dict)
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
            raise EngineRequestError(
                f"{method} {url} refused with HTTP {response.status_code}: {response.text[:500]}",
                status_code=response.status_code,
                body=response.text[:2000],
            )
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

        Cancellation: the request is abandoned.
        """
        try:
            await self._call("GET", "/health")
        except (EngineTransportError, EngineRequestError):
            return False
        return True

    async def wait_healthy(self, within: float, *, poll_interval: float = 0.25) -> None:
        """Poll ``/health`` until it answers 200; :class:`EngineTimeoutError` after ``within``
        seconds. Cancellation: polling stops."""
        try:
            with trio.fail_after(within):
                # the server offers no push notification of readiness: polling it is
                while not await self.healthy():  # noqa: ASYNC110
                    await trio.sleep(poll_interval)
        except trio.TooSlowError:
            raise EngineTimeoutError(
                f"{self.base_url}/health did not answer 200 within {within}s"
            ) from None

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
    5xx answers are retried ``max_attempts`` times in all, then :class:`EngineTransportError`;
    a 4xx raises :class:`EngineRequestError`, a bad body :class:`EngineResponseError`.

    **Policy version.** A completion reports the version current when its HTTP request was
    sent. :meth:`load_weights` reloads the server (``VLLMAdmin.reload_weights``), resets its
    prefix cache and only then makes ``version`` current, so a request sent after it returns
    runs entirely on the new weights; one in flight during a reload is reported as the older
    version (never fresher than it is).

    **Abort** (:attr:`GenerateRequest.abort`): the sample is dropped like a cancelled one and
    returns at once with no tokens and finish reason ``abort``: a non-streaming answer carries
    no partial output, so the aborted span is lost and a continuation starts again from the
    tokens the sample had before this request.

    **Cancellation.** A cancelled caller's sample is dropped; when every sample of an HTTP
    request is dropped the request is closed, which makes vLLM abort it.
    """

    base_url: str = attrs.field(converter=_url, validator=http_urls, kw_only=False)
    model: str = "default"
    timeout: float = attrs.field(default=600.0, validator=_positive)
    admin_timeout: float = attrs.field(default=60.0, validator=_positive)
    gather_window: float = attrs.field(default=0.002, validator=_non_negative)
    max_n: int = attrs.field(default=64, validator=_positive)
    max_attempts: int = attrs.field(default=3, validator=_positive)
    backoff: float = attrs.field(default=0.25, validator=_non_negative)
    #: Merged into every request body.
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
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
            "stream": False,
            **({"seed": p.seed} if p.seed is not None else {}),
            **self.extra_body,
        }
        version = self.version.value
        url = self.base_url + "/v1/completions"
        where = f"{url} (request {rid!r}, n={len(rows)})"
        try:
            data = await self._post(url, rid, body, where)
            choices = data.get("choices") if isinstance(data, dict) else None
            if not isinstance(choices, list) or len(choices) != len(rows):
                got = len(choices) if isinstance(choices, list) else choices
                raise EngineResponseError(f"{where}: expected {len(rows)} choices, got {got!r}")
            ordered: list[Any] = [None] * len(rows)
            for i, choice in enumerate(choices):
                index = choice.get("index", i) if isinstance(choice, dict) else i
                if not isinstance(index, int) or not 0 <= index < len(rows) or ordered[index]:
                    raise EngineResponseError(
                        f"{where}: field 'choices[{i}].index' = {index!r} is out of range "
                        "or repeated"
                    )
                ordered[index] = choice
            for i, (r, choice) in enumerate(zip(rows, ordered, strict=True)):
                tokens, logprobs, finish = parse_completion_response(
                    {"choices": [choice]}, where=f"{where} choice {i}"
                )
                r.completion = Completion(tokens, logprobs, finish, version)
                self._counts["tokens"] += len(tokens)
        except (EngineError, trio.ClosedResourceError) as exc:
            for r in rows:
                r.error = exc

    async def _post(self, url: str, rid: str, body: dict[str, Any], where: str) -> Any:
        client = self._client
        if client is None:
            raise trio.ClosedResourceError("VLLMEngine used outside open_vllm_engine()")
        failures: list[str] = []
        try:
            with trio.fail_after(self.timeout):
                for attempt in range(self.max_attempts):
                    if attempt:
                        await trio.sleep(self.backoff * 2 ** (attempt - 1))
                    self._counts["http_requests"] += 1
                    try:
                        response = await client.post(url, json=body, headers={"X-Request-Id": rid})
                    except httpx.TransportError as exc:
                        failures.append(f"{type(exc).__name__}: {exc}")
                        continue
                    if response.status_code >= 500:
                        failures.append(f"HTTP {response.status_code}")
                        continue
                    if response.status_code >= 400:
                        raise EngineRequestError(
                            f"{where} refused with HTTP {response.status_code}: "
                            f"{response.text[:500]}",
                            status_code=response.status_code,
                            body=response.text[:2000],
                        )
                    try:
                        return json.loads(response.content)
                    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                        raise EngineResponseError(
                            f"{where}: body is not valid JSON ({exc})"
                        ) from None
        except trio.TooSlowError:
            raise EngineTimeoutError(f"{where} did not finish within {self.timeout}s") from None
        raise EngineTransportError(
            f"{where} failed after {self.max_attempts} attempts: " + "; ".join(failures)
        )


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
        ) as client,
        VLLMAdmin(engine.base_url, timeout=engine.admin_timeout) as admin,
        trio.open_nursery() as nursery,
    ):
        engine._client, engine._admin, engine._batcher.nursery = client, admin, nursery
        try:
            yield engine
        finally:
            engine._batcher.nursery = engine._client = engine._admin = None
            nursery.cancel_scope.cancel()
