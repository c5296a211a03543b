"""Free loopback port pairs for the ZeroMQ tests (the transport uses ``port`` and ``port + 1``)."""

from __future__ import annotations

import socket


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are both free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair found")
