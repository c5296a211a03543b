"""A ZeroMQ sender process for the restart test: sends steps ``start..stop-1`` to one rank.

    python zmq_restart_sender.py PORT WORLD START STOP INTERVAL [--end]

Sends rank R ``payload(S, R)``; prints ``sent S`` after each step (flushed), then, with
``--end``, ends the stream at STOP.
"""

from __future__ import annotations

import sys

import trio

from trio_rl.transport import ZmqSender


def payload(step: int, rank: int) -> bytes:
    return f"step {step} rank {rank} ".encode() * 1000


async def main(port: int, world: int, start: int, stop: int, interval: float, end: bool) -> None:
    async with ZmqSender(world, port=port, ready_timeout=20, linger=5) as sender:
        for step in range(start, stop):
            await sender.send(step, [payload(step, rank) for rank in range(world)])
            print(f"sent {step}", flush=True)
            await trio.sleep(interval)
        if end:
            await sender.end_stream(stop)
            print("ended", flush=True)


if __name__ == "__main__":
    port, world, start, stop = (int(a) for a in sys.argv[1:5])
    trio.run(main, port, world, start, stop, float(sys.argv[5]), "--end" in sys.argv[6:])
