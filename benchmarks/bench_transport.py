"""Transport throughput on large payloads, trio transports against plain blocking pyzmq.

Side by side in one run, the same payloads (default sixteen 64 MiB payloads, one rank):

- ``zmq blocking threads``: plain pyzmq, PUB in a sender thread, SUB in a receiver thread,
  the same frames as the transport (``[topic, payload]``, ``copy=False``), one context (the
  goal's baseline); and the same with a context per side, as two processes have;
- ``zmq trio``: `ZmqSender` -> `ZmqReceiver` in one trio loop (``trio_rl``'s
  NOBLOCK + fd-wait integration, no thread per message), with a 5 ms heartbeat measuring
  event-loop lag during the transfer;
- ``files trio``: `FileSender` -> `FileReceiver` (delete after read), file I/O in
  worker threads, with the same heartbeat; reading into ``bytes`` and with ``use_mmap``.

The receiving side drops each payload in a worker thread, as `BatchReceiver` does after
decoding (a 64 MiB free is an munmap of tens of ms; for zmq frames and mappings it runs
without the GIL, for ``bytes`` it holds it).

PUB drops past its high-water mark, so every mode uses the same window: the sender runs at
most ``--window`` payloads ahead of the receiver (the orchestrator's ship gate plays this role
in production). Each received payload is checked (length, head and tail bytes).

    python benchmarks/bench_transport.py                 # 16 x 64 MiB, well under a minute
    python benchmarks/bench_transport.py --repeat 3 --fsync
    python benchmarks/bench_transport.py --repeat 5 --zmq-only   # the ZeroMQ goal (trio/threads)
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import trio
import zmq

from trio_rl.transport import (
    FileReceiver,
    FileSender,
    Receiver,
    ZmqReceiver,
    ZmqSender,
    rank_topic,
)


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def free_port_pair() -> int:
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port


def make_payloads(count: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        buf = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        buf[:8] = i.to_bytes(8, "big")
        buf[-8:] = i.to_bytes(8, "big")
        out.append(bytes(buf))
    return out


def check(data: object, payloads: list[bytes], k: int) -> None:
    expected = payloads[k % len(payloads)]
    view = memoryview(data)  # type: ignore[arg-type]
    assert view.nbytes == len(expected), (view.nbytes, len(expected))
    assert view[:64] == expected[:64], f"payload {k} corrupt"
    assert view[-64:] == expected[-64:], f"payload {k} corrupt"


class Heartbeat:
    """Sleeps ``period`` s in a loop and records how late each wake-up was."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(self.period)
            self.lags.append(trio.current_time() - start - self.period)

    def summary(self) -> str:
        if not self.lags:
            return "n/a"
        lags = sorted(self.lags)
        p = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))] * 1000  # noqa: E731
        return f"{p(0.5):.1f} / {p(0.95):.1f} / {lags[-1] * 1000:.1f}"


def bench_blocking_threads(
    payloads: list[bytes], n: int, hwm: int, window: int, contexts: int = 1
) -> float:
    """Plain pyzmq; ``contexts=2`` gives each side its own context (and zmq I/O thread), as
    two processes have and as the trio transport's sender and receiver have."""
    port = free_port_pair()
    ctx = zmq.Context()
    sub_ctx = zmq.Context() if contexts == 2 else ctx
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, hwm)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sub = sub_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, hwm)
    sub.setsockopt(zmq.SUBSCRIBE, rank_topic(0))
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # no READY barrier here: give the subscription time to arrive
    credits = threading.Semaphore(window)
    topic = rank_topic(0)

    def send() -> None:
        for k in range(n):
            credits.acquire()
            pub.getsockopt(zmq.EVENTS)  # as the transport does: see ZmqSender.send
            pub.send_multipart([topic, payloads[k % len(payloads)]], copy=False)

    def recv() -> None:
        sub.setsockopt(zmq.RCVTIMEO, 30_000)
        for k in range(n):
            _, frame = sub.recv_multipart(copy=False)
            check(frame.buffer, payloads, k)
            credits.release()

    start = time.perf_counter()
    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    pub.close(linger=0)
    sub.close(linger=0)
    ctx.term()
    if sub_ctx is not ctx:
        sub_ctx.term()
    return elapsed


async def windowed_transfer(
    send: Callable[[int], object],
    rx: Receiver,
    payloads: list[bytes],
    n: int,
    window: int,
) -> float:
    received = 0
    progress = trio.Event()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def sender() -> None:
            for k in range(n):
                while k - received >= window:
                    await progress.wait()
                await send(k)  # type: ignore[misc]

        nursery.start_soon(sender)
        for k in range(n):
            item = await rx.receive()
            check(item.data, payloads, k)
            # Freeing a 64 MiB buffer takes ~20 ms (munmap): drop the last reference in a
            # worker thread, as BatchReceiver does after decoding.
            box = [item]
            del item
            await trio.to_thread.run_sync(box.clear)
            received += 1
            progress.set()
            progress = trio.Event()
    return time.perf_counter() - start


