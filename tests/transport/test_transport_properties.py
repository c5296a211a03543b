"""Properties of the filesystem transport and the receiver, with Hypothesis (real files)."""

from __future__ import annotations

import tempfile

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import scaled
from trio_rl.trainer import BatchReceiver
from trio_rl.transport import FileReceiver, FileSender, batch_path
from trio_rl.wire import MicroBatch, WireFormatError, encode

steps_of_payloads = st.integers(1, 4).flatmap(
    lambda world: st.lists(
        st.lists(st.binary(max_size=300), min_size=world, max_size=world), min_size=1, max_size=3
    )
)


# Each example is a trio run with real files and worker threads: fewer, costlier examples.
@settings(max_examples=scaled(100))
@given(start=st.integers(0, 10**6), grid=steps_of_payloads)
async def test_every_payload_arrives_byte_for_byte_at_its_rank_and_step(
    start: int, grid: list[list[bytes]]
) -> None:
    world = len(grid[0])
    with tempfile.TemporaryDirectory() as tmp:
        async with FileSender(tmp, world_size=world, fsync=False) as sender:
            for i, payloads in enumerate(grid):
                await sender.send(start + i, payloads)
        for rank in range(world):
            async with FileReceiver(tmp, rank, start_step=start, timeout=5) as rx:
                got = [await rx.receive() for _ in grid]
            assert [(g.step, g.rank, g.data) for g in got] == [
                (start + i, rank, payloads[rank]) for i, payloads in enumerate(grid)
            ]


def _micro_batch(n: int) -> MicroBatch:
    return MicroBatch(
        input_ids=list(range(n)),
        loss_mask=[True] * n,
        advantages=[0.25] * n,
        inference_logprobs=[-1.5] * n,
        position_ids=list(range(n)),
        sequence_lengths=[n],
        temperatures=[1.0] * n,
        env_names=["env"],
        seq_lens=[n],
    )


_GOOD = encode([_micro_batch(3), _micro_batch(5)])


@settings(max_examples=scaled(150))
@given(
    cut=st.integers(0, len(_GOOD) - 1),
    flips=st.lists(st.tuples(st.integers(0, len(_GOOD) - 1), st.integers(0, 255)), max_size=3),
)
async def test_a_damaged_file_decodes_or_raises_wire_format_error_naming_it(
    cut: int, flips: list[tuple[int, int]]
) -> None:
    """Truncated and byte-flipped payloads: never a hang or a foreign exception; the error
    names the file and an offset inside the data."""
    data = bytearray(_GOOD[: max(cut, 1)] if flips == [] else _GOOD)
    for offset, value in flips:
        if offset < len(data):
            data[offset] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = batch_path(tmp, 0, 0)
        path.parent.mkdir(parents=True)
        path.write_bytes(bytes(data))
        with trio.fail_after(10):
            async with BatchReceiver.files(tmp, 0, timeout=5) as receiver:
                error: WireFormatError | None = None
                try:
                    step, micro_batches = await receiver.receive()
                except WireFormatError as exc:
                    error = exc
                assert receiver.next_step == 1
    if error is not None:
        assert error.source == str(path)
        assert 0 <= error.offset <= len(data)
    else:
        assert step == 0
        assert all(isinstance(mb, MicroBatch) for mb in micro_batches)
