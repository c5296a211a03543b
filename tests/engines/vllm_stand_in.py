"""A real loopback HTTP server that stands in for vLLM (stdlib ``http.server`` in a thread).

It records every request and answers like vLLM 0.32: ``/collective_rpc`` and
``/reset_prefix_cache`` with an empty 200, ``/v1/completions`` with ``n`` choices whose tokens
encode the seed each choice got (``seed + index``): choice ``i`` of a request seeded ``s`` is
``[s + i, s + i + 1000, ..., EOS]``, ``lengths[i]`` tokens long (2 by default), cut at
``max_tokens`` (finish reason ``length``, else ``stop``).

Asked for ``"stream": true`` it streams as vLLM does: server-sent events in a chunked HTTP/1.1
body, one event per choice and decode step (each with one choice and its ``index``; the choices
of a step in index order, or reversed with ``reverse_choices``), ``step_delay`` seconds between
steps, the finish reason on a choice's last token, a usage event with no choices, then
``data: [DONE]``. A choice listed in ``stall`` sends that many tokens and then nothing more: the
server keeps the connection until the client leaves (counted in ``disconnects``). ``cut_after``
cuts the connection after that many events, once; ``raw_stream`` is sent as the whole body.
``GET /v1/models`` lists ``model``. Every request's headers are kept in ``headers`` (same order
as ``requests``). With ``api_key`` set it checks ``Authorization: Bearer <key>`` as vLLM's
``--api-key`` does, on the ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` paths only (401
``{"error":"Unauthorized"}``), or on every path with ``guard_all`` (an authenticating proxy).

Run as a program (``python vllm_stand_in.py --port P``, or ``--uds PATH`` for a Unix socket as
vLLM's ``--uds``; the key from ``VLLM_API_KEY``, as vLLM reads it) it is a separate server
process, as the fleet tests need one to kill: ``GET /stand_in/log`` then answers every request
it recorded (method, path, body, routing header, headers) as JSON, and ``--step-delay`` slows its
streams.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

EOS = 1
#: The path prefixes vLLM 0.32's ``--api-key`` guards (its AuthenticationMiddleware).
GUARDED = ("/v1", "/v2", "/inference", "/cohere")


class StandIn:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.model = "stand-in"
        #: path -> (status, body) overriding the normal answer
        self.override: dict[str, tuple[int, bytes]] = {}
        self.delay = 0.0
        self.reverse_choices = False
        #: this many coming requests get their connection closed without an answer
        self.drop_next = 0
        self.lengths: list[int] | None = None
        self.step_delay = 0.0
        self.stall: dict[int, int] = {}
        self.cut_after: int | None = None
        self.raw_stream: bytes | None = None
        #: (choice index, token) of every streamed token event, all streams together
        self.sent: list[tuple[int, int]] = []
        self.disconnects = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.api_key: str | None = None
        #: with a vocabulary size, every token id but EOS is folded into 2 .. vocab - 1
        self.vocab: int | None = None
        self.guard_all = False

    def authorized(self, path: str, authorization: str | None) -> bool:
        """vLLM's check: paths under its guarded prefixes (or all, with ``guard_all``) need
        ``Authorization: Bearer <api_key>``."""
        if self.api_key is None or not (self.guard_all or path.startswith(GUARDED)):
            return True
        return authorization == f"Bearer {self.api_key}"

    def choice(self, body: dict[str, Any], i: int) -> tuple[list[int], list[float], str]:
        seed, length = body.get("seed", 0), (self.lengths or [])[i : i + 1] or [2]
        tokens = [seed + i + 1000 * k for k in range(length[0] - 1)] + [EOS]
        if self.vocab is not None:  # ids a real model can score: 2 .. vocab - 1
            tokens = [t if t == EOS else 2 + t % (self.vocab - 2) for t in tokens]
        logprobs = [-0.5 - i - k / 8 for k in range(length[0] - 1)] + [-0.25]
        if len(tokens) > body["max_tokens"]:
            n = body["max_tokens"]
            return tokens[:n], logprobs[:n], "length"
        return tokens, logprobs, "stop"

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i in range(body.get("n", 1)):
            tokens, logprobs, finish = self.choice(body, i)
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens],
                        "token_logprobs": logprobs,
                    },
                    "finish_reason": finish,
                    "token_ids": None,
                }
            )
        if self.reverse_choices:
            choices.reverse()
        return {"choices": choices}

    def events(self, body: dict[str, Any]) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(choice index, token, event) in the order vLLM streams them."""
        answers = [self.choice(body, i) for i in range(body.get("n", 1))]
        order = list(range(len(answers)))
        if self.reverse_choices:
            order.reverse()
        for k in range(max(len(tokens) for tokens, _, _ in answers)):
            for i in order:
                tokens, logprobs, finish = answers[i]
                if k >= len(tokens) or k >= self.stall.get(i, len(tokens)):
                    continue
                choice = {
                    "index": i,
                    "text": "",
                    "logprobs": {
                        "text_offset": [k],
                        "token_logprobs": [logprobs[k]],
                        "tokens": [f"token_id:{tokens[k]}"],
                        "top_logprobs": [{f"token_id:{tokens[k]}": logprobs[k]}],
                    },
                    "finish_reason": finish if k == len(tokens) - 1 else None,
                    "stop_reason": None,
                }
                event = {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}
                yield i, tokens[k], event


