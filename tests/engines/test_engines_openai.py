"""OpenAICompatibleEngine against a real (fake vLLM) HTTP server on loopback."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from operations_waits import documented
from trio_rl.engines import (
    AbortSignal,
    Completion,
    Engine,
    EngineRequestError,
    EngineResponseError,
    EngineTimeoutError,
    EngineTransportError,
    GenerateRequest,
    OpenAICompatibleEngine,
    SamplingParams,
    parse_completion_response,
)
from trio_rl.errors import InvalidArgumentError


@attrs.define(eq=False)
class FakeVLLM:
    """A tiny vLLM-like server: answers /v1/completions with ``n`` tokens continuing the prompt,
    can fail (503) or drop the connection N times, hang until aborted, answer a fixed status or
    a raw body, and records every completion request and every abort.

    Asked for ``"stream": true`` it answers as vLLM does: server-sent events in a chunked
    body, one chunk per token (``stream_delay`` seconds apart), the finish reason on the last
    one, a usage chunk with no choices, then ``data: [DONE]``. It can stop after
    ``stream_hang_after`` tokens and wait until the client goes away (recorded in
    ``disconnects``), cut the connection after ``stream_drop_after`` tokens once, or send
    ``raw_stream`` as the body."""

    name: str
    token_style: str = "strings"  # or "ids"
    fail_next: int = 0
    drop_next: int = 0
    hang: bool = False
    status: int | None = None
    raw_body: bytes | None = None
    version_field: Any = None
    version_header: str | None = None
    stream_delay: float = 0.0
    stream_hang_after: int | None = None
    stream_drop_after: int | None = None
    raw_stream: bytes | None = None
    streamed: int = 0  # token chunks written so far, all streams together
    disconnects: list[str] = attrs.field(factory=list)
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    headers: list[dict[str, str]] = attrs.field(factory=list)
    arrivals: list[float] = attrs.field(factory=list)  # time.monotonic() of each request
    aborts: list[dict[str, Any]] = attrs.field(factory=list)
    release: threading.Event = attrs.field(factory=threading.Event)
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def tokens_for(self, payload: dict[str, Any]) -> int:
        return 5 if self.stream_hang_after is None else 50

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/abort_request":
                    with fake.lock:
                        fake.aborts.append(payload)
                    self._send(200, b"{}")
                    return
                with fake.lock:
                    fake.requests.append(payload)
                    fake.headers.append(dict(self.headers))
                    fake.arrivals.append(time.monotonic())
                    drop = fake.drop_next > 0
                    fake.drop_next -= drop
                    fail = not drop and fake.fail_next > 0
                    fake.fail_next -= fail
                if drop:
                    self.close_connection = True
                    return
                if fail:
                    self._send(503, b'{"error": "overloaded"}')
                    return
                if fake.hang:
                    fake.release.wait(30)
                if fake.status is not None:
                    self._send(fake.status, b'{"error": "bad request: max_tokens"}')
                    return
                if fake.raw_body is not None:
                    self._send(200, fake.raw_body)
                    return
                if payload.get("stream"):
                    self._stream(payload)
                    return
                n = min(payload["max_tokens"], fake.tokens_for(payload))
                tokens = [payload["prompt"][-1] + 1 + i for i in range(n)]
                logprobs: dict[str, Any] = {"token_logprobs": [-0.1 * (i + 1) for i in range(n)]}
                choice: dict[str, Any] = {
                    "text": "",
                    "finish_reason": "length" if n == payload["max_tokens"] else "stop",
                    "logprobs": logprobs,
                }
                if fake.token_style == "ids":
                    choice["token_ids"] = tokens
                else:
                    logprobs["tokens"] = [f"token_id:{t}" for t in tokens]
                body: dict[str, Any] = {"id": "cmpl-1", "server": fake.name, "choices": [choice]}
                if fake.version_field is not None:
                    body["policy_version"] = fake.version_field
                extra = {}
                if fake.version_header is not None:
                    extra["X-Policy-Version"] = fake.version_header
                self._send(200, json.dumps(body).encode(), extra)

            def _write_chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _event(self, chunk: dict[str, Any]) -> None:
                self._write_chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")

            def _stream(self, payload: dict[str, Any]) -> None:
                # HTTP/1.1 with a chunked body, as uvicorn sends it: a cut connection is then
                # an incomplete body for the client, not a clean end
                self.protocol_version = "HTTP/1.1"
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                if fake.version_header is not None:
                    self.send_header("X-Policy-Version", fake.version_header)
                self.end_headers()
                if fake.raw_stream is not None:
                    self._write_chunk(fake.raw_stream)
                    if fake.stream_hang_after is not None:
                        self._wait_for_disconnect(payload["rid"])
                        return
                    self._write_chunk(b"")
                    return
                n = min(payload["max_tokens"], fake.tokens_for(payload))
                for i in range(n):
                    with fake.lock:
                        drop = fake.stream_drop_after == i
                        if drop:
                            fake.stream_drop_after = None
                    if drop:
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if fake.stream_hang_after == i:
                        self._wait_for_disconnect(payload["rid"])
                        return
                    if fake.stream_delay:
                        time.sleep(fake.stream_delay)
                    token = payload["prompt"][-1] + 1 + i
                    lp: dict[str, Any] = {"token_logprobs": [-0.1 * (i + 1)], "text_offset": [i]}
                    choice: dict[str, Any] = {
                        "index": 0,
                        "text": f"<{token}>",
                        "logprobs": lp,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                    if fake.token_style == "ids":
                        choice["token_ids"] = [token]
                    else:
                        lp["tokens"] = [f"token_id:{token}"]
                    if i == n - 1:
                        choice["finish_reason"] = "length" if n == payload["max_tokens"] else "stop"
                    chunk: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion"}
                    chunk["choices"] = [choice]
                    if fake.version_field is not None:
                        chunk["policy_version"] = fake.version_field
                    self._event(chunk)
                    with fake.lock:
                        fake.streamed += 1
                self._event({"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": n}})
                self._write_chunk(b"data: [DONE]\n\n")
                self._write_chunk(b"")

            def _wait_for_disconnect(self, rid: str) -> None:
                sock = self.connection
                while not fake.release.is_set():
                    readable, _, _ = select.select([sock], [], [], 0.02)
                    if readable and sock.recv(1, socket.MSG_PEEK) == b"":
                        with fake.lock:
                            fake.disconnects.append(rid)
                        return

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that went away (cancelled) is expected here

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)


@pytest.fixture
def make_server() -> Iterator[Callable[..., FakeVLLM]]:
    started: list[FakeVLLM] = []

    def make(**kwargs: Any) -> FakeVLLM:
        server = FakeVLLM(name=f"s{len(started)}", **kwargs)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def req(i: int = 0, key: str | None = None, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        prompt_tokens=(100, 200 + i),
        params=SamplingParams(**params),
        routing_key=key,
        request_id=f"req-{i}",
    )


def engine(urls: Any, **kwargs: Any) -> OpenAICompatibleEngine:
    kwargs.setdefault("backoff", 0.01)
    kwargs.setdefault("timeout", 10.0)
    return OpenAICompatibleEngine(urls, model="m", **kwargs)


def test_constructor_is_keyword_only_after_the_urls() -> None:
    e = OpenAICompatibleEngine("http://127.0.0.1:1", model="m", timeout=1.0, backoff=0.5)
    assert (e.base_urls, e.model, e.timeout, e.backoff) == (("http://127.0.0.1:1",), "m", 1.0, 0.5)
    with pytest.raises(TypeError, match="positional"):
        OpenAICompatibleEngine("http://127.0.0.1:1", "m")  # type: ignore[call-arg]


def test_satisfies_engine_protocol() -> None:
    assert isinstance(OpenAICompatibleEngine("http://127.0.0.1:1"), Engine)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_urls": []}, r"base_urls must be at least one http\(s\):// URL"),
        ({"base_urls": "localhost:8000"}, r"base_urls must be an http\(s\):// URL"),
        ({"base_urls": "http://x", "timeout": 0}, "timeout must be > 0"),
        ({"base_urls": "http://x", "max_attempts": 0}, "max_attempts must be > 0"),
        ({"base_urls": "http://x", "stream": "yes"}, "stream must be True or False, got 'yes'"),
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict[str, Any], match: str) -> None:
    # the shared validators: InvalidArgumentError (a ValueError) naming class and field
    with pytest.raises(InvalidArgumentError, match=match):
        OpenAICompatibleEngine(**kwargs)


@pytest.mark.parametrize("style", ["strings", "ids"])
async def test_generates_tokens_and_logprobs(
    make_server: Callable[..., FakeVLLM], style: str
) -> None:
    server = make_server(token_style=style)
    async with engine(server.url) as e:
        c = await e.generate(req(3, max_tokens=16, temperature=0.7, seed=42))
    assert c.tokens == [204, 205, 206, 207, 208]
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert (c.finish_reason, c.policy_version) == ("stop", 0)
    [body] = server.requests
    assert body["prompt"] == [100, 203]
    assert body["logprobs"] == 1
    assert body["return_tokens_as_token_ids"] is True
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"]) == (
        "m",
        16,
        0.7,
        42,
    )
    assert body["rid"] == "req-3"
    assert server.headers[0]["X-Request-Id"] == "req-3"


async def test_length_finish_reason(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server()
    async with engine(server.url) as e:
        c = await e.generate(req(0, max_tokens=2))
    assert (len(c.tokens), c.finish_reason) == (2, "length")


async def test_generate_outside_lifetime_is_a_clear_error(
    make_server: Callable[..., FakeVLLM],
) -> None:
    e = engine(make_server().url)
    with pytest.raises(trio.ClosedResourceError, match="outside its 'async with'"):
        await e.generate(req())
    async with e:
        await e.generate(req())
    with pytest.raises(trio.ClosedResourceError):
        await e.generate(req())


# ---------------------------------------------------------------- retries


async def test_retries_5xx_then_succeeds(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server(fail_next=2)
    async with engine(server.url, max_attempts=3) as e:
        c = await e.generate(req())
    assert len(c.tokens) == 5
    assert len(server.requests) == 3
    assert {r["rid"] for r in server.requests} == {"req-0"}  # one request id across attempts


async def test_retries_dropped_connections(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server(drop_next=2)
    async with engine(server.url, max_attempts=3) as e:
        c = await e.generate(req())
    assert len(c.tokens) == 5
    assert len(server.requests) == 3


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_unanswered_on_a_closed_connection_is_sent_once_more_in_its_attempt(
    make_server: Callable[..., FakeVLLM], stream: bool
) -> None:
    # what a pooled keep-alive connection the server closed looks like: no answer at all
    server = make_server(drop_next=1)
    async with engine(server.url, max_attempts=1, stream=stream) as e:
        c = await e.generate(req())
    assert len(c.tokens) == 5
    assert len(server.requests) == 2  # sent again, within its one attempt
    # once only: a server that drops every request fails the attempt
    server = make_server(drop_next=2)
    async with engine(server.url, max_attempts=1, stream=stream) as e:
        with pytest.raises(EngineTransportError, match="failed after 1 attempts"):
            await e.generate(req())
    assert len(server.requests) == 2


async def test_gives_up_after_max_attempts(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server(fail_next=10)
    async with engine(server.url, max_attempts=3) as e:
        with pytest.raises(
            EngineTransportError, match=r"'req-0' failed after 3 attempts.*503"
        ) as info:
            await e.generate(req())
    assert len(server.requests) == 3
    assert str(info.value).count("HTTP 503") == 3  # every attempt named (the port may hold "503")
    documented("`OpenAICompatibleEngine` / `VLLMEngine` requests", str(info.value))


async def test_clients_that_failed_together_retry_at_spread_out_instants(
    make_server: Callable[..., FakeVLLM],
) -> None:
    """Seen from the server: sixteen clients whose first attempts fail at once come back after
    at least half the backoff each, and not together. Without jitter every pause would be the
    whole backoff (the restarted server hit by the fleet at one instant); with it the shortest
    of sixteen uniform draws in [d/2, d] lies below 0.8 d except with probability 0.4**16."""
    clients, backoff = 16, 0.4
    server = make_server(fail_next=clients)
    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(_generate_with, engine(server.url, backoff=backoff), i)
    arrivals: dict[str, list[float]] = {}
    for payload, at in zip(server.requests, server.arrivals, strict=True):
        arrivals.setdefault(payload["rid"], []).append(at)
    pauses = sorted(times[1] - times[0] for times in arrivals.values())
    assert len(pauses) == clients  # every client retried once and then succeeded
    assert pauses[0] >= backoff / 2 - 0.005, pauses
    assert pauses[0] < 0.8 * backoff, pauses


async def _generate_with(e: OpenAICompatibleEngine, i: int) -> None:
    async with e:
        assert len((await e.generate(req(i))).tokens) == 5


async def test_unreachable_server_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # nothing listens on that port now
    async with engine(f"http://127.0.0.1:{port}", max_attempts=2) as e:
        with pytest.raises(EngineTransportError, match="ConnectError"):
            await e.generate(req())


async def test_4xx_is_not_retried(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server(status=400)
    async with engine(server.url, max_attempts=5) as e:
        with pytest.raises(EngineRequestError, match=r"refused with HTTP 400.*max_tokens") as info:
            await e.generate(req())
    assert info.value.status_code == 400
    assert len(server.requests) == 1


async def test_a_retry_without_routing_key_moves_to_another_server(
    make_server: Callable[..., FakeVLLM],
) -> None:
    bad, good = make_server(fail_next=100), make_server()
    async with engine([bad.url, good.url], max_attempts=2) as e:
        for i in range(4):
            await e.generate(req(i))
    assert len(good.requests) == 4
    assert len(bad.requests) > 0  # some attempts landed there, and each moved on at once
    assert sorted(r["rid"] for r in bad.requests) == sorted({r["rid"] for r in bad.requests})


# ---------------------------------------------------------------- bad responses


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"<html>oops", "body is not valid JSON"),
        (b"[1, 2]", "body is list, not a JSON object"),
        (b'{"choices": []}', "'choices' is missing"),
        (b'{"choices": [{"finish_reason": "stop"}]}', r"'choices\[0\].logprobs' is missing"),
        (
            b'{"choices": [{"finish_reason": "stop", "logprobs": '
            b'{"tokens": ["token_id:1", "hello"], "token_logprobs": [-1, -2]}}]}',
            r"'choices\[0\].logprobs.tokens\[1\]' = 'hello'",
        ),
        (
            b'{"choices": [{"finish_reason": "stop", "logprobs": '
            b'{"tokens": ["token_id:1"], "token_logprobs": [-1, -2]}}]}',
            "1 tokens but 2 logprobs",
        ),
        (
            b'{"choices": [{"finish_reason": "eos", "token_ids": [1], "logprobs": '
            b'{"token_logprobs": [-1]}}]}',
            r"'choices\[0\].finish_reason' = 'eos'",
        ),
        (
            b'{"choices": [{"finish_reason": "stop", "token_ids": [1], "logprobs": '
            b'{"token_logprobs": [null]}}]}',
            r"token_logprobs\[0\]' = None is not a number",
        ),
    ],
)
async def test_bad_responses_are_clear_library_errors(
    make_server: Callable[..., FakeVLLM], raw: bytes, match: str
) -> None:
    server = make_server(raw_body=raw)
    async with engine(server.url, stream=False) as e:
        with pytest.raises(EngineResponseError, match=match) as info:
            await e.generate(req(7))
    assert server.url in str(info.value)
    assert "'req-7'" in str(info.value)
    assert len(server.requests) == 1  # a malformed answer is not retried


@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=50),
    data=st.data(),
    style=st.sampled_from(["ids", "strings"]),
    finish=st.sampled_from(["stop", "length", "abort"]),
)
def test_parse_round_trips(tokens: list[int], data: st.DataObject, style: str, finish: str) -> None:
    logprobs = data.draw(
        st.lists(
            st.floats(max_value=0, allow_nan=False), min_size=len(tokens), max_size=len(tokens)
        )
    )
    lp: dict[str, Any] = {"token_logprobs": logprobs}
    choice: dict[str, Any] = {"finish_reason": finish, "logprobs": lp}
    if style == "ids":
        choice["token_ids"] = tokens
    else:
        lp["tokens"] = [f"token_id:{t}" for t in tokens]
    body = json.loads(json.dumps({"choices": [choice]}))
    assert parse_completion_response(body) == (tokens, logprobs, finish)


# ---------------------------------------------------------------- deadline and cancellation


async def test_deadline_raises_timeout_and_aborts_engine_side(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(hang=True)
    async with engine(server.url, timeout=0.3) as e:
        with pytest.raises(EngineTimeoutError, match=r"'req-5' did not finish within 0.3s"):
            await e.generate(req(5))
    assert server.aborts == [{"rid": "req-5"}]


async def test_cancellation_aborts_on_the_server_that_had_the_request(
    make_server: Callable[..., FakeVLLM],
) -> None:
    idle, busy = make_server(), make_server(hang=True)
    async with engine([idle.url, busy.url]) as e:
        key = next(k for k in (f"k{i}" for i in range(100)) if e.server_for(k) == busy.url)
        with trio.move_on_after(0.3) as scope:
            await e.generate(req(9, key=key))
    assert scope.cancelled_caught
    assert busy.aborts == [{"rid": "req-9"}]
    assert idle.aborts == []
    assert idle.requests == []


@pytest.mark.parametrize("stream", [True, False])
async def test_abort_returns_an_abort_completion_and_aborts_engine_side(
    make_server: Callable[..., FakeVLLM], stream: bool
) -> None:
    # the server has answered nothing yet (it hangs before its headers): no tokens either way
    server = make_server(hang=True)
    signal = AbortSignal()
    async with engine(server.url, stream=stream) as e:
        e.set_policy_version(4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_set_later, signal, 0.2)
            with trio.fail_after(5):
                completion = await e.generate(attrs.evolve(req(7), abort=signal))
        assert completion.finish_reason == "abort"
        assert completion.tokens == []
        assert completion.policy_version == 4
        assert server.aborts == [{"rid": "req-7"}]
        # a signal already set stops the next request before it is answered
        with trio.fail_after(5):
            again = await e.generate(attrs.evolve(req(8), abort=signal))
        assert again.finish_reason == "abort"


async def _set_later(signal: AbortSignal, delay: float) -> None:
    await trio.sleep(delay)
    signal.set()


async def test_cancellation_without_abort_path_sends_nothing(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(hang=True)
    async with engine(server.url, abort_path=None) as e:
        with trio.move_on_after(0.2):
            await e.generate(req())
    assert server.aborts == []
    assert len(server.requests) == 1


async def test_a_dead_abort_endpoint_does_not_block_cancellation(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(hang=True)
    async with engine(server.url, abort_path="/no-such-endpoint", abort_timeout=0.5) as e:
        start = trio.current_time()
        with trio.move_on_after(0.2):
            await e.generate(req())
        assert trio.current_time() - start < 5  # bounded by abort_timeout, not the hang


# ---------------------------------------------------------------- routing


async def test_routing_key_pins_a_server_and_keys_spread(
    make_server: Callable[..., FakeVLLM],
) -> None:
    servers = [make_server() for _ in range(3)]
    async with engine([s.url for s in servers]) as e, trio.open_nursery() as nursery:
        for i in range(60):
            nursery.start_soon(e.generate, req(i, key=f"prompt-{i % 20}"))
    seen: dict[str, set[str]] = {}
    for s in servers:
        for r in s.requests:
            key = f"prompt-{(r['prompt'][1] - 200) % 20}"
            seen.setdefault(key, set()).add(s.name)
    assert len(seen) == 20
    assert all(len(names) == 1 for names in seen.values())  # affinity
    assert all(len(s.requests) > 0 for s in servers)  # and spread
    # consistent: adding a server moves only some keys
    bigger = OpenAICompatibleEngine([s.url for s in servers] + ["http://127.0.0.1:9"])
    moved = sum(e.server_for(f"prompt-{i}") != bigger.server_for(f"prompt-{i}") for i in range(200))
    assert 0 < moved < 100


async def test_round_robin_without_key(make_server: Callable[..., FakeVLLM]) -> None:
    servers = [make_server() for _ in range(3)]
    async with engine([s.url for s in servers]) as e:
        for i in range(9):
            await e.generate(req(i))
    assert [len(s.requests) for s in servers] == [3, 3, 3]


async def test_concurrent_requests(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server()
    results: dict[int, list[int]] = {}
    async with engine(server.url) as e:

        async def one(i: int) -> None:
            results[i] = (await e.generate(req(i))).tokens

        async with trio.open_nursery() as nursery:
            for i in range(30):
                nursery.start_soon(one, i)
    assert all(results[i][0] == 201 + i for i in range(30))


# ---------------------------------------------------------------- policy version


async def test_policy_version_sources(make_server: Callable[..., FakeVLLM]) -> None:
    field = make_server(version_field=7, version_header="3")
    header = make_server(version_header="4")
    plain = make_server()
    async with engine(field.url) as e:
        assert (await e.generate(req())).policy_version == 7  # field wins over header
    async with engine(header.url) as e:
        assert (await e.generate(req())).policy_version == 4
    async with engine(plain.url) as e:
        e.set_policy_version(2)
        assert (await e.generate(req())).policy_version == 2
        with pytest.raises(ValueError, match="must not decrease"):
            e.set_policy_version(1)
    async with engine(field.url, version_source=lambda: 11) as e:
        assert (await e.generate(req())).policy_version == 11


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("source", ["fallback", "version_source"])
async def test_the_client_version_is_the_one_current_when_the_request_was_sent(
    make_server: Callable[..., FakeVLLM], stream: bool, source: str
) -> None:
    """Weights that changed while a request ran did not produce its tokens: without a version
    from the server, a completion carries the version read when the request was sent."""
    server = make_server(hang=True)
    current = [3]
    kwargs: dict[str, Any] = {"stream": stream}
    if source == "version_source":
        kwargs["version_source"] = lambda: current[0]
    async with engine(server.url, **kwargs) as e:
        e.set_policy_version(3)
        got: list[Completion] = []

        async def ask() -> None:
            got.append(await e.generate(req(1)))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                for _ in range(1000):  # until the request is on the server, unanswered
                    if server.requests:
                        break
                    await trio.sleep(0.01)
                e.set_policy_version(4)  # new weights while it runs
                current[0] = 4
                server.release.set()
    assert [c.policy_version for c in got] == [3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"version_field": "v2"}, "field 'policy_version' = 'v2' is not an int"),
        ({"version_header": "soon"}, "header 'x-policy-version' = 'soon' is not an int"),
    ],
)
async def test_bad_policy_version_is_a_clear_error(
    make_server: Callable[..., FakeVLLM], kwargs: dict[str, Any], match: str
) -> None:
    server = make_server(**kwargs)
    async with engine(server.url) as e:
        with pytest.raises(EngineResponseError, match=match):
            await e.generate(req())


async def test_cancellation_between_attempts_sends_no_abort(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(fail_next=100)
    async with engine(server.url, backoff=30.0) as e:
        with trio.move_on_after(1.0) as scope:
            await e.generate(req())  # 503, then sleeps in backoff: nothing is outstanding
    assert scope.cancelled_caught
    assert len(server.requests) == 1
    assert server.aborts == []


# ---------------------------------------------------------------- streaming


async def _until(condition: Callable[[], bool]) -> None:
    # the server's threads change its state: poll (the callers bound it with fail_after)
    while not condition():  # noqa: ASYNC110
        await trio.sleep(0.01)


@pytest.mark.parametrize("style", ["strings", "ids"])
@pytest.mark.parametrize(("max_tokens", "finish"), [(16, "stop"), (3, "length")])
async def test_a_streamed_completion_equals_the_non_streamed_one(
    make_server: Callable[..., FakeVLLM], style: str, max_tokens: int, finish: str
) -> None:
    server = make_server(token_style=style, version_header="6", stream_delay=0.01)
    async with engine(server.url, stream=True) as e:
        streamed = await e.generate(req(3, max_tokens=max_tokens))
    async with engine(server.url, stream=False) as e:
        posted = await e.generate(req(3, max_tokens=max_tokens))
    assert streamed == posted
    assert streamed.tokens == [204, 205, 206, 207, 208][:max_tokens]
    assert streamed.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5][:max_tokens])
    assert (streamed.finish_reason, streamed.policy_version) == (finish, 6)
    assert [r["stream"] for r in server.requests] == [True, False]
    assert server.streamed == min(max_tokens, 5)


async def test_streaming_is_the_default(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server()
    async with OpenAICompatibleEngine(server.url, timeout=10.0) as e:
        await e.generate(req())
    assert server.requests[0]["stream"] is True
    assert server.streamed == 5


@pytest.mark.parametrize("abort_path", ["/abort_request", None])
async def test_abort_mid_stream_returns_exactly_the_tokens_streamed_before_it(
    make_server: Callable[..., FakeVLLM], abort_path: str | None
) -> None:
    # three tokens arrive slowly, then the server keeps decoding (it sends nothing more)
    server = make_server(stream_hang_after=3, stream_delay=0.05, version_field=9)
    signal = AbortSignal()
    result: list[Any] = []
    async with engine(server.url, abort_path=abort_path) as e:

        async def generate() -> None:
            result.append(await e.generate(attrs.evolve(req(2, max_tokens=40), abort=signal)))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                await _until(lambda: server.streamed >= 3)
                await trio.sleep(0.2)  # the client has read the three chunks by now
                assert result == []  # still streaming
                signal.set()
            # the server sees the client close the connection
            await _until(lambda: bool(server.disconnects))
    [completion] = result
    assert completion.tokens == [203, 204, 205]
    assert completion.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert (completion.finish_reason, completion.policy_version) == ("abort", 9)
    assert server.disconnects == ["req-2"]
    assert server.aborts == ([{"rid": "req-2"}] if abort_path else [])
    assert server.streamed == 3


async def test_a_stream_cut_mid_way_is_retried_from_scratch(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(stream_drop_after=2)
    async with engine(server.url, max_attempts=2) as e:
        c = await e.generate(req(0))
    # the two tokens of the cut attempt are not kept: no token twice
    assert c.tokens == [201, 202, 203, 204, 205]
    assert len(c.logprobs) == 5
    assert len(server.requests) == 2
    assert server.streamed == 2 + 5


async def test_cancellation_mid_stream_closes_it_and_aborts_engine_side(
    make_server: Callable[..., FakeVLLM],
) -> None:
    server = make_server(stream_hang_after=2)
    async with engine(server.url) as e:
        with trio.move_on_after(0.3) as scope:
            await e.generate(req(4, max_tokens=40))
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await _until(lambda: bool(server.disconnects))
    assert server.aborts == [{"rid": "req-4"}]
    assert server.disconnects == ["req-4"]


async def test_the_deadline_holds_mid_stream(make_server: Callable[..., FakeVLLM]) -> None:
    server = make_server(stream_hang_after=2)
    async with engine(server.url, timeout=0.3) as e:
        with pytest.raises(EngineTimeoutError, match=r"'req-1' did not finish within 0.3s"):
            await e.generate(req(1, max_tokens=40))
    assert server.aborts == [{"rid": "req-1"}]


def _sse(*events: str, sep: str = "\n") -> bytes:
    return "".join(e.replace("\n", sep) + sep + sep for e in events).encode()


_TOKEN = '{"choices": [{"text": "a", "token_ids": [7], "logprobs": {"token_logprobs": [-1.5]}, "finish_reason": null}]}'  # noqa: E501


@pytest.mark.parametrize("sep", ["\n", "\r\n"])
async def test_the_server_sent_event_forms_vllm_and_sglang_use(
    make_server: Callable[..., FakeVLLM], sep: str
) -> None:
    raw = _sse(
        ": a comment line",
        "event: message\nid: 1\ndata: " + _TOKEN,
        # one JSON object over two data lines
        'data: {"choices": [{"text": "b", "logprobs": {"tokens": ["token_id:8"],\n'
        'data: "token_logprobs": [-0.5]}, "finish_reason": null}]}',
        # the finish reason alone, no logprobs
        'data: {"choices": [{"text": "", "logprobs": null, "finish_reason": "stop"}]}',
        'data: {"choices": [], "usage": {"completion_tokens": 2}}',
        "data: [DONE]",
        sep=sep,
    )
    server = make_server(raw_stream=raw)
    async with engine(server.url) as e:
        c = await e.generate(req())
    assert (c.tokens, c.logprobs, c.finish_reason) == ([7, 8], [-1.5, -0.5], "stop")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_sse("data: {oops"), r"event 0: event data is not valid JSON"),
        (_sse("data: " + _TOKEN, "data: [1]"), r"event 1: chunk is list, not a JSON object"),
        (
            _sse("data: " + _TOKEN, 'data: {"error": {"message": "engine dead"}}'),
            r"event 1: the server sent an error in the stream: .*engine dead",
        ),
        (
            _sse('data: {"object": "error", "message": "out of memory"}'),
            "the server sent an error in the stream: 'out of memory'",
        ),
        (_sse("data: " + _TOKEN, "data: [DONE]"), "the stream ended without a finish reason"),
        (b"", "the stream ended without a finish reason"),
        (
            _sse('data: {"choices": [{"text": "x", "logprobs": null, "finish_reason": null}]}'),
            r"'choices\[0\].logprobs' is missing",
        ),
        (
            _sse(
                'data: {"choices": [{"logprobs": {"tokens": ["hi"], "token_logprobs": [-1]}, '
                '"finish_reason": null}]}'
            ),
            r"event 0: field 'choices\[0\].logprobs.tokens\[0\]' = 'hi'",
        ),
        (
            _sse(
                'data: {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1]}, '
                '"finish_reason": "eos"}]}'
            ),
            r"'choices\[0\].finish_reason' = 'eos'",
        ),
        (_sse('data: {"id": 1}'), "event 0: field 'choices' is missing or not a list"),
    ],
)
async def test_bad_streams_are_clear_library_errors(
    make_server: Callable[..., FakeVLLM], raw: bytes, match: str
) -> None:
    server = make_server(raw_stream=raw)
    async with engine(server.url) as e:
        with pytest.raises(EngineResponseError, match=match) as info:
            await e.generate(req(7))
    assert server.url in str(info.value)
    assert "'req-7'" in str(info.value)
    assert len(server.requests) == 1  # a malformed stream is not retried


async def test_a_bad_chunk_mid_stream_stops_reading_at_once(
    make_server: Callable[..., FakeVLLM],
) -> None:
    # after the bad chunk the server goes on decoding (sends nothing, keeps the connection):
    # the engine does not wait for it, closes the connection, and closes httpx's readers
    # without a ResourceWarning (which pytest reports as an error)
    server = make_server(raw_stream=_sse("data: " + _TOKEN, "data: {oops"), stream_hang_after=0)
    async with engine(server.url, timeout=30.0) as e:
        start = trio.current_time()
        with pytest.raises(EngineResponseError, match="event 1: event data is not valid JSON"):
            await e.generate(req(6))
        assert trio.current_time() - start < 5
        with trio.fail_after(5):
            await _until(lambda: bool(server.disconnects))
    assert server.disconnects == ["req-6"]
    assert server.aborts == []  # a bad answer is not a cancellation


async def test_4xx_and_5xx_are_handled_alike_when_streaming(
    make_server: Callable[..., FakeVLLM],
) -> None:
    refused = make_server(status=400)
    flaky = make_server(fail_next=1)
    async with engine(refused.url) as e:
        with pytest.raises(EngineRequestError, match=r"HTTP 400.*max_tokens"):
            await e.generate(req())
    async with engine(flaky.url, max_attempts=2) as e:
        assert len((await e.generate(req())).tokens) == 5
    assert (len(refused.requests), len(flaky.requests)) == (1, 2)


async def test_a_continuation_after_an_abort_goes_on_from_the_kept_tokens(
    make_server: Callable[..., FakeVLLM],
) -> None:
    # what the sync driver's partial rollouts do: abort, then ask again with prompt + tokens
    server = make_server(stream_hang_after=2)
    signal = AbortSignal()
    first = attrs.evolve(req(0, max_tokens=8), abort=signal)
    async with engine(server.url) as e:
        async with trio.open_nursery() as nursery:
            result: list[Any] = []

            async def generate() -> None:
                result.append(await e.generate(first))

            nursery.start_soon(generate)
            with trio.fail_after(5):
                await _until(lambda: server.streamed >= 2)
            await trio.sleep(0.2)
            signal.set()
        [partial] = result
        server.stream_hang_after = None
        rest = await e.generate(
            attrs.evolve(
                first,
                prompt_tokens=(*first.prompt_tokens, *partial.tokens),
                params=SamplingParams(max_tokens=8 - len(partial.tokens)),
                abort=None,
                request_id="req-0-continued",
            )
        )
        whole = await e.generate(req(0, max_tokens=8))
    assert partial.tokens == [201, 202]
    # the fake answers at most 5 tokens a request: the uninterrupted run is the prefix
    assert (partial.tokens + rest.tokens)[: len(whole.tokens)] == whole.tokens
    assert rest.tokens[0] == 203  # nothing regenerated, nothing skipped
    assert server.requests[1]["prompt"] == [100, 200, 201, 202]


@pytest.mark.parametrize(("expiry", "connections"), [(0.2, 2), (30.0, 1)])
async def test_an_idle_connection_is_dropped_after_keepalive_expiry(
    expiry: float, connections: int
) -> None:
    # a keep-alive HTTP/1.1 server that records the client port of every request: a connection
    # kept past the server's own idle limit would meet a close mid-request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vllm_stand_in import StandIn

    stand_in = StandIn()
    ports: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ports.append(self.client_address[1])
            payload = json.dumps(stand_in.completions(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        async with engine(url, stream=False, keepalive_expiry=expiry) as e:
            await e.generate(req(0))
            await trio.sleep(0.6)
            await e.generate(req(1))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert len(ports) == 2
    assert len(set(ports)) == connections
