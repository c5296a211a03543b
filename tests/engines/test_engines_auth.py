"""API keys and headers of the inference fleet, against real loopback servers that check the
``Authorization`` header (``vllm_stand_in.py``, in this process or as a launched process
behind the run's authenticating gate)."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from vllm_stand_in import StandIn, serve

from trio_rl.engines import (
    AbortSignal,
    EngineAuthError,
    EngineConfigError,
    EngineFleet,
    EngineRequestError,
    GenerateRequest,
    OpenAICompatibleEngine,
    SamplingParams,
    VLLMAdmin,
    launch_vllm_servers,
    open_engine_fleet,
    open_inference,
    open_vllm_engine,
)
from trio_rl.engines._auth import bearer_headers, draw_api_key, expand_headers
from trio_rl.engines._gate import MAX_HEAD, authorized, serve_gate
from trio_rl.engines._launch import free_port

STAND_IN = str(Path(__file__).with_name("vllm_stand_in.py"))
STAND_IN_VLLM = (sys.executable, STAND_IN)
KEY = "sk-planted-9f2c71d0e4b84a6c"
ENV = "TRIO_RL_TEST_API_KEY"


@pytest.fixture
def guarded() -> Iterator[tuple[StandIn, str]]:
    """A stand-in that wants ``KEY`` on vLLM's guarded paths, as ``vllm serve --api-key``."""
    state = StandIn()
    state.api_key = KEY
    with serve(0, state) as served:
        yield served


def _request(seed: int = 0, **kwargs: Any) -> GenerateRequest:
    return GenerateRequest((5, 6), SamplingParams(max_tokens=4, seed=seed), **kwargs)


def _authorizations(state: StandIn) -> dict[str, set[str | None]]:
    """What each path was sent as ``Authorization``."""
    sent: dict[str, set[str | None]] = {}
    for (_, path, _), headers in zip(state.requests, state.headers, strict=True):
        sent.setdefault(path, set()).add(headers.get("authorization"))
    return sent


# ---------------------------------------------------------------- the key from the environment