@contextmanager
def serve(
    port: int = 0, given: StandIn | None = None, uds: str | None = None
) -> Iterator[tuple[StandIn, str]]:
    """Serve on ``127.0.0.1:port`` (0: a free port), or on the Unix socket ``uds``; yields
    the state and the URL (``http://127.0.0.1:PORT``, or ``unix:PATH``)."""
    state = StandIn() if given is None else given

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body: Any = json.loads(raw) if raw else None
            if self.path == "/stand_in/log":
                self._log()
                return
            with state.lock:
                state.requests.append((method, self.path, body))
                state.headers.append({k.lower(): v for k, v in self.headers.items()})
                drop = state.drop_next > 0
                state.drop_next -= drop
            if drop:
                # what a uvicorn keep-alive timeout looks like to a client reusing the connection
                self.close_connection = True
                return
            if not state.authorized(self.path, self.headers.get("Authorization")):
                self._send(401, b'{"error":"Unauthorized"}')
                return
            if state.delay:
                time.sleep(state.delay)
            status, payload = 200, b""
            if self.path in state.override:
                status, payload = state.override[self.path]
            elif self.path == "/v1/completions" and body.get("stream"):
                self._stream(body)
                return
            elif self.path == "/v1/completions":
                payload = json.dumps(state.completions(body)).encode()
            elif self.path == "/v1/models":
                payload = json.dumps({"object": "list", "data": [{"id": state.model}]}).encode()
            self._send(status, payload)

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _log(self) -> None:
            with state.lock:
                log = [
                    {
                        "method": method,
                        "path": path,
                        "body": body,
                        "routing_key": headers.get("x-smg-routing-key"),
                        "headers": headers,
                    }
                    for (method, path, body), headers in zip(
                        state.requests, state.headers, strict=True
                    )
                ]
            payload = json.dumps(log).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _write_chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _stream(self, body: dict[str, Any]) -> None:
            # HTTP/1.1 with a chunked body, as uvicorn sends it: a cut connection is then an
            # incomplete body for the client, not a clean end
            self.protocol_version = "HTTP/1.1"
            self.close_connection = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            # said, since the connection closes after the stream: a client that pooled it
            # could otherwise send its next request on it as it closes, and take the close
            # (a race of the stand-in, not a server failure) for a dropped request
            self.send_header("Connection", "close")
            self.end_headers()
            if state.raw_stream is not None:
                self._write_chunk(state.raw_stream)
                self._write_chunk(b"")
                return
            step = -1
            for written, (i, token, event) in enumerate(state.events(body)):
                with state.lock:
                    cut = state.cut_after == written
                    if cut:
                        state.cut_after = None
                if cut:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if state.step_delay and event["choices"][0]["logprobs"]["text_offset"][0] != step:
                    step = event["choices"][0]["logprobs"]["text_offset"][0]
                    time.sleep(state.step_delay)
                self._write_chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                with state.lock:
                    state.sent.append((i, token))
            if state.stall:
                self._wait_for_disconnect()
                return
            usage = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 0}}
            self._write_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")

        def _wait_for_disconnect(self) -> None:
            sock = self.connection
            while not state.release.is_set():
                readable, _, _ = select.select([sock], [], [], 0.02)
                if readable and sock.recv(1, socket.MSG_PEEK) == b"":
                    with state.lock:
                        state.disconnects += 1
                    return

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256  # a burst of connections is not refused (the default is 5)

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that went away (aborted, cancelled) is expected here

    class UnixServer(socketserver.ThreadingUnixStreamServer):
        daemon_threads = True
        request_queue_size = 256

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass

    server: socketserver.BaseServer
    if uds is None:
        server = Server(("127.0.0.1", port), Handler)
        url = f"http://127.0.0.1:{server.server_address[1]}"
    else:
        server, url = UnixServer(uds, Handler), f"unix:{uds}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state, url
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description="a vLLM stand-in server process on loopback")
    # vLLM's API server arguments are accepted, so it can stand in for the vLLM command
    parser.add_argument("--model", dest="model_path", help="ignored")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--uds", default=None, help="a Unix socket path, in place of --port")
    parser.add_argument("--served-model-name", dest="model", default="stand-in")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--length", type=int, default=4, help="tokens per completion")
    parser.add_argument(
        "--child",
        action="store_true",
        help="start a child process, as vLLM starts its engine core (printed as 'child PID')",
    )
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds before listening")
    parser.add_argument("--vocab", type=int, default=None, help="fold token ids into 2..vocab-1")
    args = parser.parse_args()
    if args.child:
        import subprocess
        import sys

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        print(f"child {child.pid}", flush=True)
    time.sleep(args.start_delay)
    state = StandIn()
    state.model, state.step_delay, state.lengths = args.model, args.step_delay, [args.length] * 64
    state.api_key = os.environ.get("VLLM_API_KEY") or None
    state.vocab = args.vocab
    with serve(args.port, state, uds=args.uds):
        print("ready", flush=True)
        threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