async def bench_trio_zmq(
    payloads: list[bytes], n: int, hwm: int, window: int
) -> tuple[float, Heartbeat]:
    port = free_port_pair()
    beat = Heartbeat()
    async with (
        ZmqSender(1, port=port, hwm=hwm, ready_timeout=30) as tx,
        ZmqReceiver(0, port=port, hwm=hwm) as rx,
        trio.open_nursery() as nursery,
    ):
        await tx.wait_ready()
        nursery.start_soon(beat.run)

        async def send(k: int) -> None:
            await tx.send(k, [payloads[k % len(payloads)]])

        elapsed = await windowed_transfer(send, rx, payloads, n, window)
        nursery.cancel_scope.cancel()
    return elapsed, beat


async def bench_trio_files(
    payloads: list[bytes], n: int, window: int, fsync: bool, use_mmap: bool
) -> tuple[float, Heartbeat]:
    beat = Heartbeat()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        async with (
            FileSender(tmp, 1, fsync=fsync) as tx,
            FileReceiver(
                tmp, 0, delete=True, poll_interval=0.001, timeout=60, use_mmap=use_mmap
            ) as rx,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(beat.run)

            async def send(k: int) -> None:
                await tx.send(k, [payloads[k % len(payloads)]])

            elapsed = await windowed_transfer(send, rx, payloads, n, window)
            nursery.cancel_scope.cancel()
    return elapsed, beat


async def idle_heartbeat(seconds: float = 2.0) -> Heartbeat:
    beat = Heartbeat()
    with trio.move_on_after(seconds):
        await beat.run()
    return beat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--messages", type=int, default=16)
    parser.add_argument("--hwm", type=int, default=4)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fsync", action="store_true", help="fsync each file (default off)")
    parser.add_argument("--zmq-only", action="store_true", help="skip the file transport rows")
    args = parser.parse_args()
    size = args.size_mib << 20
    n = args.messages
    payloads = make_payloads(args.window + 2, size)
    total_gb = n * size / 1e9
    print(
        f"{n} payloads of {args.size_mib} MiB, 1 rank, tcp loopback, hwm {args.hwm}, "
        f"window {args.window}, fsync {args.fsync}, repeat {args.repeat}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    rows: dict[str, list[tuple[float, str]]] = {}
    ratios: list[float] = []
    cpu_per_gb: dict[str, list[float]] = {"threads": [], "threads, 2 contexts": [], "trio": []}
    modes = list(cpu_per_gb)
    for rep in range(args.repeat):
        beat = trio.run(idle_heartbeat)
        rows.setdefault("(idle loop, no transfer: lag baseline)", []).append((0.0, beat.summary()))
        # Alternate which ZeroMQ mode goes first: the machine's load drifts between runs.
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            cpu_start = process_cpu()
            if mode == "threads":
                t_threads = bench_blocking_threads(payloads, n, args.hwm, args.window)
            elif mode == "threads, 2 contexts":
                t_two = bench_blocking_threads(payloads, n, args.hwm, args.window, contexts=2)
            else:
                t_trio, beat = trio.run(bench_trio_zmq, payloads, n, args.hwm, args.window)
            cpu_per_gb[mode].append((process_cpu() - cpu_start) / total_gb)
        rows.setdefault("zmq blocking threads (pyzmq)", []).append((total_gb / t_threads, "n/a"))
        rows.setdefault("zmq blocking threads, 2 contexts", []).append((total_gb / t_two, "n/a"))
        rows.setdefault("zmq trio (ZmqSender/Receiver)", []).append(
            (total_gb / t_trio, beat.summary())
        )
        ratios.append(t_threads / t_trio)
        for use_mmap in () if args.zmq_only else (False, True):
            t, beat = trio.run(bench_trio_files, payloads, n, args.window, args.fsync, use_mmap)
            name = "files trio (FileSender/Receiver" + (", use_mmap)" if use_mmap else ")")
            rows.setdefault(name, []).append((total_gb / t, beat.summary()))
    print(f"{'transport':46} {'GB/s (each run)':24} loop lag p50 / p95 / max ms (each run)")
    for name, results in rows.items():
        rates = " ".join(f"{r:.2f}" for r, _ in results)
        lags = " | ".join(lag for _, lag in results)
        med = statistics.median(r for r, _ in results)
        print(f"{name:46} {rates:16} (med {med:.2f})  {lags}")
    print(
        "zmq trio / blocking threads, per run: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f"  (median {statistics.median(ratios):.2f}x, "
        f"spread {min(ratios):.2f}-{max(ratios):.2f})"
    )
    med = statistics.median(ratios)
    print(
        f"goal 6: zmq trio / plain blocking pyzmq threads, median of {len(ratios)} runs "
        f"{med:.2f}x (goal >= 1.0x: {'reached' if med >= 1.0 else 'not reached'}; "
        f"spread {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    print(
        "zmq process CPU seconds per GB moved (all threads, zmq's I/O threads included), "
        "median [min-max]: "
        + ", ".join(
            f"{mode} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"
            for mode, v in cpu_per_gb.items()
        )
    )


if __name__ == "__main__":
    main()