async def test_every_request_and_admin_call_of_the_fleet_sends_the_key_from_the_environment(
    guarded: tuple[StandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = guarded
    monkeypatch.setenv(ENV, KEY)
    with trio.fail_after(30):
        async with open_inference(urls=[url], api_key_env=ENV, probe_interval=0.05) as fleet:
            done = await fleet.generate(_request())
            await fleet.load_weights("/w/1", 1)
            await trio.sleep(0.2)  # a few health probes
    assert done.finish_reason == "stop"
    sent = _authorizations(state)
    assert set(sent) >= {
        "/health",
        "/v1/models",
        "/v1/completions",
        "/collective_rpc",
        "/reset_prefix_cache",
    }
    assert all(values == {f"Bearer {KEY}"} for values in sent.values()), sent


async def test_headers_reference_the_environment_and_go_with_every_call(
    guarded: tuple[StandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = guarded
    monkeypatch.setenv(ENV, KEY)
    monkeypatch.setenv("TRIO_RL_TEST_TENANT", "team-7")
    headers = {"X-Tenant": "${TRIO_RL_TEST_TENANT}/$${literal}", "X-Plain": "yes"}
    with trio.fail_after(30):
        async with open_inference(urls=[url], api_key_env=ENV, headers=headers) as fleet:
            await fleet.generate(_request())
            await fleet.load_weights("/w/1", 1)
    assert {h.get("x-tenant") for h in state.headers} == {"team-7/${literal}"}
    assert {h.get("x-plain") for h in state.headers} == {"yes"}


def test_expand_headers_names_the_header_and_the_variable_never_a_value() -> None:
    env = {"SET": KEY, "EMPTY": ""}
    assert expand_headers({"A": "x ${SET} y", "B": "$$5"}, env) == {"A": f"x {KEY} y", "B": "$5"}
    with pytest.raises(EngineConfigError, match=r"header 'A' references .* NOPE, which is not set"):
        expand_headers({"A": "${NOPE}", "B": "${SET}"}, env)
    with pytest.raises(EngineConfigError, match=r"EMPTY, which is empty") as caught:
        expand_headers({"B": "${SET}", "A": "${EMPTY}"}, env)
    assert KEY not in str(caught.value)


async def test_a_missing_or_empty_variable_is_one_error_naming_it(
    guarded: tuple[StandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = guarded
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(EngineConfigError, match=f"variable {ENV} \\(api_key_env\\) is not set"):
        async with open_inference(urls=[url], api_key_env=ENV):
            pass
    monkeypatch.setenv(ENV, "")
    with pytest.raises(EngineConfigError, match=f"variable {ENV} \\(api_key_env\\) is empty"):
        async with open_inference(urls=[url], api_key_env=ENV):
            pass
    with pytest.raises(EngineConfigError, match="an Authorization header and an API key"):
        async with open_inference(urls=[url], api_key="k", headers={"authorization": "x"}):
            pass


async def test_a_wrong_or_missing_key_fails_the_opening_at_once_naming_the_variable(
    guarded: tuple[StandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM leaves /health open: the refusal comes from /v1/models, the first guarded call;
    the fleet does not wait out its start_timeout (600 s here)."""
    _, url = guarded
    monkeypatch.setenv(ENV, "wrong-" + KEY)
    with trio.fail_after(30):
        with pytest.raises(EngineAuthError) as caught:
            async with open_inference(urls=[url], api_key_env=ENV, start_timeout=600):
                pass
        message = str(caught.value)
        assert "HTTP 401" in message
        assert url in message
        assert f"the environment variable {ENV} (api_key_env)" in message
        assert KEY not in message
        assert caught.value.body == ""
        with pytest.raises(EngineAuthError, match=r"none \(api_key_env is unset\)"):
            async with open_inference(urls=[url], start_timeout=600):
                pass


async def test_a_proxy_that_guards_health_too_refuses_on_the_first_probe(
    guarded: tuple[StandIn, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = guarded
    state.guard_all = True
    with trio.fail_after(30):
        with pytest.raises(EngineAuthError, match=r"GET .*/health refused the credentials"):
            async with open_engine_fleet([url], start_timeout=600, check_models=False):
                pass
    assert [p for _, p, _ in state.requests] == ["/health"]  # refused once, not polled


async def test_a_refused_request_is_an_auth_error_that_keeps_no_body(
    guarded: tuple[StandIn, str],
) -> None:
    state, url = guarded
    state.override["/v1/completions"] = (403, f'{{"echo": "Bearer {KEY}"}}'.encode())
    for stream in (True, False):
        async with OpenAICompatibleEngine(
            (url,), headers=bearer_headers(KEY), stream=stream, max_attempts=1
        ) as engine:
            with pytest.raises(EngineAuthError, match="HTTP 403") as caught:
                await engine.generate(_request())
        assert KEY not in str(caught.value)
        assert caught.value.body == ""
        assert isinstance(caught.value, EngineRequestError)
        assert caught.value.status_code == 403


async def test_an_answer_that_echoes_the_request_is_quoted_without_the_secrets(
    guarded: tuple[StandIn, str],
) -> None:
    state, url = guarded
    echo = f'{{"detail": "bad request", "got": "Bearer {KEY}", "tenant": "team-secret-7"}}'
    state.override["/v1/completions"] = (400, echo.encode())
    headers = {**bearer_headers(KEY), "X-Tenant": "team-secret-7"}
    async with OpenAICompatibleEngine((url,), headers=headers, max_attempts=1) as engine:
        with pytest.raises(EngineRequestError, match="HTTP 400") as caught:
            await engine.generate(_request())
    assert type(caught.value) is EngineRequestError
    for text in (str(caught.value), caught.value.body):
        assert "bad request" in text
        assert KEY not in text
        assert "team-secret-7" not in text


async def test_the_vllm_engine_sends_its_headers_with_requests_and_admin_calls(
    guarded: tuple[StandIn, str],
) -> None:
    state, url = guarded
    with trio.fail_after(10):
        async with open_vllm_engine(url, headers=bearer_headers(KEY)) as engine:
            await engine.generate(_request())
            await engine.load_weights("/w/1", 1)
        async with open_vllm_engine(url) as bare:
            with pytest.raises(EngineAuthError):
                await bare.generate(_request())
    sent = _authorizations(state)
    assert sent["/collective_rpc"] == sent["/reset_prefix_cache"] == {f"Bearer {KEY}"}
    assert sent["/v1/completions"] == {f"Bearer {KEY}", None}


def test_no_repr_shows_a_key() -> None:
    headers = bearer_headers(KEY)
    shown = [
        repr(OpenAICompatibleEngine(("http://h:1",), headers=headers)),
        repr(EngineFleet(("http://h:1",), headers=headers)),
        repr(VLLMAdmin("http://h:1", headers=headers)),
    ]
    assert all(KEY not in text for text in shown), shown


def test_keys_are_drawn_fresh_and_a_key_that_cannot_be_sent_is_refused_without_its_value() -> None:
    keys = {draw_api_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(len(k) >= 40 for k in keys)
    for bad in ("", " padded", "two\nlines"):
        with pytest.raises(EngineConfigError, match="the API key is empty or has") as caught:
            bearer_headers(bad)
        assert bad.strip() == "" or bad.strip() not in str(caught.value)


# ---------------------------------------------------------------- the gate


def test_the_gate_wants_exactly_one_bearer_with_the_key() -> None:
    import hashlib

    digest = hashlib.sha256(KEY.encode()).digest()
    line = b"POST /collective_rpc HTTP/1.1\r\nHost: x"
    assert authorized(line + f"\r\nAuthorization: Bearer {KEY}".encode(), digest)
    assert authorized(line + f"\r\nauthorization:   bearer {KEY}  ".encode(), digest)
    assert not authorized(line, digest)
    assert not authorized(line + f"\r\nAuthorization: Basic {KEY}".encode(), digest)
    assert not authorized(line + f"\r\nAuthorization: Bearer {KEY}x".encode(), digest)
    twice = f"\r\nAuthorization: Bearer {KEY}\r\nAuthorization: Bearer other".encode()
    assert not authorized(line + twice, digest)
    assert not authorized(line + f"\r\nX-Authorization: Bearer {KEY}".encode(), digest)


@pytest.fixture
def gated() -> Iterator[tuple[StandIn, str]]:
    """An unguarded stand-in on a Unix socket; the test puts the gate in front of it."""
    with tempfile.TemporaryDirectory(prefix="trio-rl-test-") as private:
        path = os.path.join(private, "s.sock")
        with serve(0, uds=path) as (state, _):
            yield state, path


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the gate closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        received = b""
        while chunk := await stream.receive_some(65536):
            received += chunk
    return received


async def test_the_gate_refuses_what_the_server_would_let_through(
    gated: tuple[StandIn, str],
) -> None:
    state, path = gated
    port = free_port()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_gate, path, KEY, port)
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient() as client:
                for method, where in [("GET", "/health"), ("POST", "/collective_rpc")]:
                    bare = await client.request(method, url + where, json={})
                    wrong = await client.request(
                        method, url + where, json={}, headers=bearer_headers("not-" + KEY)
                    )
                    right = await client.request(
                        method, url + where, json={}, headers=bearer_headers(KEY)
                    )
                    assert (bare.status_code, wrong.status_code, right.status_code) == (
                        401,
                        401,
                        200,
                    )
                    assert bare.json() == {"error": "Unauthorized"}
                    assert bare.headers["www-authenticate"] == "Bearer"
            # only the requests with the key reached the server
            assert [p for _, p, _ in state.requests] == ["/health", "/collective_rpc"]
            assert await _raw(port, b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * MAX_HEAD) == (
                b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                b"content-length: 0\r\n\r\n"
            )
            nursery.cancel_scope.cancel()


async def test_a_connection_is_admitted_by_its_first_request_only(
    gated: tuple[StandIn, str],
) -> None:
    """A request with the key pipelined behind one without it does not get in: the gate
    answers the first with 401 and closes the connection."""
    state, path = gated
    port = free_port()
    bare = b"POST /collective_rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    keyed = bare.replace(b"Host: x", f"Host: x\r\nAuthorization: Bearer {KEY}".encode())
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_gate, path, KEY, port)
            answer = await _raw(port, bare + keyed)
            assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
            assert answer.count(b"HTTP/1.") == 1
            assert state.requests == []
            admitted = await _raw(port, keyed)
            assert admitted.startswith(b"HTTP/1.0 200 ")  # the stand-in speaks HTTP/1.0
            assert [p for _, p, _ in state.requests] == ["/collective_rpc"]
            nursery.cancel_scope.cancel()


async def test_the_gate_relays_keep_alive_streams_and_a_client_that_leaves(
    gated: tuple[StandIn, str],
) -> None:
    """Streamed completions and an abort through the gate: the server sees the client
    leave (vLLM aborts such a request), and a pooled connection serves several requests."""
    state, path = gated
    state.lengths, state.stall, state.step_delay = [20], {0: 3}, 0.02
    port = free_port()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_gate, path, KEY, port)
            async with OpenAICompatibleEngine(
                (f"http://127.0.0.1:{port}",), headers=bearer_headers(KEY), abort_path=None
            ) as engine:
                signal = AbortSignal()

                async def abort_after_three() -> None:
                    while len(state.sent) < 3:  # noqa: ASYNC110 - the server thread's counter
                        await trio.sleep(0.01)
                    await trio.sleep(0.1)
                    signal.set()

                nursery.start_soon(abort_after_three)
                partial = await engine.generate(_request(abort=signal))
                while state.disconnects < 1:  # noqa: ASYNC110 - the server thread's counter
                    await trio.sleep(0.01)
                state.stall = {}
                full = [await engine.generate(_request(seed=s)) for s in (1, 2, 3)]
            nursery.cancel_scope.cancel()
    assert (partial.finish_reason, partial.tokens) == ("abort", [0, 1000, 2000])
    assert [c.tokens[0] for c in full] == [1, 2, 3]
    assert all(c.finish_reason == "length" for c in full)


async def test_the_gate_answers_502_while_the_server_is_not_listening() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as private, trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_gate, os.path.join(private, "none.sock"), KEY, port)
            async with httpx.AsyncClient(headers=bearer_headers(KEY)) as client:
                answer = await client.get(f"http://127.0.0.1:{port}/health")
            assert answer.status_code == 502
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- launched servers


def _proc(pid: int, name: str) -> list[bytes]:
    """``/proc/PID/NAME`` (cmdline, environ) as its NUL-separated fields."""
    return Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0")


def _server_pid(port: int) -> int:
    """The launched stand-in process whose command line holds the socket behind ``port``'s
    gate (the only stand-in of the test)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if STAND_IN.encode() in cmdline and b"--uds" in cmdline:
            found.append(int(entry))
    assert len(found) == 1, found
    return found[0]


async def test_a_launched_server_wants_the_key_on_every_path_and_keeps_it_off_its_command_line(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with launch_vllm_servers(
            1, "/models/tiny", executable=STAND_IN_VLLM, log_dir=tmp_path, api_key=KEY
        ) as launched:
            (url,) = launched.urls
            assert launched.headers == {"Authorization": f"Bearer {KEY}"}
            assert KEY not in repr(launched)
            async with httpx.AsyncClient() as client:
                for path in ("/health", "/v1/models", "/collective_rpc", "/reset_prefix_cache"):
                    bare = await client.post(url + path, json={})
                    right = await client.post(url + path, json={}, headers=launched.headers)
                    assert (bare.status_code, right.status_code) == (401, 200), path
            pid = _server_pid(int(url.rsplit(":", 1)[1]))
            cmdline, environ = _proc(pid, "cmdline"), _proc(pid, "environ")
            assert KEY.encode() not in b" ".join(cmdline)
            assert f"VLLM_API_KEY={KEY}".encode() in environ
            socket_path = cmdline[cmdline.index(b"--uds") + 1].decode()
            assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
            # behind the socket, the server (like vLLM) leaves its admin endpoints open, and
            # guards /v1 with the key from its environment: the gate is what fences them
            transport = httpx.AsyncHTTPTransport(uds=socket_path)
            async with httpx.AsyncClient(transport=transport) as direct:
                assert (await direct.post("http://s/collective_rpc", json={})).status_code == 200
                assert (await direct.get("http://s/v1/models")).status_code == 401
    assert KEY not in (tmp_path / "vllm-0.log").read_text()
    assert not Path(socket_path).parent.exists()  # removed with the server


async def test_open_inference_draws_a_key_for_launched_servers_and_its_fleet_sends_it(
    tmp_path: Path,
) -> None:
    kwargs: dict[str, Any] = {
        "launch": 1,
        "model_path": "/models/tiny",
        "vllm": f"{sys.executable} {STAND_IN}",
        "log_dir": tmp_path,
        "probe_interval": 0.05,
    }
    with trio.fail_after(60):
        async with open_inference(**kwargs) as fleet:
            (url,) = fleet.urls
            done = await fleet.generate(_request())
            await fleet.load_weights("/w/1", 1)
            async with httpx.AsyncClient() as client:
                assert (await client.post(url + "/collective_rpc", json={})).status_code == 401
            drawn = dict(fleet.headers)["Authorization"]
        assert done.finish_reason == "stop"
        async with open_inference(**kwargs) as again:
            assert dict(again.headers)["Authorization"] != drawn  # one key per run
        with pytest.raises(EngineConfigError, match="launched servers want the run's key"):
            async with open_inference(**kwargs, headers={"Authorization": "Bearer x"}):
                pass
