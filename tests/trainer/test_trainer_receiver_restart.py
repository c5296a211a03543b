"""`BatchReceiver` over a deleting file transport: cancelled at any point, then closed, a step
is either delivered or still on disk for the next receiver."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from conftest import scaled
from trio_rl.errors import InvalidArgumentError
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender, batch_path
from trio_rl.wire import MicroBatch, encode

BIG = 256 * 1024  # the default thread threshold: decoded in a worker thread


def micro_batches(step: int, tokens: int) -> list[MicroBatch]:
    return [
        MicroBatch(
            input_ids=[step * 10_000 + i for i in range(tokens)],
            loss_mask=[i % 3 == 0 for i in range(tokens)],
            advantages=[step / 3] * tokens,
            inference_logprobs=[-0.25] * tokens,
            position_ids=list(range(tokens)),
            sequence_lengths=[tokens],
            temperatures=[1.0] * tokens,
            env_names=["env"],
            seq_lens=[tokens],
        )
    ]


async def write_steps(directory: Path, steps: int, tokens: int) -> list[list[MicroBatch]]:
    sent = [micro_batches(s, tokens) for s in range(steps)]
    async with FileSender(directory, world_size=1, fsync=False) as sender:
        for s in range(steps):
            await sender.send(s, [encode(sent[s])])
    return sent


# 16k tokens of ids, logprobs, ... is about 300 KiB encoded; 16 tokens a few hundred bytes.
SIZES = {"big": 16_384, "small": 16}


@pytest.mark.parametrize("start", ["next_step", "resume"])
async def test_a_cancel_while_the_decode_limiter_is_held_leaves_the_step_on_disk(
    tmp_path: Path, start: str
) -> None:
    sent = await write_steps(tmp_path, 3, SIZES["big"])
    assert len(encode(sent[0])) >= BIG
    limiter = trio.CapacityLimiter(1)
    with trio.fail_after(20):
        async with BatchReceiver(
            FileReceiver(tmp_path, 0, delete=True), limiter=limiter
        ) as receiver:
            assert await receiver.receive() == (0, sent[0])
            async with limiter, trio.open_nursery() as nursery:
                # The payload of step 1 is read, then its decode waits for the limiter.
                nursery.start_soon(receiver.receive)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            assert receiver.next_step == 1
        assert batch_path(tmp_path, 1, 0).exists()
        start_step = receiver.next_step if start == "next_step" else None
        async with BatchReceiver.files(tmp_path, 0, start_step=start_step, delete=True) as again:
            assert again.next_step == 1
            assert await again.receive() == (1, sent[1])
            assert await again.receive() == (2, sent[2])
    assert not (tmp_path / "batches" / "step_1").exists()


class CancelAtTaskStep(trio.abc.Instrument):
    """Cancels ``scope`` when ``task`` is scheduled for its ``k``-th step from now (at once
    for ``k == 0``): the cancellation lands at the first await point that step reaches."""

    def __init__(self, task: trio.lowlevel.Task, k: int, scope: trio.CancelScope) -> None:
        self.task, self.k, self.scope, self.seen = task, k, scope, 0
        if k == 0:
            scope.cancel()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.seen += 1
            if self.seen == self.k:
                self.scope.cancel()


@pytest.mark.parametrize("size", sorted(SIZES))
async def test_a_cancel_at_every_await_point_then_a_restart_delivers_each_step_exactly_once(
    tmp_path: Path, size: str
) -> None:
    steps = scaled(6)
    sent = await write_steps(tmp_path, steps, SIZES[size])
    delivered: list[int] = []
    cancels = 0
    start = 0
    with trio.fail_after(60):
        while len(delivered) < steps:
            k = 0
            while True:  # cancel the receive of this step at its 1st, 2nd, ... await point
                async with BatchReceiver.files(tmp_path, 0, start_step=start, delete=True) as r:
                    with trio.CancelScope() as scope:
                        instrument = CancelAtTaskStep(trio.lowlevel.current_task(), k, scope)
                        trio.lowlevel.add_instrument(instrument)
                        try:
                            step, got = await r.receive()
                        finally:
                            trio.lowlevel.remove_instrument(instrument)
                        assert got == sent[step]
                        delivered.append(step)
                start = r.next_step  # where the old receiver stopped
                if not scope.cancelled_caught:
                    break
                cancels += 1
                k += 1
    assert delivered == list(range(steps))
    assert cancels >= steps * (4 if size == "big" else 2)  # every step was cut several times
    assert not any((tmp_path / "batches").glob("step_*"))


async def test_resume_mode_restarts_after_every_cut(tmp_path: Path) -> None:
    """The same, with every new receiver resuming by itself (``start_step=None``)."""
    steps = scaled(4)
    sent = await write_steps(tmp_path, steps, SIZES["big"])
    delivered: list[int] = []
    with trio.fail_after(60):
        while len(delivered) < steps:
            k = 0
            while True:
                async with BatchReceiver.files(tmp_path, 0, start_step=None, delete=True) as r:
                    with trio.CancelScope() as scope:
                        instrument = CancelAtTaskStep(trio.lowlevel.current_task(), k, scope)
                        trio.lowlevel.add_instrument(instrument)
                        try:
                            step, got = await r.receive()
                        finally:
                            trio.lowlevel.remove_instrument(instrument)
                        assert got == sent[step]
                        delivered.append(step)
                if not scope.cancelled_caught:
                    break
                k += 1
    assert delivered == list(range(steps))


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_a_bad_timeout_is_an_invalid_argument_naming_it(tmp_path: Path, timeout: float) -> None:
    receiver = FileReceiver(tmp_path, rank=0)
    with pytest.raises(InvalidArgumentError, match=r"BatchReceiver timeout must be >= 0"):
        BatchReceiver(receiver, timeout=timeout)
