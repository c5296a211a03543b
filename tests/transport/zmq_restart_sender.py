"""A ZeroMQ sender process for the restart test: sends steps ``start..stop-1`` to one rank.

    python zmq_restart_sender.py PORT START STOP INTERVAL [--end]

Prints ``sent S`` after each step (flushed), then, with ``--end``, ends the stream at STOP.
"""

from __future__ import annotations

import sys

import trio

from trio_rl.transport import ZmqSender


def payload(step: int) -> bytes:
    return f"step {step} ".encode() * 1000


async def main(port: int, start: int, stop: int, interval: float, end: bool) -> None:
    async with ZmqSender(1, port=port, ready_timeout=20, linger=5) as sender:
        for step in range(start, stop):
            await sender.send(step, [payload(step)])
            print(f"sent {step}", flush=True)
            await trio.sleep(interval)
        if end:
            await sender.end_stream(stop)
            print("ended", flush=True)


if __name__ == "__main__":
    port, start, stop = (int(a) for a in sys.argv[1:4])
    trio.run(main, port, start, stop, float(sys.argv[4]), "--end" in sys.argv[5:])
